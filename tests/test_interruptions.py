"""Interruptions: SIGKILL at random moments loses nothing.

* Writes: a helper process writes version after version of a 24 MB payload to one path (Lightning's checkpoint
  IO, ``save_features``, the evaluation feature cache) and is SIGKILLed after a random delay drawn from a seeded
  RNG, most often in the middle of a write. After every kill the target must load and hold the last version whose
  write completed, or the one in flight if its rename happened: never a torn file and never an older version
  (``bytes lost`` counts the bytes of completed writes that could not be read back: it must be 0). The feature
  cache, read the way the next evaluation reads it, must return the complete file. A control writer using bare
  ``torch.save`` shows that the same kills do tear files, so the check can fail.
* Pretraining: ``train_backbone.py`` (deterministic CPU mode) is SIGKILLed at random points during training and
  restarted with ``resume=true`` until it finishes; the last checkpoint must be intact after every kill, and
  the final weights, optimizer state and step count must equal an uninterrupted run's exactly (``torch.equal``).
* Ctrl-C: ``evaluate.py`` and a study get SIGINT right after their first finished setting (a deterministic point,
  tests/helpers/ctrl_c.py); they must exit 130 with one ``interrupted:`` line that says how to resume, and the
  resumed run must read that setting back instead of solving it again.

Figures: ``interruptions tried: N, recovered: N; bytes lost: 0``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers.cli import REPO
from helpers.crash_writer import CACHE_KEY, payload, write_once
from helpers.ledger import Ledger, isolated_working_folder, module_figures
from lightning_putm.atomic import STALE_TEMP_SECONDS
from lightning_putm.errors import LightningPutmError
from lightning_putm.features.cache import FeatureCache
from lightning_putm.features.files import load_features
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.study import run_study
from lightning_putm.jobs.train import run_train_backbone
from lightning_putm.pretraining.checkpoints import read_checkpoint

LEDGER = Ledger("interruptions", verb="recovered")
HELPERS = Path(__file__).resolve().parent / "helpers"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS.parent)]), "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline", "LIGHTNING_PUTM_CONF": str(REPO / "conf")}
PAYLOAD_MB = 24


_isolated = isolated_working_folder()
_figures = module_figures(LEDGER, "test_interruptions", must_stay_zero=("bytes lost",))


# ------------------------------------------------------------------------------------------- writes
class CrashWriter:
    """Client of tests/helpers/crash_writer.py: fork a writer, SIGKILL it after a delay, collect what it printed."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, str(HELPERS / "crash_writer.py")], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
        assert self.process.stdout.readline().strip() == "ready"

    def kill_after(self, mode: str, target: Path, first_version: int, delay: float, size_mb: float = PAYLOAD_MB):
        """(versions begun, versions done, whether the child died of SIGKILL)."""
        self.process.stdin.write(f"{mode} {target} {size_mb} {first_version} {delay:.4f}\n")
        self.process.stdin.flush()
        begun, done = [], []
        while True:
            line = self.process.stdout.readline()
            assert line, "crash_writer died"
            word, value = line.split()
            if word == "begin":
                begun.append(int(value))
            elif word == "done":
                done.append(int(value))
            elif word == "end":
                return begun, done, value == "killed"

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def crash_writer():
    writer = CrashWriter()
    yield writer
    writer.close()


def read_version(mode: str, target: Path) -> int | None:
    """The version stored at ``target`` as the next run would read it (None: nothing there yet); raises if torn."""
    if mode == "cache":
        cached = FeatureCache(target, CACHE_KEY).load()
        if cached is None:
            if any(target.glob("*.pt")):
                raise ValueError("the cache file exists but the cache refused it")
            return None
        version = cached.metadata["version"]
        assert torch.all(cached.features == version)
        return version
    if not target.exists():
        return None
    if mode == "features":
        loaded = load_features(target)
        version = loaded.metadata["version"]
        assert torch.all(loaded.features == version)
        return version
    if mode == "checkpoint":
        checkpoint = read_checkpoint(target)
    else:  # plain
        checkpoint = torch.load(target, map_location="cpu", weights_only=True)
    version = checkpoint["version"]
    assert torch.all(checkpoint["state_dict"]["w"] == version)
    return version


def kill_writes(writer: CrashWriter, mode: str, folder: Path, kills: int, seed: int) -> dict[str, int]:
    """``kills`` random SIGKILLs of a writer of ``mode``; checks and records every one."""
    rng = random.Random(seed)
    target = folder if mode == "cache" else folder / ("last.ckpt" if mode == "checkpoint" else "features.pt")
    folder.mkdir(parents=True, exist_ok=True)
    on_disk, next_version, mid_write = None, 0, 0
    for kill in range(kills):
        delay = rng.uniform(0.02, 0.4)
        begun, done, killed = writer.kill_after(mode, target, next_version, delay)
        in_flight = begun[-1] if begun and (not done or done[-1] != begun[-1]) else None
        mid_write += in_flight is not None
        committed = done[-1] if done else on_disk
        label = f"SIGKILL #{kill} of a {mode} writer after {delay:.3f} s ({len(done)} writes done" + (
            f", version {in_flight} in flight)" if in_flight is not None else ")")
        try:
            version = read_version(mode, target)
            allowed = {committed} | ({in_flight} if in_flight is not None else set())
            ok = killed and version in allowed
            note = f"read version {version}, allowed {sorted(v for v in allowed if v is not None)}"
        except (LightningPutmError, ValueError, KeyError, AssertionError, RuntimeError) as exc:
            version, ok, note = None, False, f"unreadable after the kill: {exc}"
        if committed is not None and (version is None or version < committed):
            LEDGER.add("bytes lost", PAYLOAD_MB * 2**20)
        LEDGER.record(label, ok, note)
        assert ok, f"{label}: {note}"
        on_disk = version
        next_version = (begun[-1] + 1) if begun else next_version
    temps = [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    LEDGER.add("killed mid-write", mid_write)
    LEDGER.add("temp files left by kills (never read)", len(temps))
    # The next successful write removes leftovers once they are old, and never a write still in progress.
    old = time.time() - 2 * STALE_TEMP_SECONDS
    for leftover in temps:
        os.utime(leftover, (old, old))
    written = FeatureCache(folder, CACHE_KEY).path if mode == "cache" else target
    in_progress = written.parent / f".{written.name}.concurrent.tmp"
    in_progress.write_bytes(b"another writer's half-written file")
    write_once(mode, target, payload(1), next_version)
    assert read_version(mode, target) == next_version
    left = sorted(p.name for p in written.parent.iterdir() if p.name.endswith(".tmp"))
    assert left == [in_progress.name], left
    return {"mid_write": mid_write, "temps": len(temps)}


@pytest.mark.parametrize("mode", ["checkpoint", "features", "cache"])
def test_sigkill_during_writes_never_leaves_a_torn_or_older_file(crash_writer, tmp_path: Path, mode: str) -> None:
    outcome = kill_writes(crash_writer, mode, tmp_path / mode, kills=8, seed={"checkpoint": 1, "features": 2,
                                                                               "cache": 3}[mode])
    assert outcome["mid_write"] >= 4, "the kills should mostly land inside a write; the test would prove little"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["checkpoint", "features", "cache"])
def test_sigkill_during_writes_many_times(crash_writer, tmp_path: Path, mode: str) -> None:
    kill_writes(crash_writer, mode, tmp_path / mode, kills=60, seed=100 + len(mode))


def test_control_bare_torch_save_is_torn_by_the_same_kills(crash_writer, tmp_path: Path) -> None:
    """The same kills against a non-atomic writer leave an unreadable file: the checks above can fail."""
    rng = random.Random(7)
    target = tmp_path / "plain.ckpt"
    torn = 0
    for attempt in range(6):
        begun, done, killed = crash_writer.kill_after("plain", target, 10 * attempt, rng.uniform(0.05, 0.3), size_mb=64)
        try:
            read_version("plain", target)
        except Exception:  # noqa: BLE001 - any failure to read back is a torn file
            torn += 1
            break
    assert torn, "bare torch.save survived every kill: the kill timing does not hit writes"


# ------------------------------------------------------------------------------------------- pretraining
TRAIN = ["logger=none", "trainer.enable_model_summary=false", "trainer.accelerator=cpu", "backbone=conv4",
         "backbone.width=8", "val_episodes.tasks=10", "trainer.deterministic=true", "run_test=false",
         "data.augment.crop_padding=1"]


class TrainingRun:
    """``train_backbone.py`` in a child process; watches its output for the start of the training loop."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.started_at = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, str(REPO / "train_backbone.py"), *args], cwd=cwd, env=ENV,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.output = bytearray()
        self.training = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            chunk = os.read(self.process.stdout.fileno(), 4096)
            if not chunk:
                return
            self.output += chunk
            if b"Epoch " in self.output[-8192:]:
                self.training.set()

    def text(self) -> str:
        return self.output.decode(errors="replace")


def last_epoch(path: Path) -> int:
    return int(read_checkpoint(path)["epoch"]) if path.exists() else -1


def kill_and_resume(tmp_path: Path, args: list[str], stages: list[str], kills: int, seed: int,
                    train_seconds: float, from_process_start: bool = False) -> Path:
    """Run ``train_backbone.py`` until it finishes, SIGKILLing the first ``kills`` attempts at random points."""
    rng = random.Random(seed)
    folder = tmp_path / "interrupted"
    stage_dirs = [folder / "digits" / "conv4" / "latest" / stage for stage in stages]
    common = [*args, f"checkpoint_dir={folder}", "trainer.enable_progress_bar=true"]
    resumed = 0
    for attempt in range(kills + 1):  # the last attempt runs to the end
        resume = (stage_dirs[0] / "last.ckpt").exists()
        resumed += resume
        run = TrainingRun([*common, *(["resume=true"] if resume else [])], tmp_path)
        if attempt == kills:
            assert run.process.wait(timeout=600) == 0, run.text()[-3000:]
            break
        before = {d.name: last_epoch(d / "last.ckpt") for d in stage_dirs}
        if from_process_start:
            delay = rng.uniform(0.0, 12.0 + train_seconds)
        else:
            assert run.training.wait(timeout=300), run.text()[-3000:]
            delay = rng.uniform(0.15, 0.75) * train_seconds
        time.sleep(delay)
        if run.process.poll() is not None:  # it finished before the kill: nothing left to interrupt
            assert run.process.returncode == 0, run.text()[-3000:]
            break
        run.process.send_signal(signal.SIGKILL)
        run.process.wait()
        run.reader.join(timeout=10)
        after = {}
        label = (f"SIGKILL #{attempt} of train_backbone.py {delay:.2f} s after "
                 f"{'process start' if from_process_start else 'training started'}"
                 f"{' (resumed run)' if resume else ''}")
        try:
            after = {d.name: last_epoch(d / "last.ckpt") for d in stage_dirs}
            for d in stage_dirs:
                if (d / "best.ckpt").exists():
                    read_checkpoint(d / "best.ckpt")
            ok = run.process.returncode == -signal.SIGKILL and all(after[k] >= before[k] for k in before)
            note = f"last.ckpt epochs {before} -> {after}"
        except LightningPutmError as exc:
            ok, note = False, f"checkpoint unreadable after the kill: {exc}"
        LEDGER.record(label, ok, note)
        assert ok, f"{label}: {note}\n{run.text()[-2000:]}"
    LEDGER.add("pretraining runs resumed after SIGKILL", resumed)
    return folder


def assert_same_training_state(reference: Path, interrupted: Path, stages: list[str]) -> None:
    for stage in stages:
        for name in ("last.ckpt", "best.ckpt"):
            a = read_checkpoint(reference / "digits" / "conv4" / "latest" / stage / name)
            b = read_checkpoint(interrupted / "digits" / "conv4" / "latest" / stage / name)
            assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"]), (stage, name)
            assert a["state_dict"].keys() == b["state_dict"].keys()
            different = [k for k in a["state_dict"] if not torch.equal(a["state_dict"][k], b["state_dict"][k])]
            assert not different, (stage, name, different[:5])
            state_a, state_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
            assert state_a.keys() == state_b.keys()
            for key in state_a:
                for field in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(state_a[key][field], state_b[key][field]), (stage, name, key, field)


def reference_run(tmp_path: Path, args: list[str]) -> tuple[Path, float]:
    """The uninterrupted run, in this process (one thread, like the children): its folder and training time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        run_train_backbone([*args, f"checkpoint_dir={tmp_path / 'reference'}", "trainer.enable_progress_bar=false"],
                           log=lambda _: None)
        return tmp_path / "reference", time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def test_pretraining_killed_at_random_points_resumes_to_identical_weights(tmp_path: Path) -> None:
    args = [*TRAIN, "stages=[s2m2r]", "trainer.max_epochs=8"]
    reference, seconds = reference_run(tmp_path, args)
    interrupted = kill_and_resume(tmp_path, args, ["s2m2r"], kills=2, seed=11, train_seconds=seconds)
    assert_same_training_state(reference, interrupted, ["s2m2r"])
    LEDGER.record("2 SIGKILLs + resume=true end with the uninterrupted run's weights (s2m2r)", True)


@pytest.mark.slow
def test_two_stage_pretraining_killed_many_times_anywhere_resumes_to_identical_weights(tmp_path: Path) -> None:
    """Kills anywhere in the process's life (start-up, either stage, checkpoint writes), 6 times."""
    args = [*TRAIN, "stages=[rotation,s2m2r]", "trainer.max_epochs=5"]
    reference, seconds = reference_run(tmp_path, args)
    interrupted = kill_and_resume(tmp_path, args, ["rotation", "s2m2r"], kills=6, seed=12, train_seconds=seconds,
                                  from_process_start=True)
    assert_same_training_state(reference, interrupted, ["rotation", "s2m2r"])
    LEDGER.record("6 SIGKILLs + resume=true end with the uninterrupted run's weights (rotation, s2m2r)", True)


# ------------------------------------------------------------------------------------------- Ctrl-C
#: Two settings (simpleshot, 1-shot, alpha 2 and balanced) on the demo features: a second or two each.
CTRL_C_EVAL = ["methods=[simpleshot]", "shots=[1]", "alphas=[2,balanced]", "tasks=3", "logger=none", "plots=false",
               "progress=false"]


def ctrl_c(args: list[str], cwd: Path, after: int | None) -> subprocess.CompletedProcess:
    """tests/helpers/ctrl_c.py with SIGINT sent to itself after the ``after``-th saved setting (None: never)."""
    env = {**ENV, "CTRL_C_AFTER_SETTINGS": str(after or 0)}
    # a shell that starts pytest in the background hands SIGINT down as ignored: give the child the default back
    return subprocess.run([sys.executable, str(HELPERS / "ctrl_c.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stamp(path: Path) -> tuple[int, int]:
    """What changes when a file is written again (atomic writes replace the inode)."""
    info = path.stat()
    return info.st_ino, info.st_mtime_ns


def test_ctrl_c_in_evaluate_says_which_output_dir_resumes_and_the_resume_skips_finished_settings(tmp_path: Path):
    stopped = ctrl_c(["evaluate", *CTRL_C_EVAL], tmp_path, after=1)  # output_dir=auto: a new run folder
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    last = [line for line in stopped.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted: evaluation stopped") and "resume with output_dir=" in last, last
    folder = tmp_path / last.rsplit("output_dir=", 1)[1]
    assert folder.parent.parent == tmp_path / "outputs" / "evaluate"  # the auto folder, named in the message
    first = folder / "settings" / "simpleshot-1shot-alpha_2.pt"
    assert first.is_file() and not (folder / "settings" / "simpleshot-1shot-alpha_balanced.pt").exists()
    assert not (folder / "results.csv").exists()
    before = stamp(first)

    lines: list[str] = []  # the resume and the uninterrupted reference run in this process (no interpreter start-up)
    run_evaluate([*CTRL_C_EVAL, f"output_dir={folder}"], log=lines.append)
    assert any(line.startswith("resumed 1 finished setting(s)") for line in lines), lines
    assert stamp(first) == before  # read back, not solved and written again
    run_evaluate([*CTRL_C_EVAL, f"output_dir={tmp_path / 'whole'}"], log=lambda _: None)
    assert (folder / "per_task.csv").read_bytes() == (tmp_path / "whole" / "per_task.csv").read_bytes()
    LEDGER.record("Ctrl-C in evaluate.py after 1 of 2 settings: exit 130, resumed with the named output_dir", True)


def test_ctrl_c_in_a_study_says_rerun_and_the_rerun_keeps_the_finished_setting(tmp_path: Path):
    import optuna
    import yaml

    spec = {"program": "evaluate.py", "name": "ctrlc", "method": "grid",
            "metric": {"name": "fewshot/simpleshot/acc", "goal": "maximize"},
            "parameters": {"seed": {"values": [0, 1]},
                           **{k: {"value": v} for k, v in (a.split("=", 1) for a in CTRL_C_EVAL)}}}
    sweep = tmp_path / "ctrlc.yaml"
    sweep.write_text(yaml.safe_dump(spec, sort_keys=False))
    command = ["study", str(sweep), "--dir", str(tmp_path / "study")]
    stopped = ctrl_c(command, tmp_path, after=1)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    last = [line for line in stopped.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted: study ctrlc stopped in run 1/2") and "re-run the same command" in last, last
    assert f"study {sweep} --dir {tmp_path / 'study'}" in last
    runs = list((tmp_path / "study" / "runs").iterdir())
    assert len(runs) == 1
    first = runs[0] / "settings" / "simpleshot-1shot-alpha_2.pt"
    before = stamp(first)
    storage = f"sqlite:///{tmp_path / 'study' / 'study.db'}"
    states = [t.state for t in optuna.load_study(study_name="ctrlc", storage=storage).get_trials()]
    assert states == [optuna.trial.TrialState.FAIL]  # not left RUNNING: the re-run need not wait for its heartbeat

    lines: list[str] = []
    run_study(command[1:], log=lines.append)  # the same command, in this process
    assert stamp(first) == before
    assert any("run 2/2 done" in line for line in lines), lines
    assert len((tmp_path / "study" / "summary.csv").read_text().splitlines()) == 3  # header + both runs
    LEDGER.record("Ctrl-C in a study after its first setting: exit 130, the re-run resumes the run in flight", True)
