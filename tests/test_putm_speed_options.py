"""PUTM's speed options (issue 6): fused solver, precision, early stopping, CPU chunking.

The fused engine (hand-written backward + one flat Adam update) must give bit-identical results to the
autograd engine in fp32 on CPU, and every precision must keep a task's result independent of batching and
chunking.
Small problems (d = 32, few EM/Adam steps) and one thread keep the whole file to a few seconds.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_clustered_features
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.errors import ConfigError
from lightning_putm.methods import build_method
from lightning_putm.methods.putm import PUTM
from lightning_putm.methods.putm.adam import StackedAdam
from lightning_putm.methods.putm.loss import ct_loss, ct_loss_gradient
from lightning_putm.methods.putm.precision import PRECISIONS, resolve_precision
from lightning_putm.methods.putm.workers import CPU_MAX_CHUNK_TASKS
from lightning_putm.metrics import task_accuracy

pytestmark = pytest.mark.usefixtures("single_thread")

FAST = dict(em_steps=3, inner_steps=4)
EXACT = dict(precision="fp32")


def make_tasks(tasks: int = 5, queries: int = 30, dim: int = 32, alpha: float | None = 2.0, seed: int = 0,
               spread: float = 0.15, ways: int = 5, shots: int = 1):
    features = make_clustered_features(classes=8, per_class=50, dim=dim, spread=spread, seed=seed)
    bank = sample_episode_bank(features.labels, ways, shots, queries, alpha, tasks, seed)
    return bank.gather(features.features)


@pytest.mark.parametrize("options", [dict(), dict(balanced=True), dict(reinit_navigator=True),
                                     dict(prototype_update="mixed", rho=0.7, theta=0.2),
                                     dict(hidden=[16, 8, 8])])
def test_fused_solver_is_bit_identical_to_autograd(options):
    gathered = make_tasks(tasks=4)
    balanced = options.pop("balanced", False)
    fused = PUTM(shots=1, balanced=balanced, solver="fused", **EXACT, **FAST, **options)
    plain = PUTM(shots=1, balanced=balanced, solver="autograd", **EXACT, **FAST, **options)
    assert torch.equal(fused.predict(gathered.batch), plain.predict(gathered.batch))
    assert torch.equal(fused.last_state["prototypes"], plain.last_state["prototypes"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_solver_is_bit_identical_alone_in_a_batch_and_in_chunks(precision):
    gathered = make_tasks(tasks=7)
    options = dict(precision=precision, **FAST)
    together = PUTM(shots=1, balanced=False, max_chunk_tasks=100, **options).predict(gathered.batch)
    chunked = PUTM(shots=1, balanced=False, max_chunk_tasks=3, **options).predict(gathered.batch)
    assert torch.equal(together, chunked)
    for t in (0, 4, 6):
        alone = PUTM(shots=1, balanced=False, **options).predict(gathered.batch.slice(t, t + 1))
        assert torch.equal(alone, together[t : t + 1])


def test_stacked_adam_replays_torch_adam_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=generator)
    ours = StackedAdam(start.clone(), lr=1e-3, betas=(0.5, 0.99))
    reference = start.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([reference], lr=1e-3, betas=(0.5, 0.99))
    for step in range(12):
        grad = torch.randn(1000, generator=generator) * (10.0 if step % 3 else 1e-3)
        ours.step(grad)
        reference.grad = grad.clone()
        optimiser.step()
    assert torch.equal(ours.params, reference.detach())


@pytest.mark.parametrize("rho,theta", [(0.5, 0.0), (1.0, 0.001), (0.3, 0.2)])
def test_ct_loss_gradient_equals_autograd(rho, theta):
    generator = torch.Generator().manual_seed(1)
    cost = torch.rand(3, 11, 4, generator=generator)
    logits = (3 * torch.randn(3, 11, 4, generator=generator)).requires_grad_(True)
    ct_loss(cost, logits.softmax(2), logits.softmax(1), rho, theta).sum().backward()
    forward, backward, grad = ct_loss_gradient(cost, logits.detach(), rho, theta)
    assert torch.equal(grad, logits.grad)
    assert torch.equal(forward, logits.detach().softmax(2)) and torch.equal(backward, logits.detach().softmax(1))


@pytest.mark.parametrize("key,value,allowed", [("precision", "fp16", PRECISIONS), ("solver", "jit", ("fused", "autograd"))])
def test_bad_option_values_name_the_allowed_ones(key, value, allowed):
    with pytest.raises(ConfigError, match=", ".join(allowed)):
        PUTM(shots=1, balanced=False, **{key: value})
    with pytest.raises(ConfigError, match=key):
        build_method("putm", {key: value}, shots=1, balanced=False)


def test_bad_early_stop_and_chunk_values_are_refused():
    with pytest.raises(ConfigError, match="early_stop_tol"):
        PUTM(shots=1, balanced=False, early_stop_tol=-1.0)
    with pytest.raises(ConfigError, match="max_chunk_tasks"):
        PUTM(shots=1, balanced=False, max_chunk_tasks=0)
    with pytest.raises(ConfigError, match="solver=autograd"):
        PUTM(shots=1, balanced=False, hidden=[16, 4])


def test_tf32_is_exact_fp32_on_cpu_and_global_precision_is_restored():
    gathered = make_tasks(tasks=2)
    before = torch.get_float32_matmul_precision()
    fp32 = PUTM(shots=1, balanced=False, precision="fp32", **FAST).predict(gathered.batch)
    tf32 = PUTM(shots=1, balanced=False, precision="tf32", **FAST).predict(gathered.batch)
    assert torch.equal(fp32, tf32)
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.parametrize("solver", ["fused", "autograd"])
def test_bf16_runs_and_mostly_agrees_with_fp32(solver):
    gathered = make_tasks(tasks=6, queries=40, spread=0.3)
    options = dict(em_steps=5, inner_steps=10, solver=solver)
    fp32 = PUTM(shots=1, balanced=False, precision="fp32", **options).predict(gathered.batch)
    bf16 = PUTM(shots=1, balanced=False, precision="bf16", **options).predict(gathered.batch)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert torch.allclose(bf16.sum(2), torch.ones(6, 40), atol=1e-5)
    assert float((bf16.argmax(2) == fp32.argmax(2)).float().mean()) >= 0.95
    accuracy = [float(task_accuracy(p, gathered.query_labels).mean()) for p in (fp32, bf16)]
    assert abs(accuracy[0] - accuracy[1]) <= 0.03


def test_auto_precision_is_bf16_only_where_bf16_is_native():
    native = any(getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                         "_is_amx_tile_supported"))
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if native else "fp32")
    for precision in ("fp32", "tf32", "bf16"):
        assert resolve_precision(precision, torch.device("cpu")) == precision
    gathered = make_tasks(tasks=2)
    method = PUTM(shots=1, balanced=False, **FAST)
    explicit = PUTM(shots=1, balanced=False, precision=resolve_precision("auto", torch.device("cpu")), **FAST)
    assert torch.equal(method.predict(gathered.batch), explicit.predict(gathered.batch))
    assert method.last_precision == resolve_precision("auto", torch.device("cpu"))


def test_early_stopping_with_zero_tolerance_equals_the_full_run():
    gathered = make_tasks(tasks=4)
    options = dict(em_steps=6, inner_steps=3)
    full = PUTM(shots=1, balanced=False, **options)
    never = PUTM(shots=1, balanced=False, early_stop_tol=0.0, **options)
    assert torch.equal(full.predict(gathered.batch), never.predict(gathered.batch))
    assert never.last_state["em_steps"].tolist() == [6] * 4
    assert full.last_state["em_steps"].tolist() == [6] * 4


def test_early_stopping_stops_earlier_and_keeps_results_independent_of_chunking():
    gathered = make_tasks(tasks=6)
    options = dict(em_steps=8, inner_steps=3, early_stop_tol=0.05)
    whole = PUTM(shots=1, balanced=False, max_chunk_tasks=100, **options)
    together = whole.predict(gathered.batch)
    steps = whole.last_state["em_steps"]
    assert int(steps.max()) < 8 and int(steps.min()) >= 1
    chunked = PUTM(shots=1, balanced=False, max_chunk_tasks=4, **options).predict(gathered.batch)
    assert torch.equal(together, chunked)
    alone = PUTM(shots=1, balanced=False, **options)
    assert torch.equal(alone.predict(gathered.batch.slice(5, 6)), together[5:6])
    assert int(alone.last_state["em_steps"][0]) == int(steps[5])
    assert torch.allclose(together.sum(2), torch.ones(6, 30), atol=1e-5)


def test_early_stopping_with_some_tasks_settling_first():
    """Tasks leave the batch at different EM steps; everyone still gets the result it gets alone."""
    gathered = make_tasks(tasks=6)
    options = dict(em_steps=10, inner_steps=3, early_stop_tol=0.02, reinit_navigator=True)
    method = PUTM(shots=1, balanced=False, **options)
    together = method.predict(gathered.batch)
    for t in range(6):
        alone = PUTM(shots=1, balanced=False, **options).predict(gathered.batch.slice(t, t + 1))
        assert torch.equal(alone, together[t : t + 1])


def test_early_stopping_gives_the_same_results_with_both_solvers():
    gathered = make_tasks(tasks=5)
    options = dict(em_steps=8, inner_steps=3, early_stop_tol=0.03, **EXACT)
    fused = PUTM(shots=1, balanced=False, solver="fused", **options)
    plain = PUTM(shots=1, balanced=False, solver="autograd", **options)
    assert torch.equal(fused.predict(gathered.batch), plain.predict(gathered.batch))
    assert torch.equal(fused.last_state["em_steps"], plain.last_state["em_steps"])
    assert int(fused.last_state["em_steps"].min()) < 8


def test_cpu_chunks_are_capped_for_cache_and_the_cap_is_configurable():
    gathered = make_tasks(tasks=CPU_MAX_CHUNK_TASKS + 3)
    default = PUTM(shots=1, balanced=False, memory_budget_mb=1e6)
    assert default.chunk_size(gathered.batch) == CPU_MAX_CHUNK_TASKS
    assert PUTM(shots=1, balanced=False, memory_budget_mb=1e6, max_chunk_tasks=5).chunk_size(gathered.batch) == 5
    assert PUTM(shots=1, balanced=False, memory_budget_mb=0.5, max_chunk_tasks=1000).chunk_size(gathered.batch) < 5


def test_cpu_workers_give_the_results_of_one_thread_and_restore_the_thread_count():
    gathered = make_tasks(tasks=7)
    sequential = PUTM(shots=1, balanced=False, cpu_workers=1, **FAST).predict(gathered.batch)
    counted: list[int] = []
    workers = PUTM(shots=1, balanced=False, cpu_workers=3, max_chunk_tasks=4, **FAST)
    assert torch.equal(workers.predict(gathered.batch, on_chunk=counted.append), sequential)
    assert counted == [4, 3] and workers.num_chunks(gathered.batch) == 2
    assert torch.get_num_threads() == 1
    last = PUTM(shots=1, balanced=False, **FAST)
    last.predict(gathered.batch.slice(6, 7))  # the last part: chunk [4, 7) shared by 3 workers ends with [6, 7)
    assert torch.equal(workers.last_state["rows"], last.last_state["rows"])
    torch.set_num_threads(2)
    try:
        default = PUTM(shots=1, balanced=False, **FAST)  # two threads -> two workers, one kernel thread each
        assert default.cpu_workers(torch.device("cpu")) == 2
        assert torch.equal(default.predict(gathered.batch), sequential)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
