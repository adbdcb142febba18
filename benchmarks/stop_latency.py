#!/usr/bin/env python
"""Seconds from SIGTERM (or Ctrl-C) to the end of the process, in the middle of the long phases (issue 43).

Each scenario starts its command, waits for the line that says the phase has begun, then ``--delay`` seconds
more, sends the signal and times the process's exit. One markdown table row per scenario.

    python benchmarks/stop_latency.py                                   # putm and fewshot-check (digits demo)
    python benchmarks/stop_latency.py --scenarios extraction --checkpoint path/to/last.ckpt
    python benchmarks/stop_latency.py --signal SIGINT --delay 30

Scenarios:

* ``putm``: ``evaluate.py methods=[putm] shots=[1] alphas=[2] tasks=100`` on the demo features, signalled while
  the 100-task setting is solved (it takes minutes on a CPU);
* ``extraction``: ``evaluate.py checkpoint=<--checkpoint> base_features=null refresh_features=true`` (SimpleShot,
  1 shot, balanced tasks, so that Omniglot's 20 images per class suffice), signalled
  while the backbone extracts the test split's features (pick a checkpoint whose split takes a while: Omniglot's
  test split is 33,840 images);
* ``fewshot-check``: ``train_backbone.py`` on digits with the in-training few-shot check after every epoch
  (``fewshot_eval.every_n_epochs=1``, its defaults: PUTM and SimpleShot, 100 tasks, α 2 and balanced), signalled
  while the check runs.

Every run writes into a temporary folder (``logger=none``). The time includes Lightning's shutdown and the
interpreter's exit; the exit status is 143 (SIGTERM) or 130 (Ctrl-C) for ``evaluate.py`` and 130 for training.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HEADER = ("| scenario | signal | signalled after (s) | signal → last line (s) | signal → exit (s) | exit status | "
          "last line |")
RULE = "|---|---|---|---|---|---|---|"


def scenarios(folder: Path, checkpoint: str | None) -> dict[str, tuple[list[str], str, str | None]]:
    """``{name: (command, the line that starts the phase, the line that ends it or None)}``: a line starting with
    the third before the signal means the phase was over (the measurement is refused)."""
    python = sys.executable
    return {
        "putm": ([python, str(REPO / "evaluate.py"), "methods=[putm]", "shots=[1]", "alphas=[2]", "tasks=100",
                  "logger=none", "plots=false", f"output_dir={folder / 'putm'}"], "features:", "setting 1/1"),
        "extraction": ([python, str(REPO / "evaluate.py"), f"checkpoint={checkpoint}", "base_features=null",
                        "refresh_features=true", f"feature_cache_dir={folder / 'cache'}", "methods=[simpleshot]",
                        "shots=[1]", "alphas=[balanced]", "logger=none", "plots=false",
                        f"output_dir={folder / 'extraction'}"], "features: extracting", "features: "),
        "fewshot-check": ([python, str(REPO / "train_backbone.py"), "stages=[classifier]", "logger=none",
                           "run_test=false", "fewshot_eval.every_n_epochs=1", f"checkpoint_dir={folder / 'train'}",
                           f"log_dir={folder / 'logs'}", "trainer.enable_progress_bar=false"], "features:",
                          "wrote results to"),
    }


def measure(command: list[str], marker: str, end: str | None, signum: int,
            delay: float) -> tuple[float, float, float, int, str]:
    """(seconds until the signal, from the signal to the last line and to the exit, exit status, last line)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    last_at = [0.0]
    begun = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if line.strip():
                last_at[0] = time.perf_counter()
            if line.startswith(marker):
                begun.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not begun.wait(0.5):
        if process.poll() is not None:
            raise SystemExit(f"{command[1]} ended before '{marker}':\n" + "\n".join(lines[-20:]))
    time.sleep(delay)
    begun_at = next(i for i, line in enumerate(lines) if line.startswith(marker))
    over = end is not None and any(line.startswith(end) for line in lines[begun_at + 1:])
    if over or process.poll() is not None or any(line.startswith("error:") for line in lines):
        process.kill()
        raise SystemExit(f"{command[1]} ended before the signal (lower --delay?):\n" + "\n".join(lines[-20:]))
    sent = time.perf_counter()
    process.send_signal(signum)
    code = process.wait()
    ended = time.perf_counter()
    reader.join(timeout=10)
    last = next((line for line in reversed(lines) if line.strip()), "")
    return sent - start, last_at[0] - sent, ended - sent, code, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["putm", "fewshot-check"],
                        choices=["putm", "extraction", "fewshot-check"])
    parser.add_argument("--checkpoint", help="a train_backbone.py checkpoint (extraction scenario)")
    parser.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGINT"])
    parser.add_argument("--delay", type=float, default=20.0, help="seconds after the phase has begun")
    args = parser.parse_args()
    if "extraction" in args.scenarios and not args.checkpoint:
        parser.error("the extraction scenario needs --checkpoint")
    signum = getattr(signal, args.signal)
    print(HEADER)
    print(RULE)
    with tempfile.TemporaryDirectory(prefix="stop_latency_") as tmp:
        commands = scenarios(Path(tmp), args.checkpoint)
        for name in args.scenarios:
            command, marker, end = commands[name]
            before, to_line, to_exit, code, last = measure(command, marker, end, signum, args.delay)
            print(f"| {name} | {args.signal} | {before:.1f} | {to_line:.1f} | {to_exit:.1f} | {code} | `{last[:100]}` |",
                  flush=True)


if __name__ == "__main__":
    main()
