"""W&B sweep files in conf/sweep/: every grid point is a valid evaluate.py configuration, and one of each runs."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from conftest import REPO_ROOT
from lightning_putm.evaluation import load_evaluate_config, settings_from_config
from lightning_putm.jobs.evaluate import run_evaluate

SWEEPS = sorted((REPO_ROOT / "conf" / "sweep").glob("*.yaml"))
FAST = ["method.putm.em_steps=2", "method.putm.inner_steps=3", "tasks=2", "logger=none", "progress=false",
        "method.tim.iterations=5", "method.alpha_tim.iterations=5"]

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


def test_the_three_studies_exist():
    assert {p.stem for p in SWEEPS} >= {"alpha_shots", "putm_sensitivity", "navigator_ablation"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_every_grid_point_is_a_valid_configuration(path: Path):
    spec = yaml.safe_load(path.read_text())
    assert spec["program"] == "evaluate.py" and (REPO_ROOT / spec["program"]).is_file()
    assert spec["method"] == "grid"
    assert "${args_no_hyphens}" in spec["command"] and "${program}" in spec["command"]
    points = grid(spec)
    assert len(points) > 1
    metric = spec["metric"]["name"]
    for point in points:
        settings = settings_from_config(load_evaluate_config(agent_arguments(point)))
        assert settings.logger == "wandb"
        # the optimised metric is one the run logs: fewshot/<method>/<shots>shot/alpha_<alpha>/acc
        method, shots, alpha = metric.split("/")[1:4]
        assert method in settings.methods
    # the swept values reach the settings
    first = settings_from_config(load_evaluate_config(agent_arguments(points[-1])))
    if "method.putm.rho" in spec["parameters"]:
        assert first.method_params["putm"]["rho"] == points[-1]["method.putm.rho"]
    if "alphas" in spec["parameters"] and "values" in spec["parameters"]["alphas"]:
        last_alpha = points[-1]["alphas"]
        assert first.alphas == [None if last_alpha == "balanced" else float(last_alpha)]


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_one_configuration_of_each_sweep_runs(path: Path, checkpoint: Path, tmp_path: Path):
    spec = yaml.safe_load(path.read_text())
    point = grid(spec)[0]
    args = [a for a in agent_arguments(point) if not a.startswith(("checkpoint=", "output_dir=", "tasks="))]
    results = run_evaluate([*args, f"checkpoint={checkpoint}", f"output_dir={tmp_path}",
                            f"feature_cache_dir={tmp_path / 'cache'}", *FAST], log=lambda _: None)
    settings = settings_from_config(load_evaluate_config(agent_arguments(point)))
    assert len(results) == len(settings.methods) * len(settings.shots) * len(settings.alphas)
    assert (tmp_path / "results.csv").is_file()
