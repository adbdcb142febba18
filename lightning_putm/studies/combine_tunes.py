"""One selection from several ``tune`` runs of the same sweep on different validation feature sets.

``python -m lightning_putm tune`` selects on one checkpoint's validation classes. A setting meant to hold on strong
and weak features alike is selected on each, and this command joins them: for every point of the sweep it takes the
worst of its validation metrics (``min`` when the sweep maximises, ``max`` when it minimises), then picks the best
point by that, with ties (within 0.005, as ``tune``) broken by ``--prefer KEY=max|min``.

    python -m lightning_putm tune conf/sweep/study_recommend.yaml checkpoint=A.ckpt --dir outputs/tune/a
    python -m lightning_putm tune conf/sweep/study_recommend.yaml checkpoint=B.ckpt --dir outputs/tune/b
    python -m lightning_putm combine-tunes outputs/tune/a outputs/tune/b --prefer method.putm.support_weight=max
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


class Row:
    def __init__(self, point: dict[str, str], metric: float) -> None:
        self.point, self.metric = point, metric


def read_summary(folder: Path) -> tuple[str, list[str], dict[tuple, float]]:
    """``(metric name, swept keys, {point values: metric})`` of a tune or study folder's ``summary.csv``."""
    path = folder / "summary.csv"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; give the --dir of a finished tune run")
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        columns = reader.fieldnames or []
        metric = next(c for c in columns if c.startswith("fewshot/"))
        keys = columns[: columns.index(metric)]
        return metric, keys, {tuple(r[k] for k in keys): float(r[metric]) for r in reader}


def combine(folders: list[Path], goal: str = "maximize", prefer: tuple[str, str] | None = None
            ) -> tuple[list[str], Row, list[Row]]:
    summaries = [read_summary(f) for f in folders]
    metric, keys, _ = summaries[0]
    for other_metric, other_keys, _ in summaries[1:]:
        if (other_metric, other_keys) != (metric, keys):
            raise SystemExit("the tune runs differ in metric or swept keys; combine runs of the same sweep")
    points = sorted(set.intersection(*(set(s[2]) for s in summaries)),
                    key=lambda p: tuple(float(v) for v in p))
    worst = min if goal == "maximize" else max
    rows = [Row(dict(zip(keys, p)), worst(s[2][p] for s in summaries)) for p in points]
    from lightning_putm.studies.tune import select_best  # the tune wing imports the evaluation: not for --help

    best, tied = select_best(rows, goal, prefer)
    lines = [f"metric `{metric}`, worst over {len(folders)} validation sets", "",
             "| " + " | ".join(keys) + " | " + " | ".join(f"`{f}`" for f in folders) + " | worst |",
             "|---" * (len(keys) + len(folders) + 1) + "|"]
    for point, row in zip(points, rows):
        mark = " (selected)" if row is best else (" (tie)" if row in tied else "")
        lines.append("| " + " | ".join(point) + " | " + " | ".join(f"{s[2][point]:+.2f}" for s in summaries)
                     + f" | **{row.metric:+.2f}**{mark} |")
    return lines, best, tied


def main(argv: list[str] | None = None, prog: str | None = None) -> Row:
    """Print the joined table and the selected point of ``argv``'s tune folders; returns that point."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--goal", choices=["maximize", "minimize"], default="maximize")
    parser.add_argument("--prefer", help="KEY=max|min: which tied point to take")
    args = parser.parse_args(argv)
    prefer = None
    if args.prefer:
        key, _, direction = args.prefer.rpartition("=")
        if direction not in ("max", "min"):
            raise SystemExit(f"--prefer takes KEY=max or KEY=min, got {args.prefer!r}")
        prefer = (key, direction)
    lines, best, tied = combine(args.folders, args.goal, prefer)
    print("\n".join(lines))
    print(f"\nselected: {best.point} (worst validation metric {best.metric:+.2f}; {len(tied)} tied)")
    return best

