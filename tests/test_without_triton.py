"""The package on a torch without triton (macOS, CPU-only aarch64 builds): everything but ``solver=triton`` works,
and that one key says what is missing.

Triton ships with torch's CUDA wheels for Linux only, and the package imports it lazily, for the kernel alone.
The child blocks the import (``sys.modules["triton"] = None`` makes ``import triton`` raise ImportError, as a
missing package does) before anything else is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
sys.modules["triton"] = None
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.errors import ConfigError

run_evaluate(["methods=[putm,simpleshot]", "shots=[1]", "alphas=[2]", "tasks=2", "logger=none", "plots=false",
              "progress=false", "method.putm.em_steps=2", "method.putm.inner_steps=2", "output_dir=out"], log=print)
try:
    run_evaluate(["methods=[putm]", "shots=[1]", "alphas=[2]", "tasks=2", "logger=none", "plots=false",
                  "progress=false", "method.putm.solver=triton", "output_dir=out_triton"], log=print)
except ConfigError as error:
    print("ConfigError:", error)
import os
print("triton run folder:", os.path.exists("out_triton"))
print("triton imported:", sys.modules["triton"] is not None)
"""


def test_without_triton_evaluation_runs_and_solver_triton_says_what_is_missing(tmp_path: Path) -> None:
    """Kills: an eager ``import triton`` anywhere on the evaluation's path (the job dies on such a torch), and
    ``solver=triton`` failing with a traceback or after creating its run folder."""
    environment = dict(os.environ, WANDB_MODE="offline",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    environment.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "results.csv").is_file()
    assert "ConfigError: method.putm.solver=triton needs the triton package" in done.stdout, done.stdout[-2000:]
    assert "triton run folder: False" in done.stdout and "triton imported: False" in done.stdout
