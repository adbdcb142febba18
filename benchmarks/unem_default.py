#!/usr/bin/env python
"""UNEM's default (``learned=auto``) beside its untrained start and the authors' published values, same tasks.

Runs ``evaluate.py`` once per choice of ``method.unem.learned`` (``auto``, ``initial``, ``mini_resnet18``: the
default until 2026-11-28) with the same seed, so all three solve the same episode banks, then prints per (shot, α)
each choice's accuracy ± 95% CI and its paired difference to the untrained start: the mean of the per-task
differences ± 1.96·sd/√T (paired, so much tighter than the CIs of the two means). The table is also written to
``<out>/table.md`` and, one row per (shot, α, choice), to ``<out>/table.csv`` (its ``features`` column is
``--name``, the out folder's name by default); the console lines of the ``auto`` run that say what it fitted, or
why it did not, are printed.

Usage (from the repository root; arguments after ``--`` go to every ``evaluate.py`` run):

    python benchmarks/unem_default.py --out outputs/unem_default/digits -- tasks=1000
    python benchmarks/unem_default.py --out outputs/unem_default/omniglot -- checkpoint=CKPT queries=15 tasks=500

Each run's folder is ``<out>/<choice>``; a finished one is read back (``evaluate.py`` resumes it), so the table can
be printed again at no cost.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from lightning_putm.atomic import atomic_write_text
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.validators import alpha_label

CHOICES = ("auto", "initial", "mini_resnet18")
BASELINE = "initial"


def paired(differences: torch.Tensor) -> tuple[float, float]:
    """Mean and 95% half-width (1.96·sd/√T), in points, of per-task differences of accuracy."""
    values = differences.double()
    spread = float(values.std(unbiased=True)) if values.numel() > 1 else 0.0
    mean = round(100 * float(values.mean()), 2) + 0.0  # + 0.0: no "-0.00"
    return mean, 100 * 1.96 * spread / math.sqrt(max(1, values.numel()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the three runs and table.md")
    parser.add_argument("--name", help="the features' name in table.csv (default: the --out folder's name)")
    parser.add_argument("evaluate", nargs="*", help="evaluate.py arguments (after --)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    results, seconds = {}, {}
    for choice in CHOICES:
        lines: list[str] = []
        started = time.perf_counter()
        results[choice] = run_evaluate([*args.evaluate, "methods=[unem]", f"method.unem.learned={choice}",
                                        f"output_dir={out / choice}", "logger=none", "plots=false", "progress=false"],
                                       log=lines.append)
        seconds[choice] = time.perf_counter() - started
        if choice == "auto":
            for line in lines:
                if line.startswith(("unem:", "notice: unem", "validation features:")):
                    print(line)
    header = ["shots", "alpha", *(f"learned={c}" for c in CHOICES),
              *(f"{c} − {BASELINE} (paired)" for c in CHOICES if c != BASELINE)]
    rows, csv_rows = [], ["features,shots,alpha,tasks,learned,accuracy,ci95,delta_vs_initial,delta_ci95"]
    name = args.name or out.name
    base = {(r.shots, r.alpha_label): r for r in results[BASELINE]}
    for result in results[CHOICES[0]]:
        key = (result.shots, result.alpha_label)
        cells = [str(result.shots), alpha_label(result.alpha)]
        by_choice = {c: next(r for r in results[c] if (r.shots, r.alpha_label) == key) for c in CHOICES}
        for choice in CHOICES:
            summary = by_choice[choice].summary()
            cells.append(f"{summary.accuracy:.2f} ± {summary.ci95:.2f}")
            mean, half = paired(by_choice[choice].accuracies - base[key].accuracies)
            csv_rows.append(f"{name},{result.shots},{alpha_label(result.alpha)},{by_choice[choice].accuracies.numel()},"
                            f"{choice},{summary.accuracy:.2f},{summary.ci95:.2f},{mean:.2f},{half:.2f}")
        for choice in CHOICES:
            if choice != BASELINE:
                mean, half = paired(by_choice[choice].accuracies - base[key].accuracies)
                cells.append(f"{mean:+.2f} ± {half:.2f}")
        rows.append(cells)
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                       *("| " + " | ".join(cells) + " |" for cells in rows)])
    times = ", ".join(f"{c} {seconds[c]:.0f} s" for c in CHOICES)
    print(table)
    print(f"wall time per run (extraction and UNEM's fit included where they ran): {times}")
    atomic_write_text(out / "table.md", table + f"\n\nwall time per run: {times}\n")
    atomic_write_text(out / "table.csv", "\n".join(csv_rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
