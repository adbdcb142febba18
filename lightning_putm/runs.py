"""Run folders: every run gets its own, and nothing a previous run wrote is replaced behind the user's back.

A run without an explicit folder writes to ``<root>/<YYYY-MM-DD>/<HH-MM-SS>-<name>/`` and points
``<root>/latest`` at it. A folder the user names explicitly is reused, and the results of that run replace the
previous ones whole: files of the managed kinds that this run did not write (a PUTM figure beside a
SimpleShot-only result) are removed once the new results are in place.

Under DDP every process must agree on the folder: the first process to resolve it records it in the
environment (:data:`RUN_DIR_ENV`), which the launcher hands to the processes it starts.

Two jobs writing one folder would overwrite each other's results without a word, so a job holds the folder it
writes with a lock file (:data:`LOCK_FILE`: the holder's pid, host, start time and command) for as long as it
runs (:func:`folder_locked`); a second job into that folder is refused with one line naming the holder. A lock
whose holder no longer runs on this host (killed, the machine rebooted) is taken over with a notice; a lock
from another host cannot be checked and is left to the user to delete.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable, Iterator

from lightning_putm.atomic import atomic_write_text
from lightning_putm.errors import ConfigError

RUN_DIR_ENV = "LIGHTNING_PUTM_RUN_DIR"
LATEST = "latest"


def slug(name: str, limit: int = 60) -> str:
    """A name safe for folders and W&B: letters, digits, ``.``, ``_``, ``-``."""
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "run"
    return text[:limit]


@contextlib.contextmanager
def run_dir(root: Path, name: str, flat: bool = False) -> Iterator[Path]:
    """The run's folder for the duration of the job: a new one, or the one the launching process chose."""
    inherited = os.environ.get(RUN_DIR_ENV)
    if inherited:  # a process started by the DDP launcher of the process that chose the folder
        yield Path(inherited)
        return
    folder = new_run_dir(root, name, flat=flat)
    os.environ[RUN_DIR_ENV] = str(folder)
    try:
        yield folder
    finally:
        os.environ.pop(RUN_DIR_ENV, None)


def new_run_dir(root: Path, name: str, now: datetime | None = None, flat: bool = False) -> Path:
    """A fresh ``<root>/<date>/<time>-<name>`` (flat: ``<root>/<date>_<time>[-<name>]``; ``-2``, ``-3``, … when
    taken), created, with ``<root>/latest`` pointing at it."""
    now = now or datetime.now()
    if flat:
        day, stem = root, now.strftime("%Y-%m-%d_%H-%M-%S") + (f"-{slug(name)}" if name else "")
    else:
        day, stem = root / now.strftime("%Y-%m-%d"), f"{now.strftime('%H-%M-%S')}-{slug(name)}"
    folder, counter = day / stem, 1
    while True:
        try:
            folder.mkdir(parents=True, exist_ok=False)
            break
        except FileExistsError:
            counter += 1
            folder = day / f"{stem}-{counter}"
    point_latest(root, folder)
    return folder


def point_latest(root: Path, folder: Path) -> None:
    """Make ``<root>/latest`` a relative link to ``folder`` (atomically; a text file where links are unavailable)."""
    link = root / LATEST
    tmp = root / f".{LATEST}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        os.symlink(folder.relative_to(root), tmp, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:  # e.g. no symlink permission on Windows
        tmp.unlink(missing_ok=True)
        atomic_write_text(root / f"{LATEST}.txt", str(folder) + "\n")


def run_name(name: str | None, default: str) -> str:
    return slug(name) if name else slug(default)


def remove_stale(folder: Path, written: Iterable[Path], managed: Iterable[str]) -> list[Path]:
    """Delete files under ``folder`` matching the ``managed`` glob patterns that are not in ``written``."""
    keep = {Path(p).resolve() for p in written}
    removed = []
    for pattern in managed:
        for path in folder.glob(pattern):
            if path.is_file() and path.resolve() not in keep:
                path.unlink()
                removed.append(path)
    return removed


def latest_run(root: Path) -> Path | None:
    """The folder ``<root>/latest`` points at, or ``None``."""
    link = root / LATEST
    if link.is_symlink() or link.is_dir():
        return link.resolve()
    text = root / f"{LATEST}.txt"
    return Path(text.read_text().strip()) if text.is_file() else None


# --------------------------------------------------------------------------------------------- folder locks
#: The lock file a running job keeps in the folder it writes (evaluate.py's output folder, a training run folder).
LOCK_FILE = ".lightning_putm.lock"
#: An empty or unreadable lock file younger than this is being written by its holder; older, it is stale.
LOCK_WRITE_SECONDS = 10.0
#: Environment variables through which launchers (Lightning's DDP, torchrun, SLURM, ...) number the processes.
RANK_ENV = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


class FolderInUse(ConfigError):
    """A run folder that a live process holds (its lock file names the holder)."""


def launched_as_rank_zero() -> bool:
    """Whether this process is the first of its job: the one that takes a folder's lock. Processes started by a
    launcher for the other ranks (or on other nodes) share the folder of the first and take nothing. Read from
    the environment as Lightning reads the rank, so that no Trainer is needed."""
    for key in RANK_ENV:
        value = os.environ.get(key, "").strip()
        if value:
            if value != "0":
                return False
            break
    return all(os.environ.get(key, "").strip() in ("", "0") for key in ("NODE_RANK", "GROUP_RANK"))


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, Linux), or ``None`` where that cannot be read: with the
    pid it tells a live holder from an unrelated process that got the pid later."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text.rsplit(")", 1)[1].split()[19]  # field 22; the command name in (...) may hold spaces
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process a lock names still runs (only a process on this host can be looked at)."""
    try:
        pid = int(holder["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT there: count the holder as alive
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    started = holder.get("start")
    return started is None or _process_start(pid) in (None, started)


def _read_lock(lock: Path) -> tuple[dict | None, str]:
    """The lock's holder (``None``: empty, or not a lock we wrote) and its raw text (``""``: the file is gone)."""
    try:
        text = lock.read_text()
    except FileNotFoundError:
        return None, ""
    try:
        holder = json.loads(text)
    except ValueError:
        return None, text or " "
    return (holder if isinstance(holder, dict) and "pid" in holder else None), text


def _create_lock(lock: Path, text: str) -> bool:
    """Create ``lock`` holding ``text`` unless it exists (atomically: a reader never sees it half-written where
    the filesystem has hard links); ``False`` when it exists."""
    fd, tmp = tempfile.mkstemp(prefix=f"{lock.name}.", suffix=".tmp", dir=lock.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, lock)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some network or FAT filesystems): exclusive creation instead
            try:
                with open(lock, "x") as handle:
                    handle.write(text)
                return True
            except FileExistsError:
                return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _remove_if_unchanged(lock: Path, text: str) -> None:
    """Delete a stale ``lock`` if it still holds ``text``. A guard file makes the look and the delete one step,
    so that of two processes taking over the same stale lock one never deletes the lock the other just made."""
    guard = lock.with_name(f"{lock.name}.takeover")
    if not _create_lock(guard, str(os.getpid())):
        with contextlib.suppress(OSError):
            if time.time() - guard.stat().st_mtime > 60:  # left by a process killed during a takeover
                guard.unlink()
        return
    try:
        if _read_lock(lock)[1] == text:
            lock.unlink(missing_ok=True)
    finally:
        guard.unlink(missing_ok=True)


def _holder_text(holder: dict | None) -> str:
    if holder is None:
        return "a process whose lock file is being written"
    command = str(holder.get("command", ""))
    command = command if len(command) <= 80 else command[:77] + "..."
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"
            + (f": {command}" if command else ""))


def acquire_folder_lock(folder: Path, what: str, log: Callable[[str], None] = print) -> str:
    """Take ``folder``'s lock for this process, or raise :class:`FolderInUse` naming the holder and ``what`` the
    user typed (``output_dir=...``). A lock whose holder no longer runs on this host is stale: it is taken over
    with a notice. Returns the lock's text, to release it with :func:`release_folder_lock`."""
    lock = folder / LOCK_FILE
    host = socket.gethostname()
    mine = json.dumps({"pid": os.getpid(), "host": host, "start": _process_start(os.getpid()),
                       "since": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
                       "command": " ".join(["python", *sys.argv]), "token": uuid.uuid4().hex}) + "\n"
    noticed = False
    for _ in range(100):
        if _create_lock(lock, mine):
            return mine
        holder, text = _read_lock(lock)
        if not text:  # released meanwhile
            continue
        if holder is None:  # empty: being written (where hard links are missing), or left so by a killed process
            with contextlib.suppress(OSError):
                if time.time() - lock.stat().st_mtime < LOCK_WRITE_SECONDS:
                    time.sleep(0.2)
                    continue
        elif holder.get("host") != host or _alive(holder):
            other = "" if holder.get("host") == host else f"; if that job is gone (its machine stopped), delete {lock}"
            raise FolderInUse(f"{what}: the folder is in use by a running job ({_holder_text(holder)}); wait until "
                              f"it ends or give another folder{other}")
        if not noticed:
            log(f"notice: {lock} was left by a job that is no longer running "
                f"({_holder_text(holder) if holder else 'an empty lock file'}); taking the folder over")
            noticed = True
        _remove_if_unchanged(lock, text)
        time.sleep(0.01)
    raise FolderInUse(f"{what}: could not take the lock {lock}: other processes keep taking it; try again")


def release_folder_lock(folder: Path, mine: str) -> None:
    """Remove ``folder``'s lock if it is still this process's (``mine``: what :func:`acquire_folder_lock` wrote)."""
    lock = folder / LOCK_FILE
    if _read_lock(lock)[1] == mine:
        with contextlib.suppress(OSError):
            lock.unlink()


@contextlib.contextmanager
def folder_locked(folder: Path, what: str, log: Callable[[str], None] = print) -> Iterator[Path]:
    """Hold ``folder``'s lock while the block runs (released on every exit: an error, Ctrl-C, SIGTERM); a process
    that is not the first of its job (:func:`launched_as_rank_zero`) uses the folder without taking it."""
    if not launched_as_rank_zero():
        yield folder
        return
    mine = acquire_folder_lock(folder, what, log)
    try:
        yield folder
    finally:
        release_folder_lock(folder, mine)
