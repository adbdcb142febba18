"""Determinism: the same seed gives byte-identical per-task results across runs, processes and CPU batch sizes.

Only the entry points and their CSV outputs are used (``run_evaluate`` / ``evaluate.py``), so these tests hold
whatever runs underneath. Runs compared:

* the same command twice: once in this process, once in a fresh interpreter with another ``PYTHONHASHSEED``;
* ``memory_budget_mb=2048`` vs ``0.05`` (every method call split into one-task chunks);
* from a checkpoint, features extracted with ``data.eval_batch_size=512`` vs ``7``;
* a different seed, which must change the file (so the comparison can fail).

``per_task.csv`` must hold no timing column; in ``results.csv`` only ``seconds`` may differ. All runs use one
CPU thread (a different thread count may change float rounding: see the README).

Figures: ``runs compared: N, identical: N``.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch

from helpers.cli import run_in_process, run_script
from helpers.ledger import Ledger, isolated_working_folder, module_figures

LEDGER = Ledger("run comparisons", verb="identical")
pytestmark = pytest.mark.usefixtures("single_thread")

BASE = ["features=demo", "methods=[putm,simpleshot]", "method.putm.em_steps=2", "method.putm.inner_steps=3",
        "tasks=20", "shots=[1,5]", "alphas=[2,balanced]", "seed=0", "device=cpu", "progress=false", "logger=none",
        "plots=false"]


_isolated = isolated_working_folder()
_figures = module_figures(LEDGER, "test_determinism")


def evaluate(out: Path, *extra: str) -> Path:
    outcome = run_in_process("evaluate", [*BASE, *extra, f"output_dir={out}"])
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    return out


def rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def compare(label: str, a: Path, b: Path) -> None:
    """``per_task.csv`` byte-identical; ``results.csv`` identical apart from ``seconds``."""
    same = (a / "per_task.csv").read_bytes() == (b / "per_task.csv").read_bytes()
    strip = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
    same_summary = [strip(r) for r in rows(a / "results.csv")] == [strip(r) for r in rows(b / "results.csv")]
    LEDGER.record(label, same and same_summary, f"per_task identical: {same}, results identical: {same_summary}")
    assert same, f"{label}: per_task.csv differs"
    assert same_summary, f"{label}: results.csv differs beyond the seconds column"


def test_per_task_csv_has_no_timing_column_and_covers_every_task(tmp_path: Path) -> None:
    out = evaluate(tmp_path / "a")
    table = rows(out / "per_task.csv")
    assert len(table) == 2 * 2 * 2 * 20  # methods x shots x alphas x tasks
    assert not [c for c in table[0] if any(w in c.lower() for w in ("second", "time", "date", "host"))], table[0]
    assert {r["task"] for r in table} == {str(t) for t in range(20)}


def test_same_seed_same_bytes_across_processes_and_memory_budgets(tmp_path: Path) -> None:
    a = evaluate(tmp_path / "in_process")
    b = tmp_path / "fresh_process"
    done = run_script("evaluate", [*BASE, f"output_dir={b}"], tmp_path, PYTHONHASHSEED="12345")
    assert done.returncode == 0, done.stderr[-3000:]
    compare("same seed: this process vs a fresh interpreter (other PYTHONHASHSEED)", a, b)
    c = evaluate(tmp_path / "tiny_budget", "memory_budget_mb=0.05")
    compare("memory_budget_mb=2048 vs 0.05 (one task per chunk)", a, c)
    d = evaluate(tmp_path / "other_seed", "seed=1")
    assert (a / "per_task.csv").read_bytes() != (d / "per_task.csv").read_bytes(), "seed must matter"


def test_checkpoint_features_do_not_depend_on_the_extraction_batch_size(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Features extracted by the backbone with batches of 512 and of 7 images, then the same episodes."""
    outs = {}
    for size in (512, 7):
        outs[size] = evaluate(tmp_path / f"batch_{size}", f"checkpoint={tiny_checkpoint}", "features=auto",
                              f"data.eval_batch_size={size}", f"feature_cache_dir={tmp_path / f'cache_{size}'}")
    compare("checkpoint evaluation: data.eval_batch_size=512 vs 7", outs[512], outs[7])
    from lightning_putm.features.files import load_features

    (first,), (second,) = (list((tmp_path / f"cache_{s}").glob("digits-test-*.pt")) for s in (512, 7))
    assert torch.equal(load_features(first).features, load_features(second).features)


@pytest.mark.slow
def test_same_seed_same_bytes_for_every_method(tmp_path: Path) -> None:
    """Slow: all eight methods, both CPU chunkings, two processes."""
    every = ["methods=[putm,simpleshot,protonet,ptmap,tim,alpha_tim,bdcspn,laplacianshot]",
             "method.tim.iterations=50", "method.alpha_tim.iterations=50"]
    a = evaluate(tmp_path / "a", *every)
    b = tmp_path / "b"
    done = run_script("evaluate", [*BASE, *every, f"output_dir={b}"], tmp_path, PYTHONHASHSEED="999")
    assert done.returncode == 0, done.stderr[-3000:]
    compare("all methods: this process vs a fresh interpreter", a, b)
    compare("all methods: memory_budget_mb=2048 vs 0.05", a, evaluate(tmp_path / "c", *every, "memory_budget_mb=0.05"))

