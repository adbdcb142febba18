"""PUTM's sensitivity to β, ρ and the inertia, one value changed at a time: a table and a figure (the paper's
sensitivity study) from finished ``evaluate.py`` runs.

Each feature set is a folder of run folders (``--set NAME FOLDER``): one named ``reference`` (``--reference``)
and others that each change one PUTM hyper-parameter from it. Which one, and to what, is read from each run's
``config.yaml``, resolved per shot count as PUTM resolves it (``rho``/``inertia`` of ``null`` take the reference
code's value for the setting), so a run of ``method.putm.inertia=0.1`` counts as a change at 1 shot and as the
reference at 5 shots (where 0.1 is the default). A run that changes several values at once is refused. All runs
of a set must draw the same episodes (same features, tasks and seed): each value is also reported as its paired
difference from the reference over the same tasks (``per_task.csv``), whose CI is far narrower than the runs' own.

    for v in 0.4 0.5 0.7 0.8; do python evaluate.py features=demo tasks=100 'shots=[1,5]' 'alphas=[2]' \\
        'methods=[putm,simpleshot]' method.putm.beta=$v output_dir=outputs/studies/sensitivity-pixels/beta$v; done
    ...   # rho, inertia; and the same command without an override -> outputs/studies/sensitivity-pixels/reference
    python -m lightning_putm sensitivity-figure --set "digits pixels" outputs/studies/sensitivity-pixels \\
        --figure docs/img/study_sensitivity.png
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

from lightning_putm.atomic import atomic_savefig
from lightning_putm.studies.compare_presets import read_results

PARAMETERS = ("beta", "rho", "inertia")
LABELS = {"beta": "β (power transform)", "rho": "ρ (CT balance)", "inertia": "inertia a"}

Setting = tuple[str, str]  # (shots, alpha) as results.csv writes them


def read_tasks(folder: Path, method: str = "putm") -> dict[tuple[str, str, str], tuple[float, tuple]]:
    """``{(shots, alpha, task): (accuracy in points, the episode's classes and query counts)}`` of ``method`` in
    a run folder's ``per_task.csv``."""
    path = folder / "per_task.csv"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; give folders of finished evaluate.py runs")
    with open(path, newline="") as handle:
        return {(r["shots"], r["alpha"], r["task"]): (100 * float(r["accuracy"]),
                                                       (r.get("class_ids"), r.get("query_counts")))
                for r in csv.DictReader(handle) if r["method"] == method}


def paired_difference(run: dict, reference: dict, setting: Setting, name: str = "run") -> tuple[float, float]:
    """Mean and 95% CI of ``run − reference`` over the tasks both solved in ``setting`` (the same episodes)."""
    keys = [key for key in run if key[:2] == setting and key in reference]
    if not keys:
        raise SystemExit(f"{name}: no tasks in common with the reference in setting {setting}; "
                         "make every run of a set with the same tasks and seed")
    if any(run[key][1] != reference[key][1] for key in keys):
        raise SystemExit(f"{name}: its episodes differ from the reference's (classes or query counts) in setting "
                         f"{setting}; make every run of a set with the same features, tasks and seed")
    diffs = [run[key][0] - reference[key][0] for key in keys]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / max(1, len(diffs) - 1)
    return mean, 1.96 * math.sqrt(var / len(diffs))


def resolved_values(folder: Path, shots: int) -> dict[str, float]:
    """β, ρ and the inertia PUTM ran with at ``shots`` on Dirichlet tasks, from the run's ``config.yaml``."""
    from omegaconf import OmegaConf

    from lightning_putm.methods import build_method

    path = folder / "config.yaml"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; give folders of finished evaluate.py runs")
    params = OmegaConf.to_container(OmegaConf.load(path).method.putm, resolve=True)
    params.pop("preset", None)
    settings = build_method("putm", params, shots=shots, balanced=False).settings
    return {name: float(getattr(settings, name)) for name in PARAMETERS}


def changes(reference: Path, run: Path, shots: int) -> list[tuple[str, float]]:
    """``[(parameter, value)]`` where ``run`` differs from ``reference`` at ``shots``."""
    base, other = resolved_values(reference, shots), resolved_values(run, shots)
    return [(name, other[name]) for name in PARAMETERS if not math.isclose(base[name], other[name])]


def collect(folder: Path, reference_name: str = "reference") -> tuple[dict, dict, dict]:
    """``(reference values per shot, {setting: {method: (acc, ci)}} of the reference,
    {(parameter, setting): [(value, PUTM accuracy, paired Δ, its CI)]} of the other runs)``, sorted by value;
    Δ is the run's accuracy minus the reference's, task by task on the same episodes."""
    reference = folder / reference_name
    if not reference.is_dir():
        raise SystemExit(f"{reference}: not found; the set folder needs a run named {reference_name!r} "
                         f"(or pass --reference NAME)")
    base_results = read_results(reference)
    settings = sorted({(s, a) for m, s, a in base_results if m == "putm"}, key=lambda k: (int(k[0]), k[1]))
    base = {s: {m: base_results[(m, *s)] for m in ("putm", "simpleshot") if (m, *s) in base_results}
            for s in settings}
    defaults = {shots: resolved_values(reference, int(shots)) for shots, _ in settings}
    base_tasks = read_tasks(reference)
    curves: dict[tuple[str, Setting], list[tuple[float, float, float, float]]] = defaultdict(list)
    for run in sorted(p for p in folder.iterdir() if p.is_dir() and p.name != reference_name):
        if not (run / "results.csv").is_file():
            print(f"warning: {run} has no results.csv (not finished?); left out", file=sys.stderr)
            continue
        results, tasks = read_results(run), read_tasks(run)
        for setting in settings:
            changed = changes(reference, run, int(setting[0]))
            if len(changed) > 1:
                raise SystemExit(f"{run}: changes {', '.join(n for n, _ in changed)} at once; a sensitivity run "
                                 "changes one of β, ρ, inertia from the reference")
            if changed and ("putm", *setting) in results:
                name, value = changed[0]
                curves[(name, setting)].append((value, results[("putm", *setting)][0],
                                                *paired_difference(tasks, base_tasks, setting, str(run))))
    for (name, setting), points in curves.items():
        points.append((defaults[setting[0]][name], base[setting]["putm"][0], 0.0, 0.0))
        points.sort()
    return defaults, base, dict(curves)


def markdown(name: str, defaults: dict, base: dict, curves: dict) -> str:
    """One table per feature set: a row per changed value, a column per setting (accuracy, then the paired
    difference from the reference ± its 95% CI), the reference in bold."""
    settings = list(base)
    head = [f"{s}-shot α={a}" for s, a in settings]
    lines = [f"#### {name}", "", "| value | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    ref = [f"**{base[s]['putm'][0]:.2f} ± {base[s]['putm'][1]:.2f}**" for s in settings]
    shown = ", ".join(f"{p} " + " / ".join(dict.fromkeys(f"{defaults[s[0]][p]:g}" for s in settings))
                      for p in PARAMETERS)
    lines.append(f"| `reference` ({shown}) | " + " | ".join(ref) + " |")
    for parameter in PARAMETERS:
        values = sorted({pt[0] for (p, s), pts in curves.items() if p == parameter for pt in pts})
        for value in values:
            if all(math.isclose(value, defaults[s[0]][parameter]) for s in settings):
                continue  # the reference row
            cells = []
            for s in settings:
                if math.isclose(value, defaults[s[0]][parameter]):
                    cells.append("(reference)")
                    continue
                hit = [p for p in curves.get((parameter, s), []) if math.isclose(p[0], value)]
                cells.append(f"{hit[0][1]:.2f} ({hit[0][2]:+.2f} ± {hit[0][3]:.2f})" if hit else "–")
            lines.append(f"| {parameter} {value:g} | " + " | ".join(cells) + " |")
    if all("simpleshot" in base[s] for s in settings):
        lines.append("| SimpleShot | " + " | ".join(
            f"{base[s]['simpleshot'][0]:.2f} ± {base[s]['simpleshot'][1]:.2f}" for s in settings) + " |")
    return "\n".join(lines) + "\n"


def draw(sets: list[tuple[str, dict, dict, dict]], path: Path) -> None:
    """A panel per (setting, parameter): PUTM's accuracy minus the reference's on the same tasks (bars: 95% CI),
    one line per feature set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({s for _, _, base, _ in sets for s in base}, key=lambda k: (int(k[0]), k[1]))
    fig, axes = plt.subplots(len(settings), len(PARAMETERS), figsize=(4 * len(PARAMETERS), 3 * len(settings)),
                             squeeze=False, sharey="row")
    for row, setting in enumerate(settings):
        for col, parameter in enumerate(PARAMETERS):
            ax = axes[row][col]
            for name, defaults, base, curves in sets:
                points = curves.get((parameter, setting))
                if not points or setting not in base:
                    continue
                line = ax.errorbar([p[0] for p in points], [p[2] for p in points], yerr=[p[3] for p in points],
                                   marker="o", capsize=3, label=name).lines[0]
                ax.plot([defaults[setting[0]][parameter]], [0.0], marker="*", markersize=12,
                        color=line.get_color())
            ax.axhline(0.0, color="grey", linewidth=0.8)
            ax.set_xlabel(LABELS[parameter])
            if col == 0:
                ax.set_ylabel(f"{setting[0]}-shot α={setting[1]}: Δ vs reference (points)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("PUTM against one hyper-parameter at a time (★ the reference value)")
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=150, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)


def main(argv: list[str] | None = None, prog: str | None = None) -> str:
    """Print the tables (and draw the figure) of ``argv``'s sets; returns the tables' text."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", nargs=2, action="append", required=True, metavar=("NAME", "FOLDER"))
    parser.add_argument("--reference", default="reference", help="the run folder every other run changes from")
    parser.add_argument("--figure", type=Path, help="write the figure here (PNG or PDF)")
    args = parser.parse_args(argv)
    sets = [(name, *collect(Path(folder), args.reference)) for name, folder in args.set]
    text = "\n".join(markdown(*entry) for entry in sets)
    print(text)
    if args.figure:
        draw(sets, args.figure)
        print(f"figure: {args.figure}")
    return text

