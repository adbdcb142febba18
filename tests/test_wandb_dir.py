"""Where W&B runs go: ``wandb.dir``, else W&B's own ``$WANDB_DIR`` (set on clusters and in CI), else ``./wandb``.

Real offline runs: the run files must be on disk in the chosen folder, and nowhere else.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.loggers import WANDB_LINE, build_logger, finish_logger, wandb_root
from wandb_records import history, offline_run, records

EVAL = ["methods=[simpleshot]", "shots=[1]", "alphas=[2]", "tasks=2", "plots=false", "progress=false"]


def run_file(save_dir: Path, timeout: float = 30.0) -> Path:
    """The one offline run under ``save_dir/wandb``, once W&B's service process has written its ``exit`` record
    (it writes asynchronously: the file can appear a moment after ``finish()`` returns)."""
    run = offline_run(save_dir)
    deadline = time.monotonic() + timeout
    while not list(run.glob("run-*.wandb")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(r.WhichOneof("record_type") == "exit" for r in records(run)), f"no finished run file in {run}"
    return run


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory of its own (a run that ignored the setting would land in ``./wandb`` here)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    return cwd


def test_the_folder_is_wandb_dir_else_the_environment_else_the_working_directory(monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    assert wandb_root(None) == Path(".")
    monkeypatch.setenv("WANDB_DIR", "/scratch/me")
    assert wandb_root(None) == Path("/scratch/me")
    assert wandb_root("runs/here") == Path("runs/here")


def test_evaluate_logs_an_offline_run_under_wandb_dir_from_the_environment(workdir, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("WANDB_DIR", str(scratch))
    lines: list[str] = []
    run_evaluate([*EVAL, "logger=wandb", f"output_dir={tmp_path / 'out'}"], log=lines.append)
    run = run_file(scratch)  # exactly one offline run, in $WANDB_DIR/wandb
    logged = {k for row in history(run) for k in row}
    assert "fewshot/simpleshot/acc" in logged
    assert not (workdir / "wandb").exists()
    [line] = [line for line in lines if line.startswith(WANDB_LINE)]
    assert str(run) in line and f"wandb sync {run}" in line


def test_wandb_dir_wins_over_the_environment_and_without_either_runs_go_to_the_working_directory(workdir, tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "from_env"))
    explicit = tmp_path / "explicit"
    logger = build_logger("wandb", tmp_path / "logs", {"dir": str(explicit)}, "explicit", log=lambda _: None)
    finish_logger(logger)
    run_file(explicit)
    assert not (tmp_path / "from_env").exists()

    monkeypatch.delenv("WANDB_DIR")
    logger = build_logger("wandb", tmp_path / "logs", {}, "default", log=lambda _: None)
    finish_logger(logger)
    run_file(workdir)
