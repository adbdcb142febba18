"""A deterministic Ctrl-C: run ``evaluate.py`` or ``python -m lightning_putm study`` and send SIGINT to this very
process right after the N-th finished setting is saved.

    python tests/helpers/ctrl_c.py evaluate [key=value ...]
    python tests/helpers/ctrl_c.py study SWEEP.yaml [...]

``CTRL_C_AFTER_SETTINGS=N`` sets N (unset or 0: no signal, so the same helper runs the resume). The signal goes
through the real handler (Python's, Lightning's and ours), exactly as a Ctrl-C in a terminal would, at a point
that depends on nothing but the order of the work. The parent must start this process with SIGINT at its default
disposition (a backgrounded shell hands it down ignored).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AFTER = "CTRL_C_AFTER_SETTINGS"


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


def main(argv: list[str]) -> int:
    if int(os.environ.get(AFTER, "0") or 0) > 0:
        interrupt_after(int(os.environ[AFTER]))
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
