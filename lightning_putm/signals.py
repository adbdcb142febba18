"""Ctrl-C and SIGTERM: never in the middle of a write, and the same clean stop for both.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives. Inside ``torch.save`` it
lands in PyTorch's C++ zip writer, which reports it as ``RuntimeError: unexpected pos ...``: the save fails with a
traceback instead of stopping the run. :func:`signals_deferred` holds SIGINT and SIGTERM back for the length of a
write (the temporary file, its fsync, the rename) and delivers them, to whatever handler was in place, once the
write is complete.

:func:`sigterm_as_interrupt` makes SIGTERM (``kill``, a job scheduler) stop a job like Ctrl-C, with
:class:`Terminated`, a ``KeyboardInterrupt``: the same shutdown, message and exit status (130) instead of the
default of dying on the spot.

A stop must also reach work that the main thread does not do itself, and come between two steps of a long loop
rather than at its end: :func:`stop_on_signals` makes Ctrl-C and SIGTERM *request* a stop, one process-wide flag,
and :func:`check_stop` (one flag read, cheap enough for every step of a solver) raises :class:`StopRequested` in
whichever thread calls it next, PUTM's worker threads included. Where a stop in the middle of a step would leave
a state that cannot be resumed (a training batch half applied), :func:`hold_stops` defers it to the next check.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

#: The signals a write defers: Ctrl-C and a polite termination request (SIGKILL cannot be deferred or handled).
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    """A stop asked for by a signal (``signum``: SIGINT, SIGTERM; ``None``: by the program, e.g. a worker pool whose
    caller stopped), raised where the work stops. A ``KeyboardInterrupt``, so Lightning and the command line treat
    it as Ctrl-C."""

    def __init__(self, signum: int | None = signal.SIGINT) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}" if signum is not None else "stopped")
        self.signum = signum


class Terminated(StopRequested):
    """SIGTERM, raised where Ctrl-C would raise ``KeyboardInterrupt``, so the same clean stop runs."""

    def __init__(self) -> None:
        super().__init__(signal.SIGTERM)


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
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``) like Ctrl-C does.

    Left alone where SIGTERM already has a handler (an embedding application's own) or outside the main thread.
    Lightning's ``Trainer.fit`` keeps this handler and calls it after its own, which only sets a flag. The jobs use
    :func:`stop_on_signals`, which also stops worker threads and long loops.
    """
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ------------------------------------------------------------------------------------------- the cooperative stop
_STOP = threading.Event()  # set: a stop was requested; every check_stop() raises until the outermost block ends
_stop_signal: int | None = None  # what requested it (SIGINT, SIGTERM; None: the program)
_held = False  # see hold_stops
_depth = 0  # nesting of stop_on_signals blocks (main thread only)


def interrupting_signal(exc: BaseException | None) -> int | None:
    """The signal of the :class:`StopRequested` that ``exc`` is, or was raised while handling (Lightning turns a
    ``KeyboardInterrupt`` into ``exit(1)``: the stop is then the exit's context); ``None`` if none."""
    while exc is not None:
        if isinstance(exc, StopRequested):
            return exc.signum
        exc = exc.__context__
    return None


def stop_exception(signum: int | None) -> StopRequested:
    """The exception a stop by ``signum`` raises: :class:`Terminated` for SIGTERM, else :class:`StopRequested`."""
    return Terminated() if signum == signal.SIGTERM else StopRequested(signum)


def request_stop(signum: int | None = signal.SIGINT) -> None:
    """Ask every loop that calls :func:`check_stop`, in any thread, to stop at its next check (the first request's
    signal is the one reported)."""
    global _stop_signal
    if not _STOP.is_set():
        _stop_signal = signum
        _STOP.set()


def stop_requested() -> bool:
    """Whether a stop was requested and not yet cleared."""
    return _STOP.is_set()


def requested_signal() -> int | None:
    """The signal that requested the stop (``None``: none, or the program itself)."""
    return _stop_signal if _STOP.is_set() else None


def check_stop() -> None:
    """Raise :class:`StopRequested` (:class:`Terminated` for SIGTERM) if a stop was requested: long loops call it
    every step, in any thread. Costs one flag read (tens of nanoseconds) when nothing was requested."""
    if _STOP.is_set():
        raise stop_exception(_stop_signal)


def clear_stop() -> None:
    """Forget a stop request (done by the outermost :func:`stop_on_signals` block as it starts and ends)."""
    global _stop_signal
    _STOP.clear()
    _stop_signal = None


def hold_stops(hold: bool) -> bool:
    """While held, a first Ctrl-C or SIGTERM only requests the stop: the main thread goes on to its next
    :func:`check_stop` (pretraining: the end of the training batch, so a checkpoint of that point can be resumed).
    A second signal stops at once. Returns the previous setting."""
    global _held
    previous, _held = _held, bool(hold)
    return previous


def _on_stop_signal(signum: int, _frame: Any) -> None:
    """The handler of :func:`stop_on_signals`: request the stop; unless held, raise it here, in the main thread."""
    again = _STOP.is_set()
    request_stop(signum)
    if _held and not again:
        return
    raise stop_exception(signum)


def _after(previous: Any) -> Any:
    """A SIGTERM handler that runs someone else's handler first (Lightning's flag inside a Trainer call, an
    embedding application's own), then requests the stop without raising: that handler decides what the main
    thread does, and every :func:`check_stop` stops the work."""
    def handler(signum: int, frame: Any) -> None:
        previous(signum, frame)
        request_stop(signum)

    handler.requests_stop = True  # type: ignore[attr-defined]
    return handler


def _ours(handler: Any) -> bool:
    return handler is _on_stop_signal or getattr(handler, "requests_stop", False)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block Ctrl-C and SIGTERM request a stop (:func:`check_stop` raises in every thread from then on)
    and raise :class:`StopRequested` / :class:`Terminated` in the main thread at once, unless :func:`hold_stops`.

    Ctrl-C is taken over only from Python's default handler (an ignored SIGINT, e.g. a job started in the
    background, stays ignored); SIGTERM from the default action; a SIGTERM handler already in place (Lightning's,
    an application's) is kept and called first (:func:`_after`). Nested blocks keep the outer block's handlers.
    Outside the main thread nothing is installed. The request is cleared as the outermost block starts and ends.
    """
    global _depth
    if not _in_main_thread():
        yield
        return
    previous: dict[int, Any] = {}
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    if sigint is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _on_stop_signal)
    if sigterm is signal.SIG_DFL:
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _on_stop_signal)
    elif callable(sigterm) and not _ours(sigterm):
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _after(sigterm))
    if _depth == 0:
        clear_stop()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            clear_stop()
            hold_stops(False)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
