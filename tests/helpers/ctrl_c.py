"""A deterministic Ctrl-C: run ``evaluate.py`` or ``python -m lightning_putm study`` and send SIGINT to this very
process right after the N-th finished setting is saved.

    python tests/helpers/ctrl_c.py evaluate [key=value ...]
    python tests/helpers/ctrl_c.py study SWEEP.yaml [...]

``CTRL_C_AFTER_SETTINGS=N`` sets N (unset or 0: no signal, so the same helper runs the resume). The signal goes
through the real handler (Python's, Lightning's and ours), exactly as a Ctrl-C in a terminal would, at a point
that depends on nothing but the order of the work. The parent must start this process with SIGINT at its default
disposition (a backgrounded shell hands it down ignored).

Two more points, in the middle of the work (``SIGNAL_NAME=SIGTERM`` sends SIGTERM instead of SIGINT):

* ``SIGNAL_AFTER_E_STEPS=K``: right after PUTM's K-th finished E-step (counted over every worker thread, fused
  engine); the thread that sent it waits until the stop is requested, then goes on as if nothing happened.
* ``SIGNAL_AT_EXTRACTION_BATCH=B``: at the start of the B-th batch (from 0) of feature extraction
  (``BackboneFeatures.test_step``).

At exit the helper prints to stderr how much work was done after the stop was requested:
``after the signal: E E-steps finished, B extraction batches begun`` — what "stopped within one step" means.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AFTER = "CTRL_C_AFTER_SETTINGS"
AFTER_E_STEPS = "SIGNAL_AFTER_E_STEPS"
AT_EXTRACTION_BATCH = "SIGNAL_AT_EXTRACTION_BATCH"
SIGNAL_NAME = "SIGNAL_NAME"


def interrupt_after(settings: int) -> None:
    """Make the ``settings``-th :meth:`SettingStore.save` of this process end with a SIGINT to itself."""
    from lightning_putm.evaluation.store import SettingStore

    original, saved = SettingStore.save, [0]

    def save(self, *args, **kwargs):
        path = original(self, *args, **kwargs)
        saved[0] += 1
        if saved[0] == settings:
            os.kill(os.getpid(), signal.SIGINT)  # Python raises KeyboardInterrupt here, in the main thread
        return path

    SettingStore.save = save


class AfterTheSignal:
    """Work done after the stop was requested, printed at exit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.e_steps = 0
        self.batches = 0
        atexit.register(self.report)

    def report(self) -> None:
        print(f"after the signal: {self.e_steps} E-steps finished, {self.batches} extraction batches begun",
              file=sys.stderr, flush=True)


def send_and_wait(signum: int) -> None:
    """The signal to this process; returns once its handler has requested the stop (the main thread runs it)."""
    from lightning_putm.signals import stop_requested

    os.kill(os.getpid(), signum)
    deadline = time.monotonic() + 60
    while not stop_requested() and time.monotonic() < deadline:
        time.sleep(0.001)


def signal_after_e_steps(count: int, signum: int, after: AfterTheSignal) -> None:
    """Send ``signum`` right after the ``count``-th finished E-step of PUTM's fused engine, in any thread."""
    from lightning_putm.methods.putm.engines import FusedEngine
    from lightning_putm.signals import stop_requested

    original, finished = FusedEngine.run, [0]

    def run(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        with after.lock:
            if stop_requested():
                after.e_steps += 1
            finished[0] += 1
            send = finished[0] == count
        if send:
            send_and_wait(signum)
        return result

    FusedEngine.run = run


def signal_at_extraction_batch(index: int, signum: int, after: AfterTheSignal) -> None:
    """Send ``signum`` as feature extraction begins its ``index``-th batch."""
    from lightning_putm.features.extraction import BackboneFeatures
    from lightning_putm.signals import stop_requested

    original = BackboneFeatures.test_step

    def test_step(self, batch, batch_idx):
        if stop_requested():
            after.batches += 1
        if batch_idx == index:
            os.kill(os.getpid(), signum)  # the handler runs in this (main) thread, at the next line
        return original(self, batch, batch_idx)

    BackboneFeatures.test_step = test_step


def main(argv: list[str]) -> int:
    if int(os.environ.get(AFTER, "0") or 0) > 0:
        interrupt_after(int(os.environ[AFTER]))
    signum = getattr(signal, os.environ.get(SIGNAL_NAME) or "SIGINT")
    if os.environ.get(AFTER_E_STEPS) or os.environ.get(AT_EXTRACTION_BATCH):
        after = AfterTheSignal()
        if os.environ.get(AFTER_E_STEPS):
            signal_after_e_steps(int(os.environ[AFTER_E_STEPS]), signum, after)
        if os.environ.get(AT_EXTRACTION_BATCH):
            signal_at_extraction_batch(int(os.environ[AT_EXTRACTION_BATCH]), signum, after)
    job, args = argv[0], argv[1:]
    if job == "evaluate":
        spec = importlib.util.spec_from_file_location("_evaluate_script", REPO / "evaluate.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        return script.cli(args)
    if job == "study":
        from lightning_putm.__main__ import main as package_main

        return package_main(["study", *args])
    raise SystemExit(f"unknown job {job!r}: evaluate or study")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
