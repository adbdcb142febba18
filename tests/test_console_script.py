"""The installed ``lightning-putm`` command ([project.scripts]) and the dispatch of ``python -m lightning_putm``.

The console-script tests run the command pip installed (beside this interpreter, or on ``PATH``) and skip, with
the command that installs it, where it is missing; the one per subcommand starts ten fresh Pythons, so it is
marked slow and the same help pages are checked in process too (``tests/test_startup.py`` runs them all in one). The
dispatch tests run in process with the jobs stood in for, so they check which code each command reaches without
running an evaluation.
"""

from __future__ import annotations

import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_putm.__main__ import ANALYSES, COMMANDS, main

#: command → (a text only its own --help shows, where it must appear)
HELP_MARKERS = {
    "evaluate": "Evaluate few-shot methods",
    "train": "Pretrain a backbone",
    "predict": "Predict the class of your own query images",
    "study": "--heartbeat",
    "tune": "--prefer",
    "compare-presets": "compare-presets [-h] --set NAME BASE_DIR CANDIDATE_DIR",
    "combine-tunes": "combine-tunes [-h] [--goal {maximize,minimize}]",
    "sensitivity-figure": "sensitivity-figure [-h] --set NAME FOLDER",
    "navigator-confidence": "navigator-confidence [-h] [--features FEATURES]",
    "fit-unem": "fit-unem [-h] --features FEATURES --shots",
    "table": "table [-h] [--format {markdown,latex,csv}]",
}
#: an option each analysis's parser has and no other's
ANALYSIS_OPTIONS = {"compare-presets": "--candidate-label", "combine-tunes": "--goal",
                    "sensitivity-figure": "--reference", "navigator-confidence": "--queries",
                    "fit-unem": "--iterations", "table": "--significance"}


def console_script() -> str:
    """The installed command's path; skips the test if ``pip install -e .`` has not installed it."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which("lightning-putm", path=search)
    if found is None:
        pytest.skip("the lightning-putm command is not installed; run `pip install -e .` in the checkout")
    return found


def test_every_command_has_a_help_marker() -> None:
    assert set(HELP_MARKERS) == set(COMMANDS) and set(ANALYSES) <= set(COMMANDS)
    assert {"evaluate", "train", "predict", "study", "tune"} <= set(COMMANDS)


@pytest.mark.parametrize("command", list(HELP_MARKERS))
def test_each_subcommands_help_in_process(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Kills: a subcommand dispatched to another one's code, a help page lost (exit 1 or nothing printed)."""
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the usage line to the terminal's width
    assert HELP_MARKERS[command] in out
    if command in ANALYSIS_OPTIONS:
        assert f"usage: python -m lightning_putm {command}" in out and ANALYSIS_OPTIONS[command] in out


@pytest.mark.slow
@pytest.mark.parametrize("command", list(HELP_MARKERS))
def test_the_installed_command_shows_each_subcommands_help(command: str) -> None:
    """Kills: a missing [project.scripts] entry, a subcommand dispatched to another one's code, a wrong prog."""
    done = subprocess.run([console_script(), command, "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WANDB_MODE": "offline", "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    assert HELP_MARKERS[command] in out
    if command in ANALYSIS_OPTIONS:
        assert f"usage: lightning-putm {command}" in out and ANALYSIS_OPTIONS[command] in out


def test_the_installed_command_lists_the_commands_and_refuses_an_unknown_one() -> None:
    script = console_script()
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and all(command in done.stdout for command in COMMANDS)
    done = subprocess.run([script, "compare-preset"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "did you mean compare-presets?" in done.stderr


@pytest.mark.parametrize(("argv", "target", "expected"), [
    (["evaluate", "tasks=3", "features=demo"], "lightning_putm.jobs.evaluate.run_evaluate",
     ["tasks=3", "features=demo"]),
    (["predict", "checkpoint=a.ckpt"], "lightning_putm.jobs.predict.run_predict", ["checkpoint=a.ckpt"]),
    (["evaluate", "predict", "checkpoint=a.ckpt"], "lightning_putm.jobs.predict.run_predict", ["checkpoint=a.ckpt"]),
    (["train", "data=digits"], "lightning_putm.jobs.train.run_train_backbone", ["data=digits"]),
])
def test_evaluate_train_and_predict_reach_the_scripts_jobs(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                           target: str, expected: list[str]) -> None:
    """Kills: ``predict`` run as an evaluation (or the reverse), ``train`` reaching another job, arguments lost."""
    calls: list[list[str]] = []
    module, _, name = target.rpartition(".")
    monkeypatch.setattr(f"{module}.{name}", lambda args: calls.append(list(args)))
    assert main(argv) == 0
    assert calls == [expected]


def test_an_analysis_error_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Kills: a SystemExit message leaking as a traceback or exit 1 (the CLI's user errors exit 2)."""
    assert main(["combine-tunes", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'summary.csv'}: not found; give the --dir of a finished tune run\n"
    assert main(["combine-tunes", str(tmp_path), "--goal", "sideways"]) == 2  # argparse's own usage error
    assert "invalid choice: 'sideways'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["fit-unem", "--features", "nope.pt", "--shots", "1"], r"feature file not found: nope.pt; check the `--features`"),
    (["navigator-confidence", "--features", "nope.pt"], r"feature file not found: nope.pt; check the `--features`"),
    (["navigator-confidence", "--alphas", "abc"], r"--alphas: 'abc' is neither a positive number nor `balanced`"),
    (["fit-unem", "--features", "nope.pt", "--shots", "1", "--alpha", "-1"], r"--alpha: Dirichlet alpha must be > 0"),
])
def test_an_analysis_user_error_is_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Kills: a LightningPutmError (a missing feature file) or a ValueError (float('abc')) from an analysis ending in
    a traceback; the message naming `features=`, a key the analyses do not have."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(f"error: {message}.*\n", err), err
