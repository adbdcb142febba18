"""Start-up: every ``--help`` and the config errors found from the YAML alone import no heavy library.

``python evaluate.py taks=10`` and ``lightning-putm predict --help`` took 20-52 s on a busy 2-core machine (issue 43)
because every entry point imported torch, Lightning, W&B and timm before it read its arguments. Now the scripts, the
config checks, the help pages and the method option dataclasses import none of them (the jobs import them once
the config is valid). These tests run each command in a fresh Python and read ``sys.modules`` afterwards; they
never time anything (``benchmarks/bench_startup.py`` prints the start-up times).

All commands run one after the other in ONE fresh interpreter, and the heavy modules are read after each: a heavy
import on any command's path shows up at the first command that reaches it (a module imported by an earlier
command would have shown its heavy imports then), so one process finds what one process per command would, in
seconds instead of a minute.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_putm.__main__ import COMMANDS
from lightning_putm.methods import METHOD_CLASSES
from lightning_putm.methods.catalog import BUILTIN_SETTINGS, METHOD_SETTINGS

REPO_ROOT = Path(__file__).resolve().parents[1]

#: What a help page or a config error must not import (each costs 0.3-5 s on the 2-core CPU).
HEAVY = ("torch", "torchvision", "pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics", "wandb", "timm",
         "sklearn", "scipy", "matplotlib", "optuna")

#: Runs the steps given as JSON in argv[1] in this one interpreter and prints, per step, its exit code, its
#: stdout and stderr and the heavy modules loaded so far, as JSON. A step is ["script", path, args] (python
#: path args), ["module", name, args] (python -m name args), ["console", args] (the installed lightning-putm
#: command: lightning_putm.__main__:main with that program name) or ["exec", code].
PROBE = r"""
import contextlib, io, json, runpy, sys
steps, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
results = []
for step in steps:
    kind, *rest = step
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if kind == "script":
                sys.argv = [rest[0], *rest[1]]
                runpy.run_path(rest[0], run_name="__main__")
            elif kind == "module":
                sys.argv = [rest[0], *rest[1]]
                runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
            elif kind == "console":
                sys.argv = ["lightning-putm", *rest[0]]
                from lightning_putm.__main__ import main
                code = main()
            else:
                exec(rest[0], {})
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) or exc.code is None else str(exc.code)
    results.append({"code": code or 0, "out": out.getvalue(), "err": err.getvalue(),
                    "heavy": sorted(name for name in heavy if name in sys.modules)})
print(json.dumps(results))
"""


def script(name: str, *args: str) -> list[Any]:
    return ["script", str(REPO_ROOT / name), list(args)]


def module(*args: str) -> list[Any]:
    return ["module", "lightning_putm", list(args)]


#: (step, exit code, text its stdout (code 0) or its stderr must contain); stderr of an error is its whole message.
LIGHT: list[tuple[list[Any], int, str]] = [
    (script("evaluate.py", "--help"), 0, "method.putm.rho"),
    (script("evaluate.py", "predict", "--help"), 0, "Keys of conf/predict.yaml"),
    (script("train_backbone.py", "--help"), 0, "Keys of conf/train_backbone.yaml"),
    (script("evaluate.py", "taks=10"), 2,
     "error: unknown config key 'taks' (no 'taks' at top level); did you mean tasks? valid keys there: "),
    (script("evaluate.py", "tasks=-1"), 2, "error: `tasks` must be an integer >= 1 or auto, got -1\n"),
    (script("evaluate.py", "shots=[1"), 2, "error: cannot parse the value of shots: '[1' is not valid YAML"),
    (script("evaluate.py", "methods=[putmm]"), 2, "error: unknown method 'putmm'; did you mean putm? available "),
    (script("evaluate.py", "method.putm.rho=high"), 2, "error: method.putm.rho must lie in [0, 1], got 'high'\n"),
    (script("evaluate.py", "methods=[tim]", "method.tim.lr=-1"), 2, "error: method.tim.lr must be positive, got -1\n"),
    (script("evaluate.py", "logger=wandbb"), 2,
     "error: `logger` must be one of auto, wandb, csv, none, got 'wandbb'; did you mean wandb?\n"),
    (script("evaluate.py", "predict", "method=putmm"), 2, "error: unknown method 'putmm'; did you mean putm?"),
    (script("train_backbone.py", "taks=1"), 2,
     "error: unknown config key 'taks' (no 'taks' at top level); did you mean stages? valid keys there: "),
    (script("train_backbone.py", "stages=[rotaton]"), 2,
     "error: `stages` must be auto or a non-empty list of names among classifier, rotation, s2m2r, got ['rotaton']; "
     "did you mean rotation?"),
    (module("train", "loader.num_workers=-1"), 2, "error: `loader.num_workers` must be auto or an integer >= 0, got -1"),
    (module("--help"), 0, "usage: python -m lightning_putm <command> [arguments]"),
    *[(module(command, "--help"), 0, "") for command in COMMANDS],
    (module("evaluate", "taks=10"), 2, "error: unknown config key 'taks' (no 'taks' at top level); did you mean tasks?"),
    (["console", ["--help"]], 0, "commands:"),
    (["console", ["fit-unem", "--help"]], 0, "usage: lightning-putm fit-unem"),
]
#: The control, last: the method classes do import torch, so the probe sees a heavy import when there is one.
CONTROL = ["exec", "import lightning_putm.methods.registry as r; r.load_methods()"]


@pytest.fixture(scope="module")
def probed() -> list[dict[str, Any]]:
    """Every step of :data:`LIGHT`, then :data:`CONTROL`, in one fresh interpreter."""
    steps = [step for step, _, _ in LIGHT] + [CONTROL]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(steps), json.dumps(HEAVY)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "offline", "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def step_id(step: list[Any]) -> str:
    return " ".join([Path(step[1]).name if step[0] == "script" else step[0], *map(str, step[-1])])


@pytest.mark.parametrize("index", range(len(LIGHT)), ids=[step_id(step) for step, _, _ in LIGHT])
def test_help_and_config_errors_import_no_heavy_library(probed: list[dict[str, Any]], index: int) -> None:
    """Kills: an eager ``import torch`` (or Lightning, W&B, timm, scikit-learn, matplotlib, Optuna) in a script, a
    job module, a settings module, the help, a method's option dataclass or an analysis module, on the path of a
    ``--help`` or of a config error; a config check moved after the import of the methods."""
    assert probed[index]["heavy"] == [], f"{step_id(LIGHT[index][0])} imported {probed[index]['heavy']}"


@pytest.mark.parametrize("index", range(len(LIGHT)), ids=[step_id(step) for step, _, _ in LIGHT])
def test_help_and_config_errors_say_what_they_said(probed: list[dict[str, Any]], index: int) -> None:
    """Kills: a help page or an error lost or changed by the lazy imports (a wrong exit code, a traceback, the
    error of another check, a missing 'did you mean')."""
    step, code, text = LIGHT[index]
    result = probed[index]
    assert result["code"] == code, result["err"]
    if code == 0:
        assert result["err"] == "" and result["out"].strip() and text in result["out"]
    else:
        assert result["err"].startswith(text) and result["err"].count("\n") == 1 and result["out"] == ""


def test_the_probe_sees_a_heavy_import(probed: list[dict[str, Any]]) -> None:
    """The check itself: importing the method classes loads torch, and the probe reports it. Kills: a probe that
    reads ``sys.modules`` of another process, or never."""
    assert "torch" in probed[-1]["heavy"]


def test_the_catalog_knows_every_built_in_method_and_its_settings() -> None:
    """Checks (``methods=``, ``method.<name>.*``) and ``--help`` read the catalog, not the classes. Kills: a method
    registered but missing from the catalog (``methods=[it]`` refused as unknown before the registry loads), or a
    catalog entry whose settings differ from the class's (options checked against the wrong schema)."""
    assert {settings.method for settings in BUILTIN_SETTINGS} == set(METHOD_CLASSES)
    assert all(METHOD_SETTINGS[name] is cls.Settings for name, cls in METHOD_CLASSES.items())
