#!/usr/bin/env python
"""Start-up time of every entry point's ``--help`` and of a config error, beside ``import omegaconf`` and ``import torch``.

Each command runs ``--repeat`` times in a fresh Python (wall time of the whole process, from start to exit); the
table gives the minimum and the median, and the minimum's excess over ``python -c "import omegaconf"`` (what any
command that reads a config pays). On a machine shared with other jobs the minimum is the figure to read: it is
the run that waited least for the cores. The load average before and after is printed with the table.

    python benchmarks/bench_startup.py                       # this checkout, 5 runs per command
    python benchmarks/bench_startup.py --repeat 9 --compare /path/to/an/older/checkout   # before/after columns

``--root`` is the checkout whose ``evaluate.py``, ``train_backbone.py`` and ``lightning_putm`` are timed (put first
on the commands' ``PYTHONPATH``, so an installed copy elsewhere is not what runs); ``--compare`` adds another
checkout's columns, timed in turn with this one's (command by command, repetition by repetition), so both meet the
same load. ``lightning-putm`` is the command ``pip install -e .`` installed, timed only when it is found beside
this Python or on ``PATH``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

def machine() -> str:
    """CPU model and core count (Linux ``/proc/cpuinfo``; ``platform`` elsewhere)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def commands(root: Path, python: str) -> list[tuple[str, list[str]]]:
    """``(label, argv)`` of every command timed: the two imports, the scripts, and each ``python -m lightning_putm``
    command of the checkout's ``COMMANDS`` (read from it, so a newer or older checkout times its own)."""
    listed = subprocess.run([python, "-c", "from lightning_putm.__main__ import COMMANDS; print(*COMMANDS)"],
                            cwd=root, env=environment(root), capture_output=True, text=True, check=True)
    timed = [('python -c "import omegaconf"', [python, "-c", "import omegaconf"]),
             ('python -c "import torch"', [python, "-c", "import torch"]),
             ("python evaluate.py taks=10", [python, "evaluate.py", "taks=10"]),
             ("python evaluate.py --help", [python, "evaluate.py", "--help"]),
             ("python evaluate.py predict --help", [python, "evaluate.py", "predict", "--help"]),
             ("python train_backbone.py --help", [python, "train_backbone.py", "--help"]),
             ("python train_backbone.py taks=1", [python, "train_backbone.py", "taks=1"]),
             ("python -m lightning_putm --help", [python, "-m", "lightning_putm", "--help"])]
    timed += [(f"python -m lightning_putm {name} --help", [python, "-m", "lightning_putm", name, "--help"])
              for name in listed.stdout.split()]
    search = os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")])
    script = shutil.which("lightning-putm", path=search)
    if script is not None:
        timed += [("lightning-putm --help", [script, "--help"]),
                  ("lightning-putm predict --help", [script, "predict", "--help"])]
    return timed


def environment(root: Path) -> dict[str, str]:
    """The commands' environment: the checkout first on the path, W&B offline, a fixed help width."""
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "WANDB_MODE": "offline", "COLUMNS": "100"}


def run_once(argv: list[str], root: Path) -> tuple[float, int]:
    """Wall seconds of one run of ``argv`` in ``root`` (output discarded) and its exit status."""
    start = time.perf_counter()
    status = subprocess.run(argv, cwd=root, env=environment(root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - start, status


def main(argv: list[str] | None = None) -> dict[Path, dict[str, tuple[float, float, int]]]:
    """Print the table; returns ``{checkout: {label: (min, median, exit status)}}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout to time (default: the one this script is in)")
    parser.add_argument("--compare", type=Path, default=None, help="another checkout, timed in turn with --root")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    parser.add_argument("--only", default="", help="time only the commands whose label contains this text "
                                                   "(the two imports are always timed)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    roots = [args.root.resolve()] + ([args.compare.resolve()] if args.compare is not None else [])
    listed = {root: dict(commands(root, args.python)) for root in roots}
    labels = [label for label in listed[roots[0]]
              if label.startswith('python -c "import') or args.only in label]
    seconds: dict[Path, dict[str, list[float]]] = {root: {label: [] for label in labels} for root in roots}
    status: dict[Path, dict[str, int]] = {root: {} for root in roots}
    load_before = os.getloadavg()
    for _ in range(args.repeat):  # repetition by repetition, command by command, checkout after checkout
        for label in labels:
            for root in roots:
                if label in listed[root]:
                    took, status[root][label] = run_once(listed[root][label], root)
                    seconds[root][label].append(took)
    load_after = os.getloadavg()
    summary = {root: {label: (min(times), statistics.median(times), status[root][label])
                      for label, times in seconds[root].items() if times} for root in roots}
    print(f"{datetime.date.today()} | {machine()} | Python {platform.python_version()}, torch {version('torch')}, "
          f"pytorch-lightning {version('pytorch-lightning')} | {args.repeat} runs per command")
    print(f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; after: "
          f"{', '.join(f'{x:.2f}' for x in load_after)}")
    for number, root in enumerate(roots, 1):
        print(f"checkout {number}: {root}")
    print()
    columns = [f"{name} ({number})" for number in range(1, len(roots) + 1)
               for name in ("min (s)", "median (s)", "min − import omegaconf (s)", "exit")]
    print("| command | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for label in labels:
        cells = []
        for root in roots:
            if label not in summary[root]:
                cells += ["—"] * 4
                continue
            fastest, median, code = summary[root][label]
            baseline = summary[root]['python -c "import omegaconf"'][0]
            excess = "—" if label.startswith('python -c "import omegaconf"') else f"{fastest - baseline:+.2f}"
            cells += [f"{fastest:.2f}", f"{median:.2f}", excess, str(code)]
        print(f"| `{label}` | " + " | ".join(cells) + " |")
    return summary


if __name__ == "__main__":
    main()
