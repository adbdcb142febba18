"""Counters that reliability test modules report as figures ("bad inputs tried: 57, handled: 57").

Each module keeps one :class:`Ledger`. Tests record what they tried and whether it was handled; a module-scoped
fixture adds the figures to a "reliability figures" section of pytest's terminal summary (shown without ``-s``)
and fails the module if anything tried was not handled. The same line is appended to ``$RELIABILITY_FIGURES`` when that variable names a file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest


@dataclass
class Ledger:
    """Distinct items tried, the subset handled, and extra figures (e.g. bytes lost)."""

    name: str  # e.g. "bad inputs"
    verb: str = "handled"  # "handled", "recovered", ...
    tried: dict[str, str] = field(default_factory=dict)  # item -> outcome note
    handled: set[str] = field(default_factory=set)
    extra: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def record(self, item: str, ok: bool, note: str = "") -> None:
        self.tried[item] = note
        if ok:
            self.handled.add(item)
        else:
            self.handled.discard(item)

    def add(self, key: str, amount: float) -> None:
        self.extra[key] = self.extra.get(key, 0) + amount

    def line(self) -> str:
        parts = [f"{self.name} tried: {len(self.tried)}, {self.verb}: {len(self.handled)}"]
        parts += [f"{key}: {value:g}" for key, value in sorted(self.extra.items())]
        parts.append(f"module time: {time.perf_counter() - self.started:.1f} s")
        return "; ".join(parts)

    def failures(self) -> list[str]:
        return [f"{item} ({self.tried[item]})" for item in self.tried if item not in self.handled]


class _FiguresSection:
    """A plugin registered at run time: prints every module's figures in the terminal summary."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.lines:
            terminalreporter.section("reliability figures")
            for line in self.lines:
                terminalreporter.write_line(line)


def report(ledger: Ledger, request, module: str) -> None:
    """Queue the ledger's figures for the terminal summary (shown without ``-s``); fail on unhandled items."""
    text = f"{module}: {ledger.line()}"
    manager = request.config.pluginmanager
    section = manager.get_plugin("reliability-figures")
    if section is None:
        section = _FiguresSection()
        manager.register(section, "reliability-figures")
    section.lines.append(text)
    target = os.environ.get("RELIABILITY_FIGURES")
    if target:
        with open(target, "a") as handle:
            handle.write(text + "\n")
    failures = ledger.failures()
    assert not failures, f"{len(failures)} not {ledger.verb}: {failures[:10]}"


def isolated_working_folder() -> Callable[..., Any]:
    """An autouse fixture for a reliability module: W&B offline, and the test's tmp_path as the working folder,
    so any relative output path lands there and never in the checkout."""

    @pytest.fixture(autouse=True)
    def _isolated(monkeypatch, tmp_path):
        monkeypatch.setenv("WANDB_MODE", "offline")
        monkeypatch.chdir(tmp_path)

    return _isolated


def module_figures(ledger: Ledger, module: str, must_stay_zero: tuple[str, ...] = ()) -> Callable[..., Any]:
    """A module-scoped autouse fixture that reports ``ledger``'s figures after the module's tests. Each figure in
    ``must_stay_zero`` (e.g. "bytes lost") is reported even when 0, and fails the module if it is not 0."""

    @pytest.fixture(scope="module", autouse=True)
    def _figures(request):
        ledger.started = time.perf_counter()
        for key in must_stay_zero:
            ledger.extra[key] = 0
        yield
        report(ledger, request, module)
        nonzero = {key: ledger.extra[key] for key in must_stay_zero if ledger.extra[key] != 0}
        assert not nonzero, f"{module}: {nonzero}"

    return _figures
