"""One folder, one running job (issue 43): a second run into an ``output_dir`` (or a training run folder) that a
live job holds is refused with one line naming the holder, before it writes anything; a lock whose holder died is
taken over with a notice; the lock is gone once the job ends, however it ends."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.cli import FAST_EVAL, FAST_TRAIN, REPO, run_in_process
from lightning_putm.jobs import evaluate as evaluate_job
from lightning_putm.runs import (LOCK_FILE, FolderInUse, _process_start, acquire_folder_lock, folder_locked,
                                 latest_run)


def write_lock(folder: Path, pid: int, host: str | None = None, start: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_FILE
    lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "since": "2026-11-28 10:00:00",
                                "start": start, "command": "python evaluate.py tasks=1000"}) + "\n")
    return lock


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


def test_a_second_evaluation_into_a_folder_a_live_process_holds_is_refused_before_it_writes(tmp_path: Path) -> None:
    """A real second process holds the folder (``folder_locked``, waiting on stdin): ``evaluate.py`` into it exits 2
    with one line naming output_dir and the holder's pid, and adds nothing to the folder; once the holder has ended,
    the same command runs and leaves no lock behind.
    Kills: no lock at all (two runs overwrite each other), a check after the config or results are written, a lock
    not released by its holder's normal exit, a lock left behind after a successful run."""
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from lightning_putm.runs import folder_locked
            with folder_locked(Path({str(out)!r}), "holder"):
                print("held", flush=True)
                sys.stdin.readline()
            """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = run_in_process("evaluate", [*FAST_EVAL, f"output_dir={out}"])
        assert refused.user_error_problem(rf"output_dir={out}: the folder is in use by a running job \(pid "
                                          rf"{holder.pid} on host ") is None, refused.stderr
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # no config.yaml, settings/ or results
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0 and not (out / LOCK_FILE).exists()  # released by its holder
    done = run_in_process("evaluate", [*FAST_EVAL, f"output_dir={out}"])
    assert done.returncode == 0, done.stderr
    assert (out / "results.csv").is_file() and not (out / LOCK_FILE).exists()


def test_a_lock_of_the_parent_process_refuses_and_a_dead_holders_lock_is_taken_over(tmp_path: Path) -> None:
    """A lock naming a live pid (the test's parent) refuses the run; one naming a pid that has ended is taken
    over with a notice, and the run succeeds and removes it.
    Kills: a liveness test that ignores the pid (every lock stale, or every lock live: a killed run's folder could
    never be resumed), a takeover without a word."""
    out = tmp_path / "out"
    write_lock(out, os.getppid())
    refused = run_in_process("evaluate", [*FAST_EVAL, f"output_dir={out}"])
    assert refused.user_error_problem(rf"pid {os.getppid()} on host {socket.gethostname()}") is None, refused.stderr
    assert not (out / "results.csv").exists()
    write_lock(out, dead_pid())
    taken = run_in_process("evaluate", [*FAST_EVAL, f"output_dir={out}"])
    assert taken.returncode == 0, taken.stderr
    assert "was left by a job that is no longer running" in taken.stdout + taken.stderr
    assert (out / "results.csv").is_file() and not (out / LOCK_FILE).exists()


@pytest.mark.parametrize("failure", [KeyboardInterrupt("stopped"), RuntimeError("broken")])
def test_the_lock_is_released_when_the_run_fails_or_is_interrupted(tmp_path: Path, monkeypatch,
                                                                   failure: BaseException) -> None:
    """Ctrl-C or an error inside the test loop: the run's lock is gone afterwards (the next run is not refused).
    Kills: a release on the success path only."""
    out = tmp_path / "out"
    seen = []

    def fail(trainer, module, datamodule, folder) -> None:
        seen.append((folder / LOCK_FILE).is_file())  # held while the loop runs
        raise failure

    monkeypatch.setattr(evaluate_job, "run_test_loop", fail)
    with pytest.raises(type(failure)):
        evaluate_job.run_evaluate([*FAST_EVAL, f"output_dir={out}"], lambda _: None)
    assert seen == [True] and not (out / LOCK_FILE).exists()


def test_only_the_first_process_of_a_launched_job_takes_the_lock(tmp_path: Path, monkeypatch) -> None:
    """The processes a DDP launcher starts for ranks > 0 share the folder of rank 0, which holds its lock: they
    neither take it nor are refused by it. Kills: every rank taking the lock (rank 1 refused by rank 0's lock)."""
    write_lock(tmp_path, os.getppid())
    for key, value in (("LOCAL_RANK", "1"), ("RANK", "3"), ("NODE_RANK", "1")):
        monkeypatch.setenv(key, value)
        with folder_locked(tmp_path, "output_dir=x", print) as folder:
            assert folder == tmp_path
        monkeypatch.delenv(key)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(FolderInUse):
        with folder_locked(tmp_path, "output_dir=x", print):
            pass


def test_a_lock_from_another_host_is_refused_with_how_to_clear_it(tmp_path: Path) -> None:
    """A holder on another machine cannot be looked up from here: refused, and the message says which file to
    delete if that job is gone. Kills: judging another host's pid by this host's processes (taking over a live
    job's folder on a shared filesystem)."""
    lock = write_lock(tmp_path, dead_pid(), host="another-node-17")
    with pytest.raises(FolderInUse, match=rf"another-node-17.*delete {lock}"):
        acquire_folder_lock(tmp_path, "output_dir=x", print)


@pytest.mark.skipif(_process_start(os.getpid()) is None, reason="process start times are read from /proc (Linux)")
def test_a_live_pid_that_started_after_the_lock_was_written_is_not_its_holder(tmp_path: Path) -> None:
    """After a reboot the holder's pid may belong to an unrelated process: the start time recorded in the lock
    tells them apart. Kills: a liveness test by pid alone."""
    write_lock(tmp_path, os.getppid(), start="1")  # the parent runs, but it did not start at tick 1
    notices: list[str] = []
    mine = acquire_folder_lock(tmp_path, "output_dir=x", notices.append)
    assert json.loads(mine)["pid"] == os.getpid() and len(notices) == 1


def test_resuming_a_training_that_is_still_running_is_refused_before_it_writes(tmp_path: Path) -> None:
    """``train_backbone.py resume=true`` of a run whose folder a live process holds: one line, and neither the
    run's config.yaml nor ``latest`` change; ``run=<name>`` of a held folder likewise. A finished training leaves no
    lock. Kills: training without the folder lock; ``latest`` moved before the lock is taken."""
    first = run_in_process("train_backbone", [*FAST_TRAIN, f"checkpoint_dir={tmp_path}"])
    assert first.returncode == 0, first.stderr
    root = tmp_path / "digits" / "conv4"
    run = latest_run(root)
    assert run is not None and not (run / LOCK_FILE).exists()
    config = (run / "config.yaml").read_bytes()
    write_lock(run, os.getppid())
    resumed = run_in_process("train_backbone", [*FAST_TRAIN, f"checkpoint_dir={tmp_path}", "resume=true",
                                                "trainer.max_epochs=2"])
    assert resumed.user_error_problem(rf"resume=true run={run.name} .*in use by a running job \(pid "
                                      rf"{os.getppid()}") is None, resumed.stderr
    assert (run / "config.yaml").read_bytes() == config
    held = root / "named"
    write_lock(held, os.getppid())
    named = run_in_process("train_backbone", [*FAST_TRAIN, f"checkpoint_dir={tmp_path}", "run=named"])
    assert named.user_error_problem(r"run=named .*in use by a running job") is None, named.stderr
    assert latest_run(root) == run.resolve() and sorted(p.name for p in held.iterdir()) == [LOCK_FILE]
