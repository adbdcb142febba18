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


def test_tune_refuses_to_select_among_evaluation_conditions(tmp_path, tiny_checkpoint):
    """Kills: a tune whose points differ in α or shots; its best is the easiest condition, not a setting."""
    parameters = {**SWEEP["parameters"], "alphas": {"values": [2, "balanced"]}, "shots": {"values": [1, 5]}}
    path = sweep_file(tmp_path, {**SWEEP, "parameters": parameters})
    with pytest.raises(ConfigError, match=r"tune selects methods' settings \(method.<name>.<option>\), but tune-mini "
                                          r"also sweeps shots, alphas: .* Fix them on the command line \(shots=... "
                                          r"alphas=..., e.g. alphas=\[2,balanced\]"):
        run_tune([str(path), "--dir", str(tmp_path / "t"), f"checkpoint={tiny_checkpoint}"], log=lambda _: None)
    assert not (tmp_path / "t").exists()


class Row:
    def __init__(self, weight: float, metric: float) -> None:
        self.point, self.metric = {"method.putm.support_weight": weight}, metric


def test_ties_are_listed_and_prefer_chooses_among_them():
    from lightning_putm.studies.tune import select_best

    rows = [Row(1, -1.5), Row(2, 0.1467), Row(5, 0.1467), Row(10, 0.1433), Row(20, 0.1333)]
    best, tied = select_best(rows, "maximize")
    assert best is rows[1] and tied == rows[1:4]  # 0.1433 is within 0.005 of the best, 0.1333 is not
    assert select_best(rows, "maximize", ("method.putm.support_weight", "max"))[0] is rows[3]
    assert select_best(rows, "maximize", ("method.putm.support_weight", "min"))[0] is rows[1]
    best, tied = select_best([Row(1, 3.0), Row(2, 1.0), Row(3, 1.004)], "minimize", ("method.putm.support_weight", "max"))
    assert best.point["method.putm.support_weight"] == 3 and len(tied) == 2


def test_prefer_is_checked_before_anything_runs(tmp_path, tiny_checkpoint):
    base = [str(sweep_file(tmp_path)), f"checkpoint={tiny_checkpoint}", "--dir", str(tmp_path / "t")]
    with pytest.raises(ConfigError, match="--prefer takes KEY=max or KEY=min"):
        run_tune([*base, "--prefer", "method.putm.beta=up"], log=lambda _: None)
    with pytest.raises(ConfigError, match="not a swept parameter.*method.putm.beta"):
        run_tune([*base, "--prefer=method.putm.rho=max"], log=lambda _: None)
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("direction,expected", [("max", 3), ("min", 1)])
def test_prefer_decides_among_tied_points(tmp_path, tiny_checkpoint, single_thread, direction, expected):
    # the chunk size never changes PUTM's results, so the two points tie exactly
    parameters = {k: v for k, v in SWEEP["parameters"].items() if k != "method.putm.beta"}
    spec = {**SWEEP, "parameters": {**parameters, "method.putm.max_chunk_tasks": {"values": [1, 3]}}}
    logs: list[str] = []
    folder = run_tune([str(sweep_file(tmp_path, spec)), f"checkpoint={tiny_checkpoint}", "--dir", str(tmp_path / "t"),
                       f"--prefer=method.putm.max_chunk_tasks={direction}", f"feature_cache_dir={tmp_path / 'cache'}"],
                      log=logs.append)
    selected = yaml.safe_load((folder / "selected.yaml").read_text())
    assert selected["method"]["putm"]["max_chunk_tasks"] == expected
    assert any("2 points tie on validation" in line for line in logs)
    assert f"--prefer method.putm.max_chunk_tasks={direction}" in (folder / "selected.yaml").read_text()
