"""Atomic file writes: the one place in the package that writes a file, so a reader sees the old or the new one.

Every file the package writes (checkpoints, feature caches, stored settings, CSV/YAML/Markdown results, figures,
``latest.txt``) goes through :func:`atomic_write`:

1. a temporary file ``.<name>.<random>.tmp`` in the destination folder (the rename must stay on one filesystem),
2. the content, then flush and fsync (the data is on disk before the name points at it),
3. the mode a plain ``open()`` would give (``mkstemp`` makes 0600; results are as readable as any file),
4. ``os.replace`` over the destination, then an fsync of the folder (the rename itself is durable).

An exception (a failing writer, a full disk) removes the temporary file and leaves the destination as it was.
Ctrl-C and SIGTERM wait until the write is complete (:func:`~lightning_putm.signals.signals_deferred`): raised
inside ``torch.save`` they would fail the save with ``RuntimeError: unexpected pos``. A process killed mid-write
(SIGKILL, OOM killer, power loss) leaves the destination intact plus a temporary file that is never read; the next
successful write to the same path removes it once it is :data:`STALE_TEMP_SECONDS` old.

This module is foundation: it imports only :mod:`lightning_putm.signals` and the standard library (torch only
inside :func:`atomic_torch_save`, so that the commands' start-up, their ``--help`` and config errors, need no torch).
"""

from __future__ import annotations

import contextlib
import csv
import glob
import io
import os
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Mapping, Sequence, TextIO

from lightning_putm.signals import signals_deferred

#: A temporary file of an earlier write to the same path untouched this long was left by a killed process.
STALE_TEMP_SECONDS = 15 * 60


def atomic_write(path: str | os.PathLike, writer: Callable[[BinaryIO], object]) -> Path:
    """Call ``writer`` on a binary handle of a temporary file and rename it over ``path`` (steps in the module
    docstring); create the folder if needed and return ``path``."""
    path = Path(path)
    with signals_deferred():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                writer(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, default_file_mode())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fsync_folder(path.parent)
        remove_stale_temps(path)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda handle: handle.write(data))


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically, newlines as given (``Path.write_text`` on POSIX, with a fixed encoding
    so the bytes do not depend on the locale)."""
    return atomic_write(path, lambda handle: handle.write(text.encode(encoding)))


def atomic_write_stream(path: str | os.PathLike, writer: Callable[[TextIO], object], encoding: str = "utf-8") -> Path:
    """Like :func:`atomic_write` with a text handle (no newline translation, as the csv module requires)."""

    def write(handle: BinaryIO) -> None:
        text = io.TextIOWrapper(handle, encoding=encoding, newline="")
        writer(text)
        text.flush()
        text.detach()  # the binary handle stays open for atomic_write's fsync

    return atomic_write(path, write)


def atomic_write_csv(path: str | os.PathLike, header: Sequence[str], rows: Iterable[Sequence[Any]],
                     lineterminator: str = "\r\n") -> Path:
    """A CSV file of ``header`` and list ``rows``, atomically (``lineterminator`` as ``csv.writer`` takes it)."""

    def write(handle: TextIO) -> None:
        writer = csv.writer(handle, lineterminator=lineterminator)
        writer.writerow(header)
        writer.writerows(rows)

    return atomic_write_stream(path, write)


def atomic_write_dict_csv(path: str | os.PathLike, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> Path:
    """A CSV file of dict ``rows`` under the header ``columns`` (``csv.DictWriter`` defaults), atomically."""

    def write(handle: TextIO) -> None:
        writer = csv.DictWriter(handle, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)

    return atomic_write_stream(path, write)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (a checkpoint, a feature cache, a stored setting)."""
    import torch

    return atomic_write(path, lambda handle: torch.save(obj, handle))


def atomic_savefig(figure: Any, path: str | os.PathLike, format: str | None = None, **options: Any) -> Path:
    """``figure.savefig`` (a matplotlib figure) to ``path`` atomically; ``format`` defaults to the suffix, since
    the temporary file's name does not carry it (no suffix: matplotlib's ``savefig.format``)."""
    path = Path(path)
    fmt = format or path.suffix.lstrip(".").lower() or None
    return atomic_write(path, lambda handle: figure.savefig(handle, format=fmt, **options))


def default_file_mode() -> int:
    """The mode ``open()`` would give a new file under the current umask (0644 under the usual 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX); best effort where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temps(path: str | os.PathLike, older_than: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Delete temporary files of interrupted writes to ``path`` not modified for ``older_than`` seconds (a write in
    progress keeps touching its own)."""
    path = Path(path)
    now = time.time()
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            if now - tmp.stat().st_mtime > older_than:
                tmp.unlink()
                removed.append(tmp)
        except OSError:  # removed by someone else meanwhile
            pass
    return removed
