"""``benchmarks/bench_methods.py``: the tasks it times have the shot count asked for, and a run prints its table.

The sweep files' cost estimates (docs/sweeps.md) rest on its 1- and 5-shot rates.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.benchmarks import benchmark_module


@pytest.mark.parametrize("shots", [1, 5])
def test_the_timed_tasks_have_the_shots_asked_for(shots: int) -> None:
    """Kills ``--shots`` ignored (every table a 1-shot table under another name)."""
    bench = benchmark_module("bench_methods")
    tasks, labels = bench.build_tasks("digits", 3, torch.device("cpu"), shots)
    assert tuple(tasks.support.shape[:2]) == (3, 5 * shots)
    assert torch.equal(tasks.support_labels[0].bincount(minlength=5), torch.full((5,), shots))
    assert tuple(labels.shape) == (3, 75)


def test_a_run_times_each_method_in_a_child_and_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    """End to end, one fast method: the child solves 5-shot tasks (its accuracy is that of 5-shot tasks) and the
    header names the shots the child solved (not the ones the parent was asked for)."""
    bench = benchmark_module("bench_methods")
    bench.main(["--features", "digits", "--shots", "5", "--methods", "simpleshot", "--tasks", "4", "--threads", "1"])
    out = capsys.readouterr().out
    assert out.startswith("5-way 5-shot, 75 queries, digits features (d=64)")
    row = next(line.split() for line in out.splitlines() if line.startswith("simpleshot"))
    assert row[1] == "fp32" and row[2] == "4" and float(row[4]) > 0 and 0 <= float(row[7]) <= 100
