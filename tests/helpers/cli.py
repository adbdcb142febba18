"""Run ``evaluate.py`` / ``train_backbone.py`` through their real ``main`` and ``run_cli`` (in process or not)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from lightning_putm.cli import run_cli

REPO = Path(__file__).resolve().parents[2]

#: Settings that keep one evaluation to a fraction of a second (simpleshot, 2 tasks, no logger or plots).
FAST_EVAL = ["tasks=2", "shots=[1]", "alphas=[2]", "progress=false", "logger=none", "plots=false",
             "methods=[simpleshot]", "method.putm.em_steps=1", "method.putm.inner_steps=1", "method.ptmap.iterations=2"]
#: Settings that keep one pretraining run to a few seconds (Conv-4 of width 8 on digits, one epoch).
FAST_TRAIN = ["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
              "trainer.accelerator=cpu", "backbone=conv4", "backbone.width=8", "val_episodes.tasks=5",
              "test_episodes.tasks=5", "trainer.max_epochs=1", "trainer.limit_train_batches=1", "run_test=false"]


@lru_cache(maxsize=None)
def script_main(script: str):
    """``main`` of ``evaluate.py`` or ``train_backbone.py``, loaded from its file (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(f"_reliability_{script}", REPO / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    def user_error_problem(self, pattern: str | None = None) -> str | None:
        """Why this is NOT one clear user error (exit code 2, one `error:` line last, no traceback), or None."""
        if self.returncode == 0:
            return "accepted (exit code 0)"
        if self.returncode != 2:
            return f"exit code {self.returncode}"
        if "Traceback" in self.stderr:
            return "traceback printed"
        if len(self.error_lines) != 1:
            return f"{len(self.error_lines)} error lines"
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        if lines[-1] != self.error_lines[0]:
            return f"error line is not the last line of stderr: {lines[-1]!r}"
        if pattern is not None and not re.search(pattern, self.error_lines[0]):
            return f"message {self.error_lines[0]!r} does not match {pattern!r}"
        return None


def run_in_process(script: str, argv: Sequence[str]) -> Outcome:
    """``run_cli(main, argv)`` with stdout/stderr captured; an unhandled exception propagates."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_cli(script_main(script), list(argv), job=script)
    return Outcome(code, out.getvalue(), err.getvalue())


def run_script(script: str, argv: Sequence[str], cwd: Path, timeout: float = 300, **env: str) -> Outcome:
    """The real script in a fresh interpreter (one thread, W&B offline)."""
    # the checkout first; a PYTHONPATH of the caller's after it (tools/cpu_without_bf16 reaches the child too)
    search = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    environment = {**os.environ, "PYTHONPATH": search, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
                   "LIGHTNING_PUTM_CONF": str(REPO / "conf"), **env}
    done = subprocess.run([sys.executable, str(REPO / f"{script}.py"), *argv], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout)
    return Outcome(done.returncode, done.stdout, done.stderr)
