"""lightning_putm.atomic: the package's one way to write a file, and a scan that keeps it the only one.

An interrupted write (an exception in the writer, Ctrl-C, SIGTERM) never leaves a half-written file under the real
name nor a temporary file beside it; the file gets the mode a plain ``open()`` would give; every kind of content
reads back as written. The AST scan fails when a module other than ``atomic.py`` renames a file into place by hand.
"""

from __future__ import annotations

import ast
import csv
import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lightning_putm.atomic import (STALE_TEMP_SECONDS, atomic_savefig, atomic_torch_save, atomic_write,
                                   atomic_write_bytes, atomic_write_csv, atomic_write_dict_csv, atomic_write_text,
                                   default_file_mode)
from lightning_putm.signals import Terminated, sigterm_as_interrupt

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "lightning_putm"


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def python_signals() -> Iterator[None]:
    """Python's own handlers, whatever the test runner installed: Ctrl-C raises KeyboardInterrupt and SIGTERM is
    left to :func:`sigterm_as_interrupt`."""
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@pytest.fixture
def umask() -> Iterator[Callable[[int], int]]:
    """Set the process umask for the test; restored afterwards."""
    original = os.umask(0o022)
    os.umask(original)
    try:
        yield os.umask
    finally:
        os.umask(original)


# ------------------------------------------------------------------------------------------- interruptions
def test_an_exception_in_the_writer_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "results.csv", "old\n")

    def failing(handle: BinaryIO) -> None:
        handle.write(b"new, half of it")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, failing)
    assert target.read_text() == "old\n"
    assert names(tmp_path) == ["results.csv"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_in_the_middle_of_a_write_waits_until_the_file_is_complete(
        tmp_path: Path, python_signals: None, signum: int) -> None:
    """The signal stops the program after the write: the new file is whole, nothing is left beside it."""
    target = atomic_write_bytes(tmp_path / "last.ckpt", b"old")

    def interrupted(handle: BinaryIO) -> None:
        handle.write(b"first half, ")
        os.kill(os.getpid(), signum)
        handle.write(b"second half")

    expected = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    with sigterm_as_interrupt(), pytest.raises(expected):
        atomic_write(target, interrupted)
    assert target.read_bytes() == b"first half, second half"
    assert names(tmp_path) == ["last.ckpt"]


def test_a_signal_during_a_write_that_then_fails_keeps_the_old_file(tmp_path: Path, python_signals: None) -> None:
    """Ctrl-C is still delivered after the failed write is cleaned up."""
    target = atomic_write_text(tmp_path / "config.yaml", "old: 1\n")

    def interrupted_then_failing(handle: BinaryIO) -> None:
        handle.write(b"new: ")
        os.kill(os.getpid(), signal.SIGINT)
        raise OSError("no space left on device")

    with pytest.raises(KeyboardInterrupt) as caught:
        atomic_write(target, interrupted_then_failing)
    assert isinstance(caught.value.__context__, OSError)  # the write's own error is not lost
    assert target.read_text() == "old: 1\n"
    assert names(tmp_path) == ["config.yaml"]


def test_stale_temporary_files_of_the_same_path_are_removed_and_fresh_ones_kept(tmp_path: Path) -> None:
    """A killed writer's leftover goes once it is stale; a write in progress (fresh) and other files' stay."""
    stale = tmp_path / ".summary.md.killed.tmp"
    fresh = tmp_path / ".summary.md.running.tmp"
    other = tmp_path / ".per_task.csv.killed.tmp"
    for path in (stale, fresh, other):
        path.write_bytes(b"partial")
    old = time.time() - 2 * STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    atomic_write_text(tmp_path / "summary.md", "# Study\n")
    assert names(tmp_path) == sorted([fresh.name, other.name, "summary.md"])


# ------------------------------------------------------------------------------------------- mode
@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_the_file_gets_the_mode_open_would_give_under_the_umask(tmp_path: Path, umask, mask: int) -> None:
    umask(mask)
    reference = tmp_path / "plain.txt"
    reference.write_text("x")
    written = atomic_write_text(tmp_path / "atomic.txt", "x")
    assert default_file_mode() == 0o666 & ~mask
    assert written.stat().st_mode & 0o777 == reference.stat().st_mode & 0o777 == 0o666 & ~mask


def test_replacing_a_file_gives_the_default_mode_not_the_temporary_files_0600(tmp_path: Path, umask) -> None:
    umask(0o022)
    target = tmp_path / "latest.txt"
    target.write_text("old")
    target.chmod(0o600)
    atomic_write_text(target, "new")
    assert target.stat().st_mode & 0o777 == 0o644


# ------------------------------------------------------------------------------------------- round trips
def test_text_round_trips_byte_for_byte_and_creates_the_folder(tmp_path: Path) -> None:
    text = "α = 2\r\nkeeps both line ends\nand non-ASCII ✓\n"
    path = atomic_write_text(tmp_path / "a" / "b" / "summary.md", text)
    assert path == tmp_path / "a" / "b" / "summary.md"
    assert path.read_bytes() == text.encode("utf-8")


def test_bytes_round_trip_and_an_overwrite_replaces_the_content(tmp_path: Path) -> None:
    data = bytes(range(256)) * 100
    path = atomic_write_bytes(tmp_path / "blob.bin", b"a much longer old content " * 1000)
    atomic_write_bytes(path, data)
    assert path.read_bytes() == data
    assert names(tmp_path) == ["blob.bin"]


def test_torch_round_trips_through_a_weights_only_load(tmp_path: Path) -> None:
    obj = {"w": torch.arange(12.0).reshape(3, 4), "labels": torch.tensor([0, 1, 2]), "meta": '{"k": 1}'}
    path = atomic_torch_save(obj, tmp_path / "setting.pt")
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], obj["w"]) and torch.equal(loaded["labels"], obj["labels"])
    assert loaded["meta"] == obj["meta"]


def test_csv_writers_write_what_the_csv_module_writes(tmp_path: Path) -> None:
    rows = [["a,b", 1, "x\"y"], ["α", 2.5, ""]]
    expected = io.StringIO(newline="")
    writer = csv.writer(expected, lineterminator="\n")
    writer.writerow(["name", "value", "note"])
    writer.writerows(rows)
    path = atomic_write_csv(tmp_path / "counts.csv", ["name", "value", "note"], rows, lineterminator="\n")
    assert path.read_bytes() == expected.getvalue().encode("utf-8")

    dict_rows = [{"method": "putm", "acc": "0.5"}, {"method": "tim", "acc": "0.25"}]
    expected = io.StringIO(newline="")
    dict_writer = csv.DictWriter(expected, fieldnames=["method", "acc"])
    dict_writer.writeheader()
    dict_writer.writerows(dict_rows)
    path = atomic_write_dict_csv(tmp_path / "per_task.csv", ["method", "acc"], dict_rows)
    assert path.read_bytes() == expected.getvalue().encode("utf-8")
    assert b"\r\n" in path.read_bytes()  # csv.DictWriter's default line end is kept, not translated


@pytest.mark.parametrize("suffix", ["png", "pdf"])
def test_a_figure_is_written_in_the_format_of_its_suffix(tmp_path: Path, suffix: str) -> None:
    """The temporary file ends in ``.tmp``; the format still follows the destination's name."""
    figure = Figure(figsize=(2, 2))
    FigureCanvasAgg(figure)
    figure.add_subplot().plot([0, 1, 2], [2, 0, 1])
    options = {"metadata": {"CreationDate": None}} if suffix == "pdf" else {"dpi": 50}
    expected = io.BytesIO()
    figure.savefig(expected, format=suffix, **options)
    path = atomic_savefig(figure, tmp_path / f"summary.{suffix}", **options)
    assert path.read_bytes() == expected.getvalue()
    assert path.read_bytes().startswith(b"\x89PNG" if suffix == "png" else b"%PDF")
    assert names(tmp_path) == [f"summary.{suffix}"]


# ------------------------------------------------------------------------------------------- one writer
#: Renames that are not file writes: the ``latest`` symlink swap (already atomic) and a downloaded dataset folder
#: moved into place (never over an existing one).
ALLOWED_RENAMES = {"lightning_putm/runs.py:point_latest", "lightning_putm/data/download.py:move_into_place"}


def hand_written_renames(source: str, filename: str) -> list[str]:
    """``file:function:line`` of each call that renames a file into place: ``os.replace``/``os.rename`` (also
    imported by name), ``shutil.move`` and ``<path>.replace(target)``/``<path>.rename(target)``."""
    tree = ast.parse(source, filename)
    imported = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil")
                for alias in node.names if alias.name in ("replace", "rename", "move")}
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                hit = func.id in imported
            elif isinstance(func, ast.Attribute) and func.attr in ("replace", "rename", "move"):
                owner = func.value.id if isinstance(func.value, ast.Name) else None
                if owner in ("os", "shutil"):
                    hit = True
                else:  # Path.replace(target) has one argument; str.replace has two, dataclasses.replace keywords
                    hit = func.attr != "move" and owner != "dataclasses" and len(node.args) == 1 and not node.keywords
            else:
                hit = False
            if hit:
                found.append(f"{filename}:{function}:{node.lineno}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_no_module_but_atomic_py_renames_a_file_into_place_by_hand() -> None:
    """A new hand-written ``tmp.replace(path)`` (no fsync, no cleanup, no signal deferral) fails here: use
    ``lightning_putm.atomic``."""
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        relative = path.relative_to(PACKAGE_ROOT.parent).as_posix()
        if relative != "lightning_putm/atomic.py":
            found += hand_written_renames(path.read_text(), relative)
    allowed_seen = {hit.rpartition(":")[0] for hit in found if hit.rpartition(":")[0] in ALLOWED_RENAMES}
    assert [hit for hit in found if hit.rpartition(":")[0] not in ALLOWED_RENAMES] == []
    assert allowed_seen == ALLOWED_RENAMES  # the scan sees the two known renames, so it does look


def test_the_rename_scan_flags_each_hand_written_form_and_nothing_else() -> None:
    source = """
import os, dataclasses
from os import replace as swap
from pathlib import Path

def text(path):
    tmp = path.with_name(".x.tmp")
    tmp.write_text("x")
    tmp.replace(path)

def other(a, b):
    os.replace(a, b)
    swap(a, b)
    Path(a).rename(b)

def fine(s, obj):
    s.replace("a", "b")
    dataclasses.replace(obj, x=1)
    obj.replace(year=2020)
"""
    assert hand_written_renames(source, "m.py") == ["m.py:text:9", "m.py:other:12", "m.py:other:13",
                                                     "m.py:other:14"]


def test_atomic_py_imports_only_signals_torch_and_the_standard_library() -> None:
    """It is foundation: every module of the package may use it."""
    tree = ast.parse((PACKAGE_ROOT / "atomic.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    outside = sorted(name for name in imported if name.split(".")[0] not in sys.stdlib_module_names
                     and name not in ("__future__", "torch", "lightning_putm.signals"))
    assert outside == []
