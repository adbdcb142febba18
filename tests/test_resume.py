"""An interrupted evaluation resumes: finished settings are stored atomically and read back, never solved twice.

* the same command with the same ``output_dir`` reads every finished setting back (no method is built) and
  writes byte-identical per-task and summary files;
* a changed method parameter solves exactly that method's settings again and says which input changed;
* a stored file that is corrupt, or comes from a different feature table, is solved again, never trusted;
* ``evaluate.py`` SIGKILLed in the middle of a run and restarted with the same command finishes with the same
  per-task results as an uninterrupted run, without solving the settings it had finished.
"""

from __future__ import annotations

import csv
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.cli import REPO
from lightning_putm.evaluation import runner
from lightning_putm.evaluation.store import SETTINGS_FOLDER, SettingStore, fingerprint, tensor_digest
from lightning_putm.jobs.evaluate import run_evaluate

QUICK = ["logger=none", "plots=false", "progress=false", "tasks=6", "shots=[1]", "alphas=[2,balanced]",
         "methods=[simpleshot,putm]", "method.putm.em_steps=2", "method.putm.inner_steps=3"]


def _run(folder: Path, *extra: str) -> list[str]:
    lines: list[str] = []
    run_evaluate([*QUICK, f"output_dir={folder}", *extra], log=lines.append)
    return lines


def solved_settings(monkeypatch) -> list[str]:
    """The methods whose settings are solved from now on (a setting read back is built, for its inputs, but its
    ``predict`` never runs)."""
    solved: list[str] = []
    real_build = runner.build_method

    def build(name, *args, **kwargs):
        method = real_build(name, *args, **kwargs)
        predict = method.predict
        method.predict = lambda *a, **k: solved.append(name) or predict(*a, **k)
        return method

    monkeypatch.setattr(runner, "build_method", build)
    return solved


def _csv_without(path: Path, column: str) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    return [{k: v for k, v in row.items() if k != column} for row in rows]


def test_store_round_trip_and_fingerprint(tmp_path):
    store = SettingStore(tmp_path)
    inputs = {"method": "putm", "params": {"beta": 0.6, "hidden": (128, 64)}, "tasks": 3}
    accuracies = torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64)
    path = store.save("putm", 1, 2.0, inputs, accuracies, 1.5, "fp32", False)
    assert path == tmp_path / SETTINGS_FOLDER / "putm-1shot-alpha_2.pt" and path.is_file()
    assert not list(path.parent.glob(".*.tmp"))  # written through a temporary file that was renamed
    fresh = SettingStore(tmp_path)
    loaded = fresh.load("putm", 1, 2.0, {**inputs, "params": {"beta": 0.6, "hidden": [128, 64]}})  # JSON round trip
    assert loaded is not None and torch.equal(loaded.accuracies, accuracies) and loaded.seconds == 1.5
    assert fresh.reused == ["putm-1shot-alpha_2"]
    changed = SettingStore(tmp_path)
    assert changed.load("putm", 1, 2.0, {**inputs, "params": {"beta": 0.5, "hidden": [128, 64]}}) is None
    assert changed.changed == {"putm-1shot-alpha_2": ["params"]} and "different params" in changed.notice()
    assert SettingStore(tmp_path).load("putm", 1, None, inputs) is None  # another α: another file
    assert fingerprint({"a": 1, "b": 2}) == fingerprint({"b": 2, "a": 1})
    assert tensor_digest(torch.zeros(2)) != tensor_digest(torch.zeros(3))
    assert tensor_digest(torch.zeros(2)) != tensor_digest(torch.zeros(2, dtype=torch.float64))
    read_only = SettingStore(tmp_path / "other", writable=False)
    assert read_only.save("putm", 1, 2.0, inputs, accuracies, 1.0, "fp32", False) is None
    assert not (tmp_path / "other").exists()


def test_same_command_reads_finished_settings_back_and_writes_identical_files(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    first = _run(folder)
    stored = sorted(p.name for p in (folder / SETTINGS_FOLDER).glob("*.pt"))
    assert stored == ["putm-1shot-alpha_2.pt", "putm-1shot-alpha_balanced.pt", "simpleshot-1shot-alpha_2.pt",
                      "simpleshot-1shot-alpha_balanced.pt"]
    assert not any("resumed" in line for line in first)
    per_task, results = (folder / "per_task.csv").read_bytes(), (folder / "results.csv").read_bytes()

    solved = solved_settings(monkeypatch)
    second = _run(folder)
    assert solved == [], "a stored setting was solved again"
    assert any("resumed 4 finished setting(s)" in line for line in second)
    assert (folder / "per_task.csv").read_bytes() == per_task
    assert (folder / "results.csv").read_bytes() == results  # the stored solve time is reused too


def test_changed_parameter_solves_only_that_method_again(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    _run(folder)
    before = _csv_without(folder / "per_task.csv", "seconds")
    solved = solved_settings(monkeypatch)
    lines = _run(folder, "method.putm.em_steps=3")
    assert solved == ["putm", "putm"]  # simpleshot's two settings were read back
    assert any("putm-1shot-alpha_2 solved again" in line and "params" in line for line in lines)
    after = _csv_without(folder / "per_task.csv", "seconds")
    assert [r for r in after if r["method"] == "simpleshot"] == [r for r in before if r["method"] == "simpleshot"]


def test_corrupt_or_foreign_stored_settings_are_solved_again(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    _run(folder)
    reference = (folder / "per_task.csv").read_bytes()
    (folder / SETTINGS_FOLDER / "simpleshot-1shot-alpha_2.pt").write_bytes(b"not a torch file")
    solved = solved_settings(monkeypatch)
    lines = _run(folder)
    assert solved == ["simpleshot"] and any("unreadable file" in line for line in lines)
    assert (folder / "per_task.csv").read_bytes() == reference
    solved.clear()
    _run(folder, "seed=1")  # another episode bank: every setting solved again
    assert sorted(solved) == ["putm", "putm", "simpleshot", "simpleshot"]


def test_a_rewritten_learned_parameters_file_is_solved_again(tmp_path, monkeypatch):
    """Kills: a stored setting fingerprinted by UNEM's params_file path only, reused after the file was refitted
    (its accuracy then that of the old parameters)."""
    from lightning_putm.methods.unem import UNEMParams
    from lightning_putm.methods.unem_fit import save_params

    params = tmp_path / "unem.json"
    save_params(params, UNEMParams.initial())
    folder, unem = tmp_path / "run", ["methods=[unem]", f"method.unem.params_file={params}"]
    _run(folder, *unem)
    solved = solved_settings(monkeypatch)
    _run(folder, *unem)
    assert solved == []  # the same file: read back
    save_params(params, UNEMParams.from_values(3.0, [0.2] * 10, [3.0] * 10))
    lines = _run(folder, *unem)
    assert solved == ["unem", "unem"] and any("unem-1shot-alpha_2 solved again" in line for line in lines), lines
    fresh = tmp_path / "fresh"
    _run(fresh, *unem)
    assert _csv_without(folder / "per_task.csv", "seconds") == _csv_without(fresh / "per_task.csv", "seconds")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_evaluate_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": str(REPO)}
    args = ["logger=none", "plots=false", "progress=false", "tasks=8", "shots=[1]", "alphas=[1,2,4,balanced]",
            "methods=[putm]", "method.putm.em_steps=4", "method.putm.inner_steps=5"]
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    command = [sys.executable, str(REPO / "evaluate.py"), *args]
    process = subprocess.Popen([*command, f"output_dir={killed}"], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if len(list((killed / SETTINGS_FOLDER).glob("*.pt"))) >= 1:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be interrupted"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    finished = sorted(p.name for p in (killed / SETTINGS_FOLDER).glob("*.pt"))
    assert 1 <= len(finished) < 4 and not (killed / "per_task.csv").exists()
    resumed = subprocess.run([*command, f"output_dir={killed}"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed {len(finished)} finished setting(s)" in resumed.stdout + resumed.stderr
    subprocess.run([*command, f"output_dir={whole}"], cwd=tmp_path, env=env, capture_output=True, check=True,
                   timeout=300)
    assert (killed / "per_task.csv").read_bytes() == (whole / "per_task.csv").read_bytes()
    assert _csv_without(killed / "results.csv", "seconds") == _csv_without(whole / "results.csv", "seconds")
