"""Run folders: every run gets its own, and nothing a previous run wrote is replaced behind the user's back.

A run without an explicit folder writes to ``<root>/<YYYY-MM-DD>/<HH-MM-SS>-<name>/`` and points
``<root>/latest`` at it. A folder the user names explicitly is reused, and the results of that run replace the
previous ones whole: files of the managed kinds that this run did not write (a PUTM figure beside a
SimpleShot-only result) are removed once the new results are in place.

Under DDP every process must agree on the folder: the first process to resolve it records it in the
environment (:data:`RUN_DIR_ENV`), which the launcher hands to the processes it starts.
"""

from __future__ import annotations

import contextlib
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Iterable, Iterator

from lightning_putm.atomic import atomic_write_text

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
