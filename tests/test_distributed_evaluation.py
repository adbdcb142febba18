"""Distributed evaluation: tasks sharded over 2 CPU processes (gloo) give the single-process tables exactly."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, make_clustered_features
from lightning_putm.evaluation import gather_shards, shard_range
from lightning_putm.features.files import save_features


def test_shards_cover_every_task_once():
    for tasks in (1, 2, 5, 7, 1000):
        for world in (1, 2, 3, 8):
            blocks = [shard_range(tasks, r, world) for r in range(world)]
            covered = [t for start, stop in blocks for t in range(start, stop)]
            assert covered == list(range(tasks))


def test_gather_shards_reassembles_task_order():
    tasks, world = 7, 3
    values = torch.arange(tasks, dtype=torch.float64)
    locals_ = [values[slice(*shard_range(tasks, r, world))] for r in range(world)]
    per_rank = -(-tasks // world)

    def fake_all_gather(padded):  # what every rank would receive
        rows = []
        for local in locals_:
            row = torch.full((per_rank,), float("nan"), dtype=torch.float64)
            row[: local.numel()] = local
            rows.append(row)
        return torch.stack(rows)

    assert torch.equal(gather_shards(locals_[0], tasks, world, fake_all_gather), values)


def run(args, env):
    return subprocess.run([sys.executable, str(REPO_ROOT / "evaluate.py"), *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=REPO_ROOT)


def test_two_process_gloo_evaluation_equals_one_process(tmp_path):
    """~40 s: Lightning relaunches evaluate.py as 2 ranks; each solves half of every bank."""
    features = save_features(make_clustered_features(classes=8, per_class=30, dim=16, spread=0.6), tmp_path / "f.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    common = [f"features={features}", "methods=[putm,simpleshot,ptmap]", "method.putm.em_steps=2",
              "method.putm.inner_steps=3", "tasks=7", "shots=[1]", "alphas=[2,balanced]", "queries=20",
              "logger=none", "plots=false", "progress=false", "trainer.accelerator=cpu"]
    single = run([*common, f"output_dir={tmp_path / 'one'}"], env)
    assert single.returncode == 0, single.stderr[-2000:]
    double = run([*common, f"output_dir={tmp_path / 'two'}", "trainer.devices=2", "trainer.strategy=ddp"], env)
    assert double.returncode == 0, double.stderr[-2000:]
    output = double.stdout + double.stderr
    assert "rank 0 of 2: solving tasks 0-3 of each bank" in output
    assert "rank 1 of 2: solving tasks 4-6 of each bank" in output
    assert (tmp_path / "two" / "per_task.csv").read_bytes() == (tmp_path / "one" / "per_task.csv").read_bytes()
    def results(folder: str) -> list[dict[str, str]]:  # timing and thread count may differ between the runs
        with open(tmp_path / folder / "results.csv") as handle:
            return [{k: v for k, v in row.items() if k not in ("seconds", "threads")} for row in csv.DictReader(handle)]

    assert results("two") == results("one")
