"""Selection on validation classes (python -m lightning_putm tune): the search runs on the validation split only,
the best point's config is written for evaluate.py, and the test report compares it with the defaults."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from lightning_putm.errors import ConfigError
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.tune import run_tune

SWEEP = {
    "program": "evaluate.py", "name": "tune-mini", "method": "grid",
    "metric": {"name": "fewshot/putm/acc", "goal": "maximize"},
    "parameters": {
        "method.putm.beta": {"values": [0.3, 1.0]}, "methods": {"value": "[putm]"}, "shots": {"value": 1},
        "alphas": {"value": 2}, "tasks": {"value": 4}, "method.putm.em_steps": {"value": 2},
        "method.putm.inner_steps": {"value": 3}, "logger": {"value": "none"}, "plots": {"value": False},
        "progress": {"value": False},
    },
}


def sweep_file(folder: Path, spec: dict = SWEEP) -> Path:
    path = folder / "tune.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_tune_searches_on_validation_and_writes_a_config_evaluate_accepts(tmp_path, tiny_checkpoint, single_thread):
    splits: list[str] = []

    def run(args: list[str]):
        splits.append(next(a.split("=", 1)[1] for a in args if a.startswith("split=")))
        return run_evaluate([*args, f"feature_cache_dir={tmp_path / 'cache'}"], log=lambda _: None)

    folder = run_tune([str(sweep_file(tmp_path)), f"checkpoint={tiny_checkpoint}", "--dir", str(tmp_path / "t"),
                       "--test"], log=lambda _: None, run=run)
    assert splits == ["val", "val", "test", "test"]  # the search never sees the test split
    rows = list(csv.DictReader(open(folder / "summary.csv")))
    best = max(rows, key=lambda r: float(r["fewshot/putm/acc"]))
    selected = yaml.safe_load((folder / "selected.yaml").read_text())
    assert selected["split"] == "test" and selected["output_dir"] == "auto"
    assert selected["method"]["putm"]["beta"] == float(best["method.putm.beta"])
    # evaluate.py config=selected.yaml gives the selected setting's test result of the report
    again = run_evaluate([f"config={folder / 'selected.yaml'}", f"output_dir={tmp_path / 'again'}",
                          f"feature_cache_dir={tmp_path / 'cache'}"], log=lambda _: None)
    report = (folder / "selection.md").read_text()
    assert f"| {again[0].summary().accuracy:.2f} |" in report.splitlines()[6]
    assert "| defaults |" in report


@pytest.mark.parametrize(("extra", "message"), [(["split=test"], "split must be val"), ([], "needs checkpoint")])
def test_tune_refuses_the_test_split_and_needs_a_checkpoint(tmp_path, tiny_checkpoint, extra, message):
    args = [str(sweep_file(tmp_path)), "--dir", str(tmp_path / "t"), *extra]
    if extra:
        args.append(f"checkpoint={tiny_checkpoint}")
    with pytest.raises(ConfigError, match=message):
        run_tune(args, log=lambda _: None)
    assert not (tmp_path / "t").exists()
