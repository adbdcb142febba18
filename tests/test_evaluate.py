"""evaluate.py and its config: strict keys, clear errors, one bank for all methods, CSV outputs."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, make_clustered_features
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation import load_evaluate_config, settings_from_config
from lightning_putm.features.files import save_features
from lightning_putm.jobs.evaluate import run_evaluate

FAST_PUTM = ["methods=[putm,simpleshot]", "method.putm.em_steps=2", "method.putm.inner_steps=3", "logger=none", "plots=false"]


def settings(*overrides):
    return settings_from_config(load_evaluate_config(list(overrides)))


def test_defaults_and_auto_values():
    s = settings()
    assert s.features == "demo" and s.tasks == 100 and s.queries == 75 and s.ways == 5
    assert None in s.alphas and 2.0 in s.alphas
    assert settings("features=x.pt").tasks == 1000
    assert settings("ways=3").queries == 45
    assert settings("shots=3").shots == [3]  # a scalar is accepted as a one-element list
    assert settings("alphas=[1,2.5,balanced]").alphas == [1.0, 2.5, None]
    assert settings("method.putm.rho=0.7").method_params["putm"]["rho"] == 0.7


@pytest.mark.parametrize(
    "override,message",
    [
        ("metods=[putm]", r"unknown config key 'metods'.*valid keys there: .*methods"),
        ("method.putm.rh=1", r"unknown config key 'method.putm.rh'.*rho"),
        ("methods=[putm,nope]", r"unknown method 'nope'; available methods: .*putm"),
        ("alphas=[0]", r"alpha must be > 0"),
        ("alphas=[-2,balanced]", r"alpha must be > 0"),
        ("alphas=[two]", r"neither a positive number nor `balanced`"),
        ("shots=one", r"`shots` must be a non-empty list of positive integers"),
        ("ways=1", r"`ways` must be an integer >= 2"),
        ("tasks=0", r"`tasks` must be an integer >= 1"),
        ("device=cuda:0" if not torch.cuda.is_available() else "device=tpu", r"device"),
        ("shots", r"key=value"),
    ],
)
def test_bad_config_values_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        settings(override)


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_end_to_end_on_a_feature_file(tmp_path):
    features = make_clustered_features(classes=8, per_class=30, dim=16)
    path = save_features(features, tmp_path / "novel.pt")
    out = tmp_path / "out"
    lines: list[str] = []
    results = run_evaluate(
        [f"features={path}", f"output_dir={out}", "tasks=4", "shots=[1,2]", "alphas=[2,balanced]", "queries=20",
         "progress=false", *FAST_PUTM],
        log=lines.append,
    )
    assert len(results) == 2 * 2 * 2  # methods x shots x alphas
    # every method saw the same tasks for a given (shot, alpha)
    by_setting = {}
    for r in results:
        by_setting.setdefault((r.shots, r.alpha), []).append(r.bank)
    for banks in by_setting.values():
        assert all(torch.equal(b.query_indices, banks[0].query_indices) for b in banks)
    summary = read_csv(out / "results.csv")
    per_task = read_csv(out / "per_task.csv")
    assert len(summary) == 8 and len(per_task) == 8 * 4
    for row in summary:
        rows = [p for p in per_task if (p["method"], p["shots"], p["alpha"]) == (row["method"], row["shots"], row["alpha"])]
        mean = 100 * sum(float(p["accuracy"]) for p in rows) / len(rows)
        assert abs(mean - float(row["accuracy"])) < 1e-3
    assert all(sum(int(c) for c in p["query_counts"].split(";")) == 20 for p in per_task)
    assert "tasks: 4" in (out / "config.yaml").read_text()
    assert any("accuracy (%)" in line for line in lines)  # the table was printed
    # clustered data: both methods are accurate
    assert all(float(row["accuracy"]) > 90 for row in summary)


def test_same_seed_gives_identical_per_task_csv(tmp_path):
    args = ["tasks=3", "shots=[1]", "alphas=[2]", "progress=false", *FAST_PUTM]
    run_evaluate([*args, f"output_dir={tmp_path / 'a'}"], log=lambda _: None)
    run_evaluate([*args, f"output_dir={tmp_path / 'b'}"], log=lambda _: None)
    run_evaluate([*args, "seed=1", f"output_dir={tmp_path / 'c'}"], log=lambda _: None)
    a, b, c = ((tmp_path / d / "per_task.csv").read_bytes() for d in "abc")
    assert a == b and a != c


def run_script(*args):
    return subprocess.run([sys.executable, str(REPO_ROOT / "evaluate.py"), *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)


def test_script_reports_user_errors_without_traceback():
    result = run_script("metods=[putm]")
    assert result.returncode == 2
    assert "error: unknown config key 'metods'" in result.stderr and "Traceback" not in result.stderr
    result = run_script("features=/no/such/file.pt")
    assert result.returncode == 2 and "feature file not found" in result.stderr
    debug = run_script("metods=[putm]", "debug=true")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_script_runs_the_demo(tmp_path):
    result = run_script("tasks=2", "shots=[1]", "progress=false", f"output_dir={tmp_path}", *FAST_PUTM)
    assert result.returncode == 0, result.stderr
    # quiet by default: one line of what runs and the keys that differ from the defaults, not the whole config
    assert "effective config" not in result.stdout and "evaluate: putm, simpleshot" in result.stdout
    assert "settings changed from the defaults: " in result.stdout and "tasks=2" in result.stdout
    assert "method.ptmap" not in result.stdout and "method.putm.em_steps=" in result.stdout
    assert len(read_csv(tmp_path / "per_task.csv")) == 2 * 2 * 2  # 2 methods x 2 alphas x 2 tasks
    assert "method:" in (tmp_path / "config.yaml").read_text()  # the whole effective config goes to the run folder
    verbose = run_script("tasks=2", "shots=[1]", "progress=false", f"output_dir={tmp_path}", *FAST_PUTM, "verbose=true")
    assert verbose.returncode == 0 and "effective config" in verbose.stdout


def test_sigterm_stops_a_long_evaluation_promptly(tmp_path):
    """Clusters send SIGTERM before killing a job: evaluation stops at the next chunk, exit code 143, no results."""
    import signal
    import time

    command = [sys.executable, str(REPO_ROOT / "evaluate.py"), "methods=[putm]", "tasks=2000", "shots=[1]", "alphas=[2]",
               "memory_budget_mb=8", "logger=none", "plots=false", "progress=false", f"output_dir={tmp_path}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    for line in process.stdout:  # the callback announces the features right before solving
        if line.startswith("features:"):
            break
    time.sleep(2.0)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 143, stderr[-2000:]
    assert "termination signal" in stderr
    assert not (tmp_path / "results.csv").exists()


class WandbLogger:
    """Stands in for Lightning's W&B logger (``finish_logger`` goes by the class name): its run's finish receives a
    SIGTERM halfway, as a scheduler's time limit in the run's last second would send it."""

    def __init__(self) -> None:
        self.finished = False
        self.experiment = self

    def finish(self) -> None:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
        self.finished = True


def test_a_sigterm_while_the_logger_closes_waits_for_it_then_stops_with_one_line(tmp_path):
    """After the test loop Lightning has put back the default SIGTERM handler: a SIGTERM then killed the process on
    the spot (exit 143, no line, the W&B run unfinished) although every result was on disk. Now the logger closes
    first, then the command stops with a line naming the folder, and the handler is the one in place before.
    Kills: no handler around the close (the signal reaches the handler in place: recorded here as leaked), the
    signal swallowed (no error, exit 0), the previous handler not restored."""
    import signal

    from lightning_putm.jobs.evaluate import close_logger

    leaked = []

    def in_place(signum, frame):
        leaked.append(signum)

    previous = signal.signal(signal.SIGTERM, in_place)
    try:
        logger = WandbLogger()
        with pytest.raises(InterruptedError, match=f"results are complete in {tmp_path}"):
            close_logger(logger, True, tmp_path)
        assert logger.finished and leaked == []
        assert signal.getsignal(signal.SIGTERM) is in_place
        close_logger(None, True, tmp_path)  # no logger, no signal: nothing to say
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_console_says_when_putm_ran_in_reduced_precision(tmp_path, precision):
    """Kills: a bf16 run printed without saying so (a user comparing with a published fp32 or other-CPU table cannot
    tell why its accuracies differ by a tenth of a point), or the note printed for an fp32 run."""
    lines: list[str] = []
    run_evaluate(["tasks=2", "shots=[1]", "alphas=[2]", "progress=false", *FAST_PUTM,
                  f"method.putm.precision={precision}", f"output_dir={tmp_path}"], log=lines.append)
    notes = [line for line in lines if line.startswith("precision:")]
    if precision == "bf16":
        assert len(notes) == 1 and "putm in bf16" in notes[0] and "method.putm.precision=fp32" in notes[0]
        assert "simpleshot" not in notes[0]
    else:
        assert notes == []


def test_the_run_header_writes_values_as_they_are_typed():
    """Kills: Python reprs in the header (``methods=['putm']``, ``force_data=True``, ``alphas [2.0, 'balanced']``),
    which cannot be pasted back onto the command line."""
    from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
    from lightning_putm.jobs.evaluate import describe

    cfg = load_evaluate_config(["methods=[putm,simpleshot]", "alphas=[0.5,2,balanced]", "plots=false"])
    first, changed = describe(cfg, settings_from_config(cfg)).splitlines()
    assert "alphas [0.5, 2, balanced]" in first and "shots [1, 5]" in first
    assert changed == ("settings changed from the defaults: methods=[putm, simpleshot], alphas=[0.5, 2, balanced], "
                       "plots=false")
