"""benchmarks/crosscheck_putm.py: the fp32 acceptance bound follows the measured noise floor.

The engines are stood in for (their agreement is set by hand) so the decision itself is what is checked; the
real engines' agreement is measured on a GPU by ``bash benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import pytest
import torch

from helpers.benchmarks import benchmark_module

crosscheck_putm = benchmark_module("crosscheck_putm")

TASKS = 20  # 20 tasks x 75 queries = 1500 predictions: one flipped prediction is 1/15 of a point


def flipped(probabilities: torch.Tensor, count: int) -> torch.Tensor:
    """The same probabilities with the prediction of the first ``count`` queries moved to another class."""
    flat = probabilities.clone().reshape(-1, probabilities.shape[-1])
    for row in range(count):
        flat[row] = flat[row].roll(1)
    return flat.reshape(probabilities.shape)


def run(monkeypatch, capsys, compiled_flips: int, floor_flips: int | None) -> tuple[int, str]:
    spec = torch.rand(TASKS, 75, 5, generator=torch.Generator().manual_seed(0)).softmax(-1)
    answers = [spec, flipped(spec, compiled_flips)] + ([] if floor_flips is None else [flipped(spec, floor_flips)])
    monkeypatch.setattr(crosscheck_putm, "solve", lambda *args: (answers.pop(0), 1.0))
    monkeypatch.setattr(crosscheck_putm, "task_accuracy", lambda p, labels: torch.full((p.shape[0],), 0.7))
    argv = ["--device", "cpu", "--tasks", str(TASKS), "--dim", "8", "--no-bf16"]
    code = crosscheck_putm.main(argv + (["--no-noise-floor"] if floor_flips is None else []))
    assert not answers  # every engine run was made
    return code, capsys.readouterr().out


def test_compiled_fp32_as_close_as_the_noise_floor_passes(monkeypatch, capsys):
    code, out = run(monkeypatch, capsys, compiled_flips=12, floor_flips=9)  # 99.20% vs a floor of 99.40%
    assert "(noise floor)" in out and "bound for compiled fp32: >= 99.15% same predictions" in out
    assert code == 0 and "FAIL" not in out


def test_compiled_fp32_well_below_the_noise_floor_fails(monkeypatch, capsys):
    code, out = run(monkeypatch, capsys, compiled_flips=15, floor_flips=9)  # 99.00% vs a floor of 99.40%
    assert code == 1 and "FAIL compiled fp32: 99.00% same predictions (need >= 99.15)" in out


def test_a_floor_above_the_fixed_bound_keeps_99_5(monkeypatch, capsys):
    code, out = run(monkeypatch, capsys, compiled_flips=8, floor_flips=0)  # 99.47% vs a floor of 100%
    assert code == 1 and "need >= 99.50" in out


@pytest.mark.parametrize("flips, expected", [(7, 0), (8, 1)])  # 99.53% passes, 99.47% fails
def test_without_the_noise_floor_the_bound_is_99_5(monkeypatch, capsys, flips, expected):
    code, out = run(monkeypatch, capsys, compiled_flips=flips, floor_flips=None)
    assert code == expected and "(noise floor)" not in out


def test_triton_flags_choose_the_launch_the_check_runs(monkeypatch, capsys):
    """``--triton-*`` flags (those of bench_putm.py) reach the settings of the PUTM each run builds, so the GPU
    check can hold the sweep's fastest launch to the noise floor with the flags that timed it. Kills: flags parsed
    but not applied (the default launch would be checked under another launch's name)."""
    seen = []

    class Recorder:
        """Stands in for PUTM: records the settings it is built with, predicts at random."""

        def __init__(self, settings, **kwargs):
            seen.append(settings)

        def predict(self, batch):
            return torch.rand(batch.num_tasks, 75, 5, generator=torch.Generator().manual_seed(0)).softmax(-1)

    monkeypatch.setattr(crosscheck_putm, "PUTM", Recorder)
    argv = ["--device", "cpu", "--tasks", str(TASKS), "--dim", "8", "--no-bf16", "--no-noise-floor", "--solver",
            "triton", "--triton-warps", "4", "--triton-stages", "2"]
    crosscheck_putm.main(argv)
    assert [s.solver for s in seen] == ["fused", "fused", "triton", "triton"]  # each run's warm-up, then the run
    assert all((s.triton_warps, s.triton_stages) == (4, 2) for s in seen)
    assert "triton launch: warps=4, stages=2" in capsys.readouterr().out


def test_triton_flags_without_solver_triton_stop_with_one_line(capsys):
    """A kernel flag with another solver would be ignored and the table mistaken for that configuration's."""
    with pytest.raises(SystemExit):
        crosscheck_putm.parse_args(["--triton-stages", "2", "--triton-warps", "4"])
    assert ("--triton-warps, --triton-stages only apply to --solver triton (got --solver compiled)"
            in capsys.readouterr().err)
