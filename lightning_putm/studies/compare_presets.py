"""Does a PUTM preset ever lose to SimpleShot? A table and a figure from finished ``evaluate.py`` runs.

Each feature set is given as ``--set NAME BASE_DIR CANDIDATE_DIR``: two run folders of ``evaluate.py`` on the same
episodes (same features, shots, α, tasks and seed), each holding PUTM, and the candidate's also SimpleShot. For
every (shot, α) the script prints SimpleShot, PUTM with the base preset and with the candidate, the paired
difference candidate − SimpleShot over the same tasks (mean ± 95% CI, from ``per_task.csv``), and the verdict of
the rule "at least as accurate as SimpleShot within SimpleShot's 95% CI". Then, per feature set, the candidate's
mean against the base preset's. The figure draws accuracy against α, one panel per feature set and shot count.
A ``BASE_DIR`` of ``-`` checks a candidate against SimpleShot alone (for a run with more tasks than the base has).

    python evaluate.py features=demo 'shots=[1,5]' 'alphas=[0.5,1,2,3,4,5,6,8,10,balanced]' tasks=200 \\
        'methods=[putm,simpleshot]' output_dir=outputs/recommend/pixels-reference
    python evaluate.py ... method.putm.preset=support_anchored output_dir=outputs/recommend/pixels-recommended
    python -m lightning_putm compare-presets --set "digits pixels" outputs/recommend/pixels-reference \\
        outputs/recommend/pixels-recommended [--set ...] --figure docs/img/recommended_preset.png
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

from lightning_putm.atomic import atomic_savefig

BASELINE = "simpleshot"
NO_BASE = "-"  # as BASE_DIR: no base run (e.g. a 1000-task check of the candidate against SimpleShot only)


def read_results(folder: Path) -> dict[tuple[str, str, str], tuple[float, float]]:
    """``{(method, shots, alpha): (accuracy, ci95)}`` of a run folder's ``results.csv``."""
    path = folder / "results.csv"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; give the output_dir of a finished evaluate.py run")
    with open(path, newline="") as handle:
        return {(r["method"], r["shots"], r["alpha"]): (float(r["accuracy"]), float(r["ci95"]))
                for r in csv.DictReader(handle)}


def paired_gain(folder: Path, method: str, other: str) -> dict[tuple[str, str], tuple[float, float]]:
    """``{(shots, alpha): (mean, ci95)}`` of ``acc(method) − acc(other)`` task by task, in points."""
    by_task: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    with open(folder / "per_task.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            by_task[(row["shots"], row["alpha"], row["task"])][row["method"]] = 100 * float(row["accuracy"])
    diffs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (shots, alpha, _), accs in by_task.items():
        if method in accs and other in accs:
            diffs[(shots, alpha)].append(accs[method] - accs[other])
    out = {}
    for key, values in diffs.items():
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1)
        out[key] = (mean, 1.96 * math.sqrt(var / len(values)))
    return out


def alpha_order(alpha: str) -> float:
    return math.inf if alpha == "balanced" else float(alpha)


def compare(name: str, base_dir: Path, candidate_dir: Path) -> tuple[list[str], dict]:
    """The table of one feature set; a ``base_dir`` of ``-`` compares the candidate with SimpleShot alone."""
    base = {} if str(base_dir) == NO_BASE else read_results(base_dir)
    candidate = read_results(candidate_dir)
    gains = paired_gain(candidate_dir, "putm", BASELINE)
    settings = sorted({(s, a) for (m, s, a) in candidate if m == "putm"}, key=lambda k: (int(k[0]), alpha_order(k[1])))
    lines = [f"## {name}", "", f"base: `{base_dir}`; candidate: `{candidate_dir}`", "",
             "| shots | α | SimpleShot | PUTM base | PUTM candidate | candidate − SimpleShot (paired) | ≥ SimpleShot − CI |",
             "|---|---|---|---|---|---|---|"]
    base_accs, cand_accs, failures = [], [], []
    for shots, alpha in settings:
        ss = candidate.get((BASELINE, shots, alpha)) or base.get((BASELINE, shots, alpha))
        ref = base.get(("putm", shots, alpha))
        new = candidate[("putm", shots, alpha)]
        gain = gains.get((shots, alpha))
        ok = ss is None or new[0] >= ss[0] - ss[1]
        if not ok:
            failures.append(f"{shots}-shot α={alpha}")
        if ref is not None:
            base_accs.append(ref[0])
            cand_accs.append(new[0])
        fmt = (lambda v: "—" if v is None else f"{v[0]:.2f} ± {v[1]:.2f}")
        lines.append(f"| {shots} | {alpha} | {fmt(ss)} | {fmt(ref)} | **{new[0]:.2f}** ± {new[1]:.2f} | "
                     f"{'—' if gain is None else f'{gain[0]:+.2f} ± {gain[1]:.2f}'} | {'yes' if ok else '**no**'} |")
    summary = {"name": name, "failures": failures, "settings": settings, "base": base, "candidate": candidate}
    if base_accs:
        mb, mc = sum(base_accs) / len(base_accs), sum(cand_accs) / len(cand_accs)
        summary["means"] = (mb, mc)
        lines += ["", f"Mean over the {len(base_accs)} settings: base {mb:.2f}, candidate {mc:.2f} "
                      f"({mc - mb:+.2f} points)."]
    lines += ["", f"Below SimpleShot beyond its CI: {', '.join(failures) if failures else 'none'}."]
    return lines, summary


def compact(summary: dict) -> list[str]:
    """One row per α, SimpleShot / base / candidate per shot count; ✗ marks a candidate below SimpleShot − CI."""
    shots_values = sorted({s for s, _ in summary["settings"]}, key=int)
    alphas = sorted({a for _, a in summary["settings"]}, key=alpha_order)
    head = "| α | " + " | ".join(f"{k}-shot SimpleShot | {k}-shot base | {k}-shot candidate" for k in shots_values) + " |"
    lines = [f"### {summary['name']}", "", head, "|---" * (1 + 3 * len(shots_values)) + "|"]
    for alpha in alphas:
        cells = []
        for shots in shots_values:
            ss = summary["candidate"].get((BASELINE, shots, alpha)) or summary["base"].get((BASELINE, shots, alpha))
            ref = summary["base"].get(("putm", shots, alpha))
            new = summary["candidate"].get(("putm", shots, alpha))
            fail = f"{shots}-shot α={alpha}" in summary["failures"]
            cells += ["—" if ss is None else f"{ss[0]:.2f} ± {ss[1]:.2f}", "—" if ref is None else f"{ref[0]:.2f}",
                      "—" if new is None else f"**{new[0]:.2f}**" + (" ✗" if fail else "")]
        lines.append(f"| {alpha} | " + " | ".join(cells) + " |")
    if "means" in summary:
        base_mean, cand_mean = summary["means"]
        lines += ["", f"Mean over the settings: base {base_mean:.2f}, candidate {cand_mean:.2f} "
                      f"({cand_mean - base_mean:+.2f} points)."]
    return lines


def figure(summaries: list[dict], path: Path, base_label: str = "PUTM reference",
           candidate_label: str = "PUTM support_anchored") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shots_values = sorted({s for summary in summaries for s, _ in summary["settings"]}, key=int)
    fig, axes = plt.subplots(len(shots_values), len(summaries), figsize=(4.2 * len(summaries), 3.2 * len(shots_values)),
                             squeeze=False)
    for col, summary in enumerate(summaries):
        for row, shots in enumerate(shots_values):
            ax = axes[row][col]
            alphas = [a for s, a in summary["settings"] if s == shots]
            xs = range(len(alphas))
            for label, source, method, style in (("SimpleShot", "candidate", BASELINE, "k--"),
                                                 (base_label, "base", "putm", "C0-"),
                                                 (candidate_label, "candidate", "putm", "C3-")):
                values = [summary[source].get((method, shots, a)) or (  # SimpleShot may be in the base run only
                    summary["base"].get((method, shots, a)) if method == BASELINE else None) for a in alphas]
                if any(v is None for v in values):
                    continue
                acc = [v[0] for v in values]
                ci = [v[1] for v in values]
                ax.plot(xs, acc, style, marker="o", ms=3, label=label)
                ax.fill_between(xs, [a - c for a, c in zip(acc, ci)], [a + c for a, c in zip(acc, ci)],
                                color=style[:2] if style[0] == "C" else "0.5", alpha=0.15)
            ax.set_xticks(list(xs), [a if a != "balanced" else "bal." for a in alphas], fontsize=8)
            ax.set_title(f"{summary['name']}, {shots}-shot", fontsize=10)
            ax.set_xlabel("Dirichlet α")
            if col == 0:
                ax.set_ylabel("accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=150)
    print(f"wrote {path}")


def main(argv: list[str] | None = None, prog: str | None = None) -> list[dict]:
    """Print the tables (and draw the figure) of ``argv``; returns the summaries."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", nargs=3, action="append", required=True, metavar=("NAME", "BASE_DIR", "CANDIDATE_DIR"),
                        help=f"a feature set: its name, the base preset's run ({NO_BASE!r}: none) and the candidate's")
    parser.add_argument("--figure", type=Path, help="write the accuracy-vs-α figure here (PNG)")
    parser.add_argument("--compact", action="store_true", help="one row per α (for docs) instead of per setting")
    parser.add_argument("--base-label", default="PUTM reference")
    parser.add_argument("--candidate-label", default="PUTM support_anchored")
    args = parser.parse_args(argv)
    summaries = []
    for name, base_dir, candidate_dir in args.set:
        lines, summary = compare(name, Path(base_dir), Path(candidate_dir))
        print("\n".join(compact(summary) if args.compact else lines) + "\n")
        summaries.append(summary)
    if args.figure:
        figure(summaries, args.figure, args.base_label, args.candidate_label)
    return summaries

