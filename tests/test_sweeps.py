"""W&B sweep files in conf/sweep/: every grid point is a valid evaluate.py configuration that logs the sweep's
metric, the checkpoint is a required parameter with a clear error, and one grid point of each runs end to end."""

from __future__ import annotations

import csv
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation import load_evaluate_config, settings_from_config
from lightning_putm.evaluation.records import Summary
from lightning_putm.evaluation.report import run_summary_metrics
from lightning_putm.jobs.evaluate import run_evaluate
from wandb_records import history, offline_run

SWEEPS = sorted((REPO_ROOT / "conf" / "sweep").glob("*.yaml"))
FAST = ["method.putm.em_steps=2", "method.putm.inner_steps=3", "tasks=2", "progress=false",
        "method.tim.iterations=5", "method.alpha_tim.iterations=5"]
ENV = "PUTM_CHECKPOINT"

pytestmark = pytest.mark.usefixtures("single_thread")


def grid(spec: dict) -> list[dict]:
    """Every parameter combination of a grid sweep, as ``{name: value}``."""
    names, choices = [], []
    for name, options in spec["parameters"].items():
        names.append(name)
        choices.append(options["values"] if "values" in options else [options["value"]])
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def agent_arguments(point: dict) -> list[str]:
    """The ``${args_no_hyphens}`` the W&B agent passes for one grid point (its own formatter)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    return create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})["args_no_hyphens"]


def logged_metric_names(settings) -> set[str]:
    """The per-run summary metrics a run with these settings logs (the report's own key builder)."""
    summaries = [Summary(method, shots, alpha, 50.0, 1.0) for method in settings.methods
                 for shots in settings.shots for alpha in settings.alphas]
    return set(run_summary_metrics(summaries, "fewshot"))


@pytest.fixture
def checkpoint(tiny_checkpoint: Path, monkeypatch) -> Path:
    monkeypatch.setenv(ENV, str(tiny_checkpoint))
    return tiny_checkpoint


def test_the_three_studies_exist():
    assert {p.stem for p in SWEEPS} >= {"alpha_shots", "putm_sensitivity", "navigator_ablation"}


def test_run_summary_metric_is_the_mean_over_the_runs_own_settings():
    summaries = [Summary("putm", 1, 2.0, 60.0, 1.0), Summary("putm", 5, None, 90.0, 1.0),
                 Summary("ptmap", 1, 2.0, 40.0, 1.0)]
    assert run_summary_metrics(summaries, "fewshot") == {"fewshot/putm/acc": 75.0, "fewshot/ptmap/acc": 40.0}
    assert run_summary_metrics(summaries[:1], "fewshot") == {"fewshot/putm/acc": 60.0}


def test_worst_gain_over_simpleshot_is_the_smallest_margin_over_shared_settings():
    summaries = [Summary("putm", 1, 2.0, 60.0, 1.0), Summary("putm", 5, None, 90.0, 1.0),
                 Summary("putm", 5, 2.0, 80.0, 1.0),  # no simpleshot result for (5, 2): not compared
                 Summary("simpleshot", 1, 2.0, 57.5, 1.0), Summary("simpleshot", 5, None, 91.0, 1.0),
                 Summary("ptmap", 1, 2.0, 50.0, 1.0)]
    metrics = run_summary_metrics(summaries, "fewshot")
    assert metrics["fewshot/putm/worst_gain_over_simpleshot"] == -1.0  # min(60 - 57.5, 90 - 91)
    assert metrics["fewshot/ptmap/worst_gain_over_simpleshot"] == -7.5
    assert "fewshot/simpleshot/worst_gain_over_simpleshot" not in metrics
    assert not any("worst_gain" in key for key in run_summary_metrics(summaries[:3], "fewshot"))


def test_a_study_can_select_on_the_worst_gain(tmp_path: Path):
    from lightning_putm.studies.sweep import metric_value, read_sweep

    summaries = [Summary("putm", 1, 2.0, 60.0, 1.0), Summary("simpleshot", 1, 2.0, 62.0, 1.0),
                 Summary("putm", 1, None, 70.0, 1.0), Summary("simpleshot", 1, None, 65.0, 1.0)]
    assert metric_value("fewshot/putm/worst_gain_over_simpleshot", summaries) == -2.0
    with pytest.raises(ConfigError, match="worst_gain_over_tim"):
        metric_value("fewshot/putm/worst_gain_over_tim", summaries)
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump({
        "program": "evaluate.py", "method": "grid",
        "metric": {"name": "fewshot/putm/worst_gain_over_simpleshot", "goal": "maximize"},
        "parameters": {"method.putm.support_weight": {"values": [1, 3]}, "methods": {"value": "[putm,ptmap]"}}}))
    with pytest.raises(ConfigError, match="needs method simpleshot in `methods`"):
        read_sweep(sweep)
    assert read_sweep(sweep, ["methods=[putm,simpleshot]"]).metric == "fewshot/putm/worst_gain_over_simpleshot"


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_grid_point_is_valid_and_logs_the_metric(path: Path, checkpoint: Path):
    spec = yaml.safe_load(path.read_text())
    assert spec["program"] == "evaluate.py" and (REPO_ROOT / spec["program"]).is_file()
    assert spec["method"] == "grid"
    assert "${args_no_hyphens}" in spec["command"] and "${program}" in spec["command"]
    assert spec["parameters"]["checkpoint"] == {"value": "${oc.env:%s}" % ENV}  # required, no default backbone
    assert "data" not in spec["parameters"]  # the checkpoint records its data
    points = grid(spec)
    assert len(points) > 1
    metric = spec["metric"]["name"]
    for point in points:
        settings = settings_from_config(load_evaluate_config(agent_arguments(point)))
        assert settings.logger == "wandb" and settings.checkpoint == checkpoint
        assert metric in logged_metric_names(settings), f"{path.name}: {point} would not log {metric}"
    # the swept values reach the settings
    last = settings_from_config(load_evaluate_config(agent_arguments(points[-1])))
    if "method.putm.rho" in spec["parameters"]:
        assert last.method_params["putm"]["rho"] == points[-1]["method.putm.rho"]
    if "alphas" in spec["parameters"] and "values" in spec["parameters"]["alphas"]:
        last_alpha = points[-1]["alphas"]
        assert last.alphas == [None if last_alpha == "balanced" else float(last_alpha)]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_a_missing_checkpoint_is_a_one_line_error_naming_the_variable(path: Path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    point = grid(yaml.safe_load(path.read_text()))[0]
    with pytest.raises(ConfigError, match=rf"`checkpoint` reads the environment variable {ENV}, which is not set; "
                                          rf"set it \(e\.g\. `export {ENV}=\.\.\.`"):
        load_evaluate_config(agent_arguments(point))


def test_a_missing_checkpoint_stops_the_script_before_any_output(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "evaluate.py"), "checkpoint=${oc.env:%s}" % ENV,
                           f"output_dir={out}", "logger=none"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ENV in lines[0] and "export" in lines[0], done.stderr
    assert not out.exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_one_configuration_of_each_sweep_runs_and_logs_the_metric_to_wandb(path: Path, checkpoint: Path,
                                                                            tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    spec = yaml.safe_load(path.read_text())
    point = grid(spec)[0]
    args = [a for a in agent_arguments(point) if not a.startswith(("output_dir=", "tasks="))]
    results = run_evaluate([*args, f"output_dir={tmp_path / 'out'}", f"feature_cache_dir={tmp_path / 'cache'}",
                            f"wandb.dir={tmp_path}", "plots=false", *FAST], log=lambda _: None)
    settings = settings_from_config(load_evaluate_config(agent_arguments(point)))
    assert len(results) == len(settings.methods) * len(settings.shots) * len(settings.alphas)
    with open(tmp_path / "out" / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    putm = [float(row["accuracy"]) for row in rows if row["method"] == "putm"]
    logged: dict[str, float] = {}
    for row in history(offline_run(tmp_path)):
        logged.update({k: v for k, v in row.items() if isinstance(v, (int, float))})
    metric = spec["metric"]["name"]
    if metric.endswith("worst_gain_over_simpleshot"):  # PUTM's smallest margin over SimpleShot, setting by setting
        by_setting = {(r["method"], r["shots"], r["alpha"]): float(r["accuracy"]) for r in rows}
        expected = min(acc - by_setting[("simpleshot", shots, alpha)]
                       for (method, shots, alpha), acc in by_setting.items() if method == "putm")
    else:
        expected = sum(putm) / len(putm)
    assert logged[metric] == pytest.approx(expected, abs=1e-3)
