"""A study shared by several processes through PostgreSQL (``--storage postgresql://...``), the docs' many-machine
setup, on a real server that the tests start themselves (:mod:`helpers.postgres`): two workers on one storage, one
SIGKILLed in the middle of a run, every point run exactly once, the dead worker's point taken over by the survivor
once its heartbeat is stale, and a complete summary. Skipped, with the reason, where no server binaries or no driver
are installed; ``.ci/run`` installs both, and under CI a missing one is a failure, not a skip."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from helpers.cli import REPO
from helpers.postgres import fresh_database, throwaway_server, unavailable
from lightning_putm.errors import ConfigError
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.study import run_study
from lightning_putm.studies.study import Study, storage_url
from lightning_putm.studies.sweep import point_key, read_sweep
from test_study import GRID, read_csv, sweep_file

POINTS = [{"method.putm.rho": r, "alphas": a} for r in (0.0, 1.0) for a in (2, "balanced")]
#: Bounded waits: far above what each step takes (seconds), so only a real hang fails them.
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def postgres_url():
    reason = unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL test cannot run under CI: {reason}; .ci/run installs the server and the driver")
        pytest.skip(reason)
    with throwaway_server() as url:
        yield url


def worker_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline",
            "PYTHONPATH": str(REPO)}


def trials(storage: optuna.storages.RDBStorage, name: str) -> list[optuna.trial.FrozenTrial]:
    """The study's trials as another machine sees them ([] until a worker has created the study)."""
    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    except KeyError:
        return []


def has_heartbeat(url: str, trial_id: int) -> bool:
    """Whether the trial's worker has recorded a heartbeat (before it, Optuna can never declare the trial stale)."""
    import psycopg

    with psycopg.connect(url) as db:
        return db.execute("SELECT 1 FROM trial_heartbeats WHERE trial_id = %s", (trial_id,)).fetchone() is not None


def wait_for(condition, what: str, *alive: subprocess.Popen) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after TIMEOUT_S, or when a process in ``alive`` ends."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        for process in alive:
            assert process.poll() is None, (f"a worker ended (rc {process.returncode}) while waiting for {what}: "
                                            f"{' '.join(map(str, process.args))}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail, instead of hanging, if the block takes longer than ``seconds`` (SIGALRM interrupts the study's loop)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_two_workers_share_a_postgres_study_and_the_survivor_takes_over_a_killed_run(postgres_url, tmp_path,
                                                                                      single_thread):
    # kills: no heartbeat given to the storage, or stale trials never failed (the survivor waits forever for the
    # dead worker's point: the deadline fails it); a point in flight elsewhere taken at once (it starts before the
    # kill); a finished point re-run; a summary that drops or repeats a point
    name = "shared"
    # both machines run the same fixed settings (a study refuses others); machine A's environment makes its runs long
    slow = {**GRID["parameters"], "method.putm.em_steps": {"value": "${oc.decode:${oc.env:PUTM_TEST_EM_STEPS,3}}"}}
    path = sweep_file(tmp_path, {**GRID, "name": name, "parameters": slow})
    options = ["--storage", postgres_url, "--heartbeat", "1", "--grace", "5"]
    victim_dir, survivor_dir = tmp_path / "machine_a", tmp_path / "machine_b"
    watch = optuna.storages.RDBStorage(storage_url(postgres_url))  # the tables exist before any worker starts
    # machine A, a process of its own: its runs never end (a million EM steps per task), so it is surely in the
    # middle of its first run when it is killed; machine B, this process, runs 3 EM steps
    with open(tmp_path / "machine_a.log", "w") as log:  # read it when a wait below fails
        victim = subprocess.Popen([sys.executable, "-m", "lightning_putm", "study", str(path), *options, "--dir",
                                   str(victim_dir)], cwd=tmp_path,
                                  env={**worker_env(), "PUTM_TEST_EM_STEPS": "1000000"},
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        def victim_running() -> list[optuna.trial.FrozenTrial]:
            return [t for t in trials(watch, name) if t.state == TrialState.RUNNING
                    and "point_key" in t.user_attrs and has_heartbeat(postgres_url, t._trial_id)]

        wait_for(lambda: victim_running(), "machine A to start a run and record its heartbeat", victim)
        (taken,) = victim_running()
        key = taken.user_attrs["point_key"]
        wait_for(lambda: (victim_dir / "runs" / key).is_dir(), "machine A's run folder", victim)

        # machine B, this process: the same command's code; machine A is SIGKILLed once B has finished a run
        ran: list[str] = []
        killed_at: list[datetime.datetime] = []

        def survivor_run(args: list[str]):
            ran.append(Path(next(a for a in args if a.startswith("output_dir="))[len("output_dir="):]).name)
            summaries = run_evaluate(args, log=lambda _: None)
            if not killed_at:
                assert victim.poll() is None, "machine A ended before it was killed"
                killed_at.append(datetime.datetime.now())
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=30)
            return summaries

        with deadline(TIMEOUT_S):
            run_study([str(path), *options, "--dir", str(survivor_dir)], log=lambda _: None, run=survivor_run)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=30)

    # machine B ran every point once, machine A's only after A was dead; A's run never finished
    assert sorted(ran) == sorted(point_key(p) for p in POINTS) and ran[0] != key
    everything = trials(watch, name)
    complete = [t for t in everything if t.state == TrialState.COMPLETE]
    assert sorted(t.user_attrs["point_key"] for t in complete) == sorted(ran)
    # the only other trial is machine A's run, failed by its stale heartbeat
    assert [(t.state, t.user_attrs["point_key"]) for t in everything if t.state != TrialState.COMPLETE] == \
        [(TrialState.FAIL, key)]
    (takeover,) = [t for t in complete if t.user_attrs["point_key"] == key]
    assert takeover.datetime_start > killed_at[0] and takeover.number > taken.number
    assert {Path(t.user_attrs["output_dir"]).parent for t in complete} == {survivor_dir / "runs"}
    assert all((survivor_dir / "runs" / point_key(p) / "results.csv").is_file() for p in POINTS)
    assert [p.name for p in (victim_dir / "runs").iterdir()] == [key]
    assert not (victim_dir / "runs" / key / "results.csv").exists()
    # the summary lists every point once, each with the run that finished it
    rows = read_csv(survivor_dir / "summary.csv")
    assert sorted((r["method.putm.rho"], r["alphas"]) for r in rows) == \
        sorted((str(p["method.putm.rho"]), str(p["alphas"])) for p in POINTS)
    assert {Path(r["output_dir"]).name for r in rows} == {point_key(p) for p in POINTS}


def open_study(sweep, folder: Path, url: str, barrier, outcomes) -> None:
    """One machine's start of a study (in a forked process): wait for the others, then open the storage."""
    try:
        study = Study(sweep, folder, url, heartbeat_s=1, grace_s=5, log=lambda _: None)
        barrier.wait(timeout=TIMEOUT_S)
        outcomes.put(f"ok {study.study.study_name}")
    except BaseException as exc:  # reported to the test, which names it
        outcomes.put(f"{type(exc).__name__}: {exc}")


def test_workers_that_start_together_on_a_fresh_database_all_open_it(postgres_url, tmp_path):
    # kills: opening the storage only once (all but one machine fail on the tables another created in the same
    # moment: 10 of 10 tries with two processes, before the second look was added)
    url = fresh_database(postgres_url, "together")
    sweep = read_sweep(sweep_file(tmp_path, {**GRID, "name": "together"}))
    context = multiprocessing.get_context("fork")  # the children need nothing but the storage: no re-import
    barrier, outcomes = context.Barrier(3), context.Queue()
    machines = [context.Process(target=open_study, args=(sweep, tmp_path / f"m{i}", url, barrier, outcomes))
                for i in range(3)]
    for machine in machines:
        machine.start()
    results = sorted(outcomes.get(timeout=TIMEOUT_S) for _ in machines)
    for machine in machines:
        machine.join(timeout=TIMEOUT_S)
    assert results == ["ok together"] * 3
    assert optuna.get_all_study_names(storage_url(url)) == ["together"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_point_enqueued_twice_still_runs_once(backend, request, tmp_path, single_thread):
    # kills: running whatever waiting trial Optuna pops (two processes that see the same free point at once both
    # enqueue it; a process killed between enqueueing and starting leaves its point waiting): the point runs 3 times
    url = request.getfixturevalue("postgres_url") if backend == "postgresql" else None
    sweep = read_sweep(sweep_file(tmp_path, {**GRID, "name": f"twice_{backend}"}))
    study = Study(sweep, tmp_path / "study", url, heartbeat_s=1, grace_s=2, log=lambda _: None)
    first = sweep.points()[0]
    for _ in range(2):  # another process's enqueue of the same point, and one left by a process killed before its run
        study.study.enqueue_trial({k: Study._grid_value(v) for k, v in first.items()})
    calls: list[list[str]] = []

    def run(args: list[str]):
        calls.append(args)
        return run_evaluate(args, log=lambda _: None)

    study.run(run)
    ran = [Path(a.split("=", 1)[1]).name for args in calls for a in args if a.startswith("output_dir=")]
    assert sorted(ran) == sorted(point_key(p) for p in POINTS)
    assert sorted(r.key for r in study.rows()) == sorted(ran)


def test_postgresql_urls_use_psycopg_and_a_missing_driver_is_named(monkeypatch):
    # kills: a postgresql:// URL left to SQLAlchemy 2.0's default driver (psycopg2, which the extra does not install)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "psycopg" else real(name, *a))
    assert storage_url("postgresql://me:pw@db-host/studies") == "postgresql+psycopg://me:pw@db-host/studies"
    assert storage_url("postgres://db-host/studies") == "postgresql+psycopg://db-host/studies"
    assert storage_url("sqlite:///x/study.db") == "sqlite:///x/study.db"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"psycopg is not installed.*\.\[postgres\]") as error:
        storage_url("postgresql://me:secret@db-host/studies")
    assert "secret" not in str(error.value)
    with pytest.raises(ConfigError, match="not a database URL"):
        storage_url("db-host/studies")


def test_an_unreachable_server_is_one_line_naming_the_storage_without_its_password(tmp_path):
    # kills: SQLAlchemy's traceback as the error, or the password printed with the URL
    pytest.importorskip("psycopg", reason="no PostgreSQL driver: pip install -e '.[postgres]' (psycopg)")
    from helpers.postgres import free_port

    url = f"postgresql://me:secret@127.0.0.1:{free_port()}/studies"  # nothing listens there
    with pytest.raises(ConfigError, match=r"--storage postgresql\+psycopg://me:\*\*\*@127\.0\.0\.1:\d+/studies: "
                                          r"cannot open it \(.+\); check that the server runs") as error:
        run_study([str(sweep_file(tmp_path)), "--dir", str(tmp_path / "s"), "--storage", url], log=lambda _: None)
    assert "secret" not in str(error.value) and "\n" not in str(error.value)
