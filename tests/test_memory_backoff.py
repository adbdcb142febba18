"""Chunk sizes from free device memory, and the out-of-memory back-off of ``FewShotMethod.predict``.

CUDA is faked: ``torch.cuda.mem_get_info`` & co. are monkeypatched and only a ``torch.device("cuda")`` object is
passed around, so nothing is allocated on a GPU; the out-of-memory error is raised by a patched ``solve``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import make_clustered_features
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.errors import ConfigError
from lightning_putm.methods import base
from lightning_putm.methods.base import AUTO_BUDGET_MB, FREE_MEMORY_FRACTION, OUT_OF_MEMORY
from lightning_putm.methods.ptmap import PTMAP
from lightning_putm.methods.putm import PUTM
from lightning_putm.methods.simpleshot import SimpleShot
from lightning_putm.evaluation.options import EvaluateOptions
from lightning_putm.job_options import checked, checked_memory_budget
from lightning_putm.prediction.options import PredictOptions

MB = 2**20
CUDA = torch.device("cuda", 0)


def make_gathered(tasks: int = 10, dim: int = 16, queries: int = 15):
    features = make_clustered_features(classes=10, per_class=40, dim=dim, seed=3)
    return sample_episode_bank(features.labels, 5, 1, queries, 2.0, tasks, seed=3).gather(features.features)


def fail_above(method, limit: int, monkeypatch) -> list[int]:
    """Make ``method.solve`` raise out-of-memory on chunks of more than ``limit`` tasks; returns the sizes tried."""
    tried: list[int] = []
    solve = method.solve

    def solve_or_fail(chunk, **kwargs):
        tried.append(chunk.num_tasks)
        if chunk.num_tasks > limit:
            raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB")
        return solve(chunk, **kwargs)

    monkeypatch.setattr(method, "solve", solve_or_fail)
    return tried


def fake_cuda(monkeypatch, free_mb: float, reserved_mb: float = 0.0, allocated_mb: float = 0.0) -> list:
    calls: list = []

    def mem_get_info(device=None):
        calls.append(device)
        return int(free_mb * MB), int(80_000 * MB)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved_mb * MB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(allocated_mb * MB))
    return calls


def fake_tasks(device: torch.device, tasks: int = 10_000):
    """What ``chunk_size`` reads of a TaskBatch, on a device that need not exist."""
    return SimpleNamespace(num_tasks=tasks, num_support=5, num_queries=75, dim=640, ways=5,
                           support=SimpleNamespace(device=device))


# ------------------------------------------------------------------------------------------- sizing
def test_cpu_budget_is_unchanged_and_auto_means_2048_mb():
    method = SimpleShot(memory_budget_mb=0.05)
    gathered = make_gathered(tasks=50)
    assert method.memory_budget_bytes(torch.device("cpu")) == 0.05 * MB
    assert method.chunk_size(gathered.batch) == int(0.05 * MB / method.bytes_per_task(gathered.batch)) < 50
    auto = SimpleShot(memory_budget_mb="auto")
    assert auto.memory_budget_bytes(torch.device("cpu")) == AUTO_BUDGET_MB * MB == 2048 * MB
    assert auto.chunk_size(gathered.batch) == SimpleShot(memory_budget_mb=2048).chunk_size(gathered.batch)


def test_cuda_budget_is_the_cap_or_a_share_of_free_memory(monkeypatch):
    calls = fake_cuda(monkeypatch, free_mb=1000, reserved_mb=300, allocated_mb=100)  # 200 MB cached but unused
    available = FREE_MEMORY_FRACTION * 1200 * MB
    assert SimpleShot(memory_budget_mb=2048).memory_budget_bytes(CUDA) == pytest.approx(available)
    assert SimpleShot(memory_budget_mb=100).memory_budget_bytes(CUDA) == 100 * MB  # the cap wins
    assert SimpleShot(memory_budget_mb="auto").memory_budget_bytes(CUDA) == pytest.approx(available)
    assert calls and all(device == CUDA for device in calls)  # asked about the tasks' own device
    fake_cuda(monkeypatch, free_mb=60_000)
    assert SimpleShot(memory_budget_mb="auto").memory_budget_bytes(CUDA) == pytest.approx(0.8 * 60_000 * MB)


def test_chunk_size_follows_free_cuda_memory(monkeypatch):
    putm = PUTM(shots=1, balanced=False, memory_budget_mb="auto")
    per_task = putm.bytes_per_task(fake_tasks(CUDA))
    fake_cuda(monkeypatch, free_mb=1000)
    small = putm.chunk_size(fake_tasks(CUDA))
    assert small == int(FREE_MEMORY_FRACTION * 1000 * MB / per_task)
    fake_cuda(monkeypatch, free_mb=8000)
    assert putm.chunk_size(fake_tasks(CUDA)) == int(FREE_MEMORY_FRACTION * 8000 * MB / per_task) > small
    fake_cuda(monkeypatch, free_mb=0)
    assert putm.chunk_size(fake_tasks(CUDA)) == 1  # never zero
    capped = PUTM(shots=1, balanced=False, memory_budget_mb="auto", max_chunk_tasks=7)
    fake_cuda(monkeypatch, free_mb=8000)
    assert capped.chunk_size(fake_tasks(CUDA)) == 7


def test_cpu_never_asks_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("mem_get_info called on CPU"))
    gathered = make_gathered(tasks=4)
    SimpleShot(memory_budget_mb="auto").predict(gathered.batch)


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "big", True, None])
def test_bad_budgets_are_refused_by_one_rule(value):
    """Kills: the constructor checking ``memory_budget_mb`` with a rule of its own (accepting ``inf`` or ``True``,
    or wording it otherwise) instead of the one both jobs' fields declare."""
    said = []
    for check in (lambda: SimpleShot(memory_budget_mb=value),
                  lambda: checked(EvaluateOptions, "memory_budget_mb", value),
                  lambda: checked(PredictOptions, "memory_budget_mb", value)):
        with pytest.raises(ConfigError, match=r"^`memory_budget_mb` must be a positive number \(MB\) or auto, got ") \
                as e:
            check()
        said.append(str(e.value))
    assert len(set(said)) == 1, said


def test_budgets_are_parsed_alike():
    """Kills: the constructor or a job keeping an int (or the word) where the other converts it."""
    for value, parsed in (("auto", "auto"), (512, 512.0), (0.5, 0.5)):
        for got in (checked_memory_budget(value), SimpleShot(memory_budget_mb=value).memory_budget_mb,
                    checked(EvaluateOptions, "memory_budget_mb", value)):
            assert got == parsed and type(got) is type(parsed)


# ------------------------------------------------------------------------------------------- back-off
def test_out_of_memory_halves_the_chunk_and_loses_nothing(monkeypatch, capsys):
    gathered = make_gathered(tasks=10)
    expected = SimpleShot(memory_budget_mb=1e6).predict(gathered.batch)
    method = SimpleShot(memory_budget_mb=1e6)  # plans one chunk of 10 tasks
    tried = fail_above(method, 3, monkeypatch)
    seen: list[int] = []
    result = method.predict(gathered.batch, on_chunk=seen.append)
    assert torch.equal(result, expected)
    assert tried == [10, 5, 2, 2, 2, 2, 2]  # 10 fails, 5 fails, then chunks of 2 from the failed start
    assert seen == [2, 2, 2, 2, 2]  # failed attempts are not reported as progress
    assert method.last_chunk_size == 2
    notices = [line for line in capsys.readouterr().err.splitlines() if "out of memory" in line]
    assert notices == ["simpleshot: out of memory on cpu with 10 tasks per chunk; retrying with 5 tasks per chunk",
                       "simpleshot: out of memory on cpu with 5 tasks per chunk; retrying with 2 tasks per chunk"]


def test_back_off_from_a_later_chunk_keeps_earlier_results(monkeypatch, capsys):
    gathered = make_gathered(tasks=9)
    expected = SimpleShot(memory_budget_mb=1e6).predict(gathered.batch)
    method = SimpleShot(memory_budget_mb=1e6)
    per_task = method.bytes_per_task(gathered.batch)
    method.memory_budget_mb = 4 * per_task / MB  # chunks of 4: [0:4] [4:8] [8:9]
    calls = {"n": 0}
    solve = method.solve

    def second_chunk_fails_once(chunk, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OUT_OF_MEMORY("CUDA out of memory")
        return solve(chunk, **kwargs)

    monkeypatch.setattr(method, "solve", second_chunk_fails_once)
    assert torch.equal(method.predict(gathered.batch), expected)
    assert calls["n"] == 5  # 4 ok, 4 fails, 2 + 2 + 1
    assert capsys.readouterr().err.count("out of memory") == 1


def test_oracle_counts_follow_the_retried_chunks(monkeypatch):
    gathered = make_gathered(tasks=6)
    counts = gathered.query_labels.new_zeros(6, 5)
    counts.scatter_add_(1, gathered.query_labels, torch.ones_like(gathered.query_labels))
    expected = PTMAP(query_counts=counts, memory_budget_mb=1e6).predict(gathered.batch)
    method = PTMAP(query_counts=counts, memory_budget_mb=1e6)
    fail_above(method, 2, monkeypatch)
    assert torch.equal(method.predict(gathered.batch), expected)


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_putm_backs_off_with_identical_results(monkeypatch, capsys, precision):
    """Chunks of 2 and 1 tasks after the back-off give the bits of the whole batch, in fp32 too (``auto`` is bf16
    where the CPU multiplies bf16 natively, whose rounding hid a batch-dependent power transform that fp32 shows).
    Kills: a retry that changes the tasks or their seeds; a power transform whose bits depend on the batch."""
    gathered = make_gathered(tasks=5, dim=16, queries=10)
    settings = dict(shots=1, balanced=False, em_steps=2, inner_steps=3, cpu_workers=1, memory_budget_mb=1e6,
                    precision=precision)
    expected = PUTM(**settings).predict(gathered.batch)
    putm = PUTM(**settings)
    tried = fail_above(putm, 1, monkeypatch)
    assert torch.equal(putm.predict(gathered.batch), expected)
    assert tried == [5, 2, 1, 1, 1, 1, 1]
    assert capsys.readouterr().err.count("putm: out of memory") == 2  # 5 -> 2 -> 1
    assert putm.last_chunk_size == 1


def test_a_single_task_that_does_not_fit_raises_a_clear_error(monkeypatch):
    gathered = make_gathered(tasks=3)
    method = SimpleShot(memory_budget_mb=1e6)
    fail_above(method, 0, monkeypatch)
    with pytest.raises(RuntimeError, match=r"simpleshot: out of memory on cpu while solving a single task "
                                           r"\(CUDA out of memory\. Tried to allocate 2\.00 GiB\).*device=cpu") as info:
        method.predict(gathered.batch)
    assert isinstance(info.value.__cause__, OUT_OF_MEMORY)


def test_other_errors_are_not_retried(monkeypatch):
    method = SimpleShot(memory_budget_mb=1e6)
    tried: list[int] = []

    def broken(chunk, **kwargs):
        tried.append(chunk.num_tasks)
        raise RuntimeError("something else")

    monkeypatch.setattr(method, "solve", broken)
    with pytest.raises(RuntimeError, match="something else"):
        method.predict(make_gathered(tasks=4).batch)
    assert tried == [4]


def test_cuda_cache_is_released_after_an_out_of_memory_error(monkeypatch):
    released: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append("cuda"))
    base.release_cached_memory(torch.device("cpu"))
    assert released == []
    base.release_cached_memory(CUDA)
    assert released == ["cuda"]


@pytest.mark.cuda
def test_free_memory_on_a_real_gpu_bounds_the_budget():
    device = torch.device("cuda", torch.cuda.current_device())
    free, _total = torch.cuda.mem_get_info(device)
    budget = SimpleShot(memory_budget_mb="auto").memory_budget_bytes(device)
    assert 0 < budget <= FREE_MEMORY_FRACTION * (free + torch.cuda.memory_reserved(device)) + 1
    assert SimpleShot(memory_budget_mb=1).memory_budget_bytes(device) <= MB


def test_evaluate_accepts_auto_and_hands_it_to_the_methods():
    from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
    from lightning_putm.methods import build_method

    settings = settings_from_config(load_evaluate_config(["methods=[putm]", "memory_budget_mb=auto"]))
    assert settings.memory_budget_mb == "auto"
    putm = build_method("putm", settings.method_params["putm"], shots=1, balanced=False,
                        memory_budget_mb=settings.memory_budget_mb)
    assert putm.memory_budget_mb == "auto"
    assert settings_from_config(load_evaluate_config(["methods=[putm]"])).memory_budget_mb == 2048.0
