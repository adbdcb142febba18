"""Ctrl-C and SIGTERM: never in the middle of a write, and the same clean stop for both.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives. Inside ``torch.save`` it
lands in PyTorch's C++ zip writer, which reports it as ``RuntimeError: unexpected pos ...``: the save fails with a
traceback instead of stopping the run. :func:`signals_deferred` holds SIGINT and SIGTERM back for the length of a
write (the temporary file, its fsync, the rename) and delivers them, to whatever handler was in place, once the
write is complete.

:func:`sigterm_as_interrupt` makes SIGTERM (``kill``, a job scheduler) stop a job like Ctrl-C, with
:class:`Terminated`, a ``KeyboardInterrupt``: the same shutdown, message and exit status (130) instead of the
default of dying on the spot.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

#: The signals a write defers: Ctrl-C and a polite termination request (SIGKILL cannot be deferred or handled).
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would raise ``KeyboardInterrupt``, so the same clean stop runs."""


def _in_main_thread() -> bool:
    # Python runs signal handlers in the main thread only, and only the main thread may install them.
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_recorded(signums: tuple[int, ...] = DEFERRED_SIGNALS) -> Iterator[list[int]]:
    """Within the block ``signums`` are recorded, not acted on: the block gets the list of those received, in order
    of arrival, and the handlers in place before are back after it (the caller decides what a received one means).

    Outside the main thread nothing is recorded (signals interrupt the main thread only). A handler installed
    outside Python (``signal.getsignal`` gives None) cannot be put back, so that signal is left alone.
    """
    received: list[int] = []
    if not _in_main_thread():
        yield received
        return

    def record(signum: int, _frame: Any) -> None:
        received.append(signum)

    previous: dict[int, Any] = {}
    try:
        for signum in signums:
            handler = signal.getsignal(signum)
            if handler is not None:
                previous[signum] = handler
                signal.signal(signum, record)
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...] = DEFERRED_SIGNALS) -> Iterator[None]:
    """Hold ``signums`` back until the block ends, then deliver each one received to the handler in place before
    (:func:`signals_recorded`). A write in another thread needs nothing: signals interrupt the main thread only."""
    received: list[int] = []
    try:
        with signals_recorded(signums) as received:
            yield
    finally:
        for signum in dict.fromkeys(received):  # once each, in order of arrival
            signal.raise_signal(signum)  # the restored handler runs now: KeyboardInterrupt, Lightning's flag, ...


def _raise_terminated(signum: int, _frame: Any) -> None:
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``) like Ctrl-C does.

    Left alone where SIGTERM already has a handler (an embedding application's own) or outside the main thread.
    Lightning's ``Trainer.fit`` keeps this handler and calls it after its own, which only sets a flag.
    """
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
