"""Sweep files run as resumable studies (python -m lightning_putm study): every point once, a kill loses at most the
run in flight, a restart skips what is finished, bad sweeps are refused before anything is written."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from helpers.cli import REPO
from lightning_putm.errors import ConfigError
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.study import run_study
from lightning_putm.studies.sweep import point_key, read_sweep

GRID = {
    "program": "evaluate.py", "name": "mini", "method": "grid",
    "metric": {"name": "fewshot/putm/acc", "goal": "maximize"},
    "parameters": {
        "method.putm.rho": {"values": [0.0, 1.0]},
        "alphas": {"values": [2, "balanced"]},
        "methods": {"value": "[putm,simpleshot]"}, "shots": {"value": 1}, "tasks": {"value": 4},
        "method.putm.em_steps": {"value": 3}, "method.putm.inner_steps": {"value": 4},
        "logger": {"value": "none"}, "plots": {"value": False}, "progress": {"value": False},
    },
}


def sweep_file(folder: Path, spec: dict = GRID, name: str = "mini.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def counting_run(calls: list[list[str]]):
    def run(args: list[str]):
        calls.append(args)
        return run_evaluate(args, log=lambda _: None)
    return run


def test_grid_study_runs_every_point_once_and_a_rerun_runs_nothing(tmp_path, single_thread):
    calls: list[list[str]] = []
    folder = run_study([str(sweep_file(tmp_path)), "--dir", str(tmp_path / "study")], log=lambda _: None,
                       run=counting_run(calls))
    assert len(calls) == 4
    points = {(a, r) for a in ("2", "balanced") for r in ("0.0", "1.0")}
    rows = read_csv(folder / "summary.csv")
    assert {(r["alphas"], r["method.putm.rho"]) for r in rows} == points
    for row in rows:  # the metric is the run's own PUTM accuracy, read back from its results.csv
        results = read_csv(Path(row["output_dir"]) / "results.csv")
        putm = [float(r["accuracy"]) for r in results if r["method"] == "putm"]
        assert abs(float(row["fewshot/putm/acc"]) - sum(putm) / len(putm)) < 1e-3
        assert any(k.startswith("simpleshot/1shot/alpha_") for k in row)
    assert (folder / "summary.pdf").read_bytes()[:4] == b"%PDF" and (folder / "summary.png").stat().st_size > 1000
    table = (folder / "summary.md").read_text()
    assert table.count("\n| ") == 5  # header + 4 runs
    again: list[list[str]] = []
    run_study([str(sweep_file(tmp_path)), "--dir", str(folder)], log=lambda _: None, run=counting_run(again))
    assert again == []
    # a command-line value fixes a swept key: only the new points run, the finished ones are kept
    run_study([str(sweep_file(tmp_path)), "--dir", str(folder), "method.putm.rho=0.5"], log=lambda _: None,
              run=counting_run(again))
    assert len(again) == 2 and all("method.putm.rho=0.5" in a for a in again)


def test_max_runs_stops_a_grid_study_after_that_many_runs_and_a_rerun_goes_on(tmp_path, single_thread):
    """``--max-runs N`` on a grid: this process runs N points and stops; the next run takes the rest. Kills the
    option ignored on grids (every point ran, against what ``--help`` says)."""
    calls: list[list[str]] = []
    folder = run_study([str(sweep_file(tmp_path)), "--dir", str(tmp_path / "study"), "--max-runs", "3"],
                       log=lambda _: None, run=counting_run(calls))
    assert len(calls) == 3 and len(read_csv(folder / "summary.csv")) == 3
    run_study([str(sweep_file(tmp_path)), "--dir", str(folder), "--max-runs", "3"], log=lambda _: None,
              run=counting_run(calls))
    assert len(calls) == 4 and len(read_csv(folder / "summary.csv")) == 4


def test_random_sweep_samples_within_bounds_up_to_its_cap(tmp_path, single_thread):
    spec = {**GRID, "method": "random", "run_cap": 3,
            "parameters": {**GRID["parameters"], "method.putm.rho": {"distribution": "uniform", "min": 0.1, "max": 0.9},
                           "alphas": {"value": 2}}}
    calls: list[list[str]] = []
    folder = run_study([str(sweep_file(tmp_path, spec)), "--dir", str(tmp_path / "s")], log=lambda _: None,
                       run=counting_run(calls))
    rhos = [float(r["method.putm.rho"]) for r in read_csv(folder / "summary.csv")]
    assert len(calls) == 3 and len(rhos) == 3 and all(0.1 <= r <= 0.9 for r in rhos) and len(set(rhos)) == 3


@pytest.mark.parametrize(("change", "message"), [
    ({"parameters": {**GRID["parameters"], "method.putm.rho": {"values": [0.5, "high"]}}}, r"point .*rho.*high"),
    ({"parameters": {**GRID["parameters"], "method.putm.bogus": {"values": [1, 2]}}}, r"bogus"),
    ({"metric": {"name": "val/loss"}}, r"metric.name"),
    ({"method": "random"}, r"run_cap"),
    ({"method": "hyperband"}, r"method must be one of grid, random, bayes"),
    ({"metric": {"name": "fewshot/tim/acc"}}, r"needs method tim"),
    # kills: files checked only when the first run starts, after the study folder and storage exist
    ({"parameters": {**GRID["parameters"], "checkpoint": {"value": "missing.ckpt"}}},
     r"point .*: checkpoint not found: missing.ckpt"),
    ({"parameters": {**GRID["parameters"], "features": {"value": "missing.pt"}}},
     r"point .*: feature file not found: missing.pt"),
])
def test_bad_sweeps_are_refused_before_anything_is_written(tmp_path, change, message):
    spec = {**GRID, **change}
    if change.get("method") == "random":
        spec["parameters"] = {**GRID["parameters"], "method.putm.rho": {"min": 0.1, "max": 0.9}}
    with pytest.raises(ConfigError, match=message):
        run_study([str(sweep_file(tmp_path, spec)), "--dir", str(tmp_path / "study")], log=lambda _: None)
    assert not (tmp_path / "study").exists()


def test_output_dir_is_the_studys_and_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="use --dir"):
        read_sweep(sweep_file(tmp_path), ["output_dir=x"])
    with pytest.raises(ConfigError, match="sweep file not found: nope.yaml"):
        run_study(["nope.yaml"], log=lambda _: None)


def test_killed_study_resumes_and_ends_with_the_uninterrupted_results(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO)}
    path = sweep_file(tmp_path)
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "lightning_putm", "study", str(path), "--dir", str(killed), "--heartbeat", "1",
               "--grace", "2"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if len(list(killed.glob("runs/*"))) >= 2:  # runs go one by one: the first one is finished
            break
        time.sleep(0.05)
    assert process.poll() is None, "the study ended before it could be interrupted"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    study = optuna.load_study(study_name="mini", storage=f"sqlite:///{killed / 'study.db'}")
    finished = {t.user_attrs["point_key"] for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))}
    assert 1 <= len(finished) < 4
    mtimes = {name: (killed / "runs" / name / "per_task.csv").stat().st_mtime_ns for name in finished}
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr
    assert {name: (killed / "runs" / name / "per_task.csv").stat().st_mtime_ns for name in finished} == mtimes
    whole = tmp_path / "whole"
    subprocess.run([*command[:6], str(whole)], cwd=tmp_path, env=env, capture_output=True, check=True, timeout=400)
    points = [dict(zip(("method.putm.rho", "alphas"), (r, a))) for r in (0.0, 1.0) for a in (2, "balanced")]
    for point in points:
        key = point_key(point)
        assert (killed / "runs" / key / "per_task.csv").read_bytes() == (whole / "runs" / key / "per_task.csv").read_bytes()
    assert len(read_csv(killed / "summary.csv")) == 4


def test_command_line_arguments_reach_every_run_as_typed(tmp_path):
    # kills: formatting a command-line null through the agent formatter (the text "None" as a checkpoint path)
    spec = {**GRID, "parameters": {**GRID["parameters"], "checkpoint": {"value": "${oc.env:PUTM_CHECKPOINT}"}}}
    sweep = read_sweep(sweep_file(tmp_path, spec), ["checkpoint=null", "alphas=[1,2]"])
    assert sweep.extra == ("checkpoint=null", "alphas=[1,2]")
    assert "checkpoint" not in sweep.fixed and "alphas" not in sweep.swept
    from lightning_putm.studies.study import Study

    args = Study(sweep, tmp_path / "s").arguments({"method.putm.rho": 0.0}, tmp_path / "s" / "runs" / "x")
    assert "checkpoint=null" in args and "alphas=[1,2]" in args and not any(a.startswith("checkpoint=$") for a in args)


def test_study_option_and_sweep_method_typos_suggest_the_fix(tmp_path):
    """Kills: a misspelt --option or sweep `method` answered with the full list only (the fix is not read first)."""
    from lightning_putm.errors import ConfigError
    from lightning_putm.studies.study import parse_options
    from lightning_putm.studies.sweep import read_sweep

    with pytest.raises(ConfigError, match=r"unknown option --storag; did you mean --storage\? options: --storage"):
        parse_options(["--storag", "sqlite:///x.db"])
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("program: evaluate.py\nmethod: gird\nmetric: {name: fewshot/putm/acc}\n"
                     "parameters: {tasks: {values: [1, 2]}}\n")
    with pytest.raises(ConfigError, match=r"method must be one of grid, random, bayes, got 'gird'; did you mean grid\?$"):
        read_sweep(sweep)


SMALL = {
    "program": "evaluate.py", "name": "small", "method": "grid",
    "metric": {"name": "fewshot/simpleshot/acc", "goal": "maximize"},
    "parameters": {
        "seed": {"values": [0]}, "alphas": {"values": [2]},
        "methods": {"value": "[simpleshot]"}, "shots": {"value": 1}, "tasks": {"value": 2},
        "logger": {"value": "none"}, "plots": {"value": False}, "progress": {"value": False},
    },
}


def test_a_study_refuses_other_fixed_settings_instead_of_reusing_its_runs(tmp_path, single_thread):
    """Kills: finished points found by their swept values alone, so that a re-run with tasks=3 (or a sweep file
    edited to tasks: 3) ran nothing and summarised the runs of tasks=2; and pinned swept keys left out of the key."""
    folder = tmp_path / "study"
    calls: list[list[str]] = []
    run_study([str(sweep_file(tmp_path, SMALL)), "--dir", str(folder)], log=lambda _: None, run=counting_run(calls))
    assert len(calls) == 1
    with pytest.raises(ConfigError, match=r"study small in sqlite:///.* ran with other fixed settings "
                                          r"\(tasks: 2 -> 3\); its finished runs would count for these: .*--dir"):
        run_study([str(sweep_file(tmp_path, SMALL)), "--dir", str(folder), "tasks=3"], log=lambda _: None,
                  run=counting_run(calls))
    edited = {**SMALL, "parameters": {**SMALL["parameters"], "tasks": {"value": 3}, "ways": {"value": 3}}}
    with pytest.raises(ConfigError, match=r"\(tasks: 2 -> 3; ways: \(not set\) -> 3\)"):
        run_study([str(sweep_file(tmp_path, edited)), "--dir", str(folder)], log=lambda _: None,
                  run=counting_run(calls))
    assert len(calls) == 1
    run_study([str(sweep_file(tmp_path, SMALL)), "--dir", str(folder)], log=lambda _: None, run=counting_run(calls))
    assert len(calls) == 1  # the same settings: everything is finished
    # a swept key fixed on the command line is part of each point: seed=1 and seed=2 are runs of their own
    for seed in (1, 2):
        run_study([str(sweep_file(tmp_path, SMALL)), "--dir", str(folder), f"seed={seed}"], log=lambda _: None,
                  run=counting_run(calls))
        assert len(calls) == seed + 1 and f"seed={seed}" in calls[-1]


def test_the_storage_password_is_never_printed():
    """Kills: a password holding ``/`` (valid for SQLAlchemy) shown by the old mask, a ``password=`` query
    parameter shown, and the Ctrl-C hint echoing ``--storage`` as typed."""
    from lightning_putm.jobs.study import resume_hint
    from lightning_putm.studies.study import without_password

    assert without_password("postgresql://alice:s3cr/et@db-host/studies") == "postgresql://alice:***@db-host/studies"
    assert without_password("postgresql://db-host/studies?user=a&password=pw&sslmode=require") == \
        "postgresql://db-host/studies?user=a&password=***&sslmode=require"
    for url in ("postgresql://alice@db-host:5432/studies", "sqlite:////tmp/study.db", "postgresql://db-host/s"):
        assert without_password(url) == url
    hint = resume_hint(["conf/sweep/x.yaml", "--storage", "postgresql://alice:s3cr/et@db-host/studies", "tasks=3"])
    assert "s3cr" not in hint and "alice:***@db-host" in hint and "password where it shows ***" in hint
    assert resume_hint(["x.yaml", "tasks=3"]) == \
        "re-run the same command to resume: python -m lightning_putm study x.yaml tasks=3"
