"""One summary of a study (a sweep run by :mod:`lightning_putm.jobs.study`): a table and a figure.

``summary.csv`` has one row per finished point (its swept values, the metric, every setting's accuracy and the run
folder); ``summary.md`` is the same table sorted by the metric, best first; ``summary.pdf``/``summary.png`` draw
the metric against each swept parameter: for every value the mean over the other parameters' values, with a bar
from their worst to their best and the best point marked, as in the sensitivity figures of few-shot papers.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from lightning_putm.evaluation.report import write_csv


@dataclass
class StudyRow:
    """One finished point of a study."""

    point: dict[str, Any]
    metric: float
    key: str
    output_dir: str = ""
    settings: list[dict[str, Any]] = field(default_factory=list)  # {method, shots, alpha, accuracy, ci95}


def summary_rows(rows: Sequence[StudyRow], metric: str) -> list[dict[str, Any]]:
    """CSV rows: swept values, the metric, then ``<method>/<k>shot/alpha_<a>`` accuracy ± CI, then the run folder."""
    out = []
    for row in rows:
        record: dict[str, Any] = {**{k: _text(v) for k, v in row.point.items()}, metric: f"{row.metric:.4f}"}
        for s in row.settings:
            record[f"{s['method']}/{s['shots']}shot/alpha_{s['alpha']}"] = f"{s['accuracy']:.2f} ± {s['ci95']:.2f}"
        record["output_dir"] = row.output_dir
        out.append(record)
    return out


def markdown_table(rows: Sequence[StudyRow], metric: str, goal: str, swept: Sequence[str]) -> str:
    """The finished points as a markdown table, best first."""
    ordered = sorted(rows, key=lambda r: r.metric, reverse=goal == "maximize")
    header = [*swept, metric]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in ordered:
        lines.append("| " + " | ".join([*(_text(row.point.get(k)) for k in swept), f"{row.metric:.2f}"]) + " |")
    return "\n".join(lines) + "\n"


def write_study_summary(rows: Sequence[StudyRow], metric: str, goal: str, swept: Sequence[str], folder: Path,
                        title: str) -> dict[str, Path]:
    """``summary.csv``, ``summary.md`` and the figure (PDF + 300-DPI PNG) in ``folder``, each written atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    records = summary_rows(rows, metric)
    columns = list(dict.fromkeys(k for r in records for k in r))
    paths = {"csv": write_csv(folder / "summary.csv", records, columns or [*swept, metric])}
    text = f"# Study {title}\n\n{len(rows)} finished run(s); metric `{metric}` ({goal}).\n\n"
    text += markdown_table(rows, metric, goal, swept) if rows else "No run has finished yet.\n"
    paths["markdown"] = _write_text(folder / "summary.md", text)
    if rows:
        paths.update(plot_study(rows, metric, goal, swept, folder, title))
    return paths


def plot_study(rows: Sequence[StudyRow], metric: str, goal: str, swept: Sequence[str], folder: Path,
               title: str) -> dict[str, Path]:
    """Metric against each swept parameter (mean over the other parameters, worst–best bar, best point marked)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    best = (max if goal == "maximize" else min)(rows, key=lambda r: r.metric)
    with plt.rc_context({"font.size": 8, "axes.spines.top": False, "axes.spines.right": False,
                         "savefig.bbox": "tight", "pdf.fonttype": 42}):
        fig, axes = plt.subplots(1, len(swept), figsize=(2.4 * len(swept) + 0.4, 2.2), squeeze=False)
        for ax, name in zip(axes[0], swept):
            groups: dict[str, list[float]] = defaultdict(list)
            for row in rows:
                groups[_text(row.point.get(name))].append(row.metric)
            labels = _ordered(groups)
            means = [sum(groups[k]) / len(groups[k]) for k in labels]
            low = [m - min(groups[k]) for m, k in zip(means, labels)]
            high = [max(groups[k]) - m for m, k in zip(means, labels)]
            x = list(range(len(labels)))
            ax.errorbar(x, means, yerr=[low, high], fmt="o-", color="#0072B2", ms=4, lw=1.2, capsize=2.5,
                        label="mean (bar: worst–best)")
            if _text(best.point.get(name)) in labels:
                ax.plot(labels.index(_text(best.point.get(name))), best.metric, marker="*", ms=9, color="#D55E00",
                        ls="none", label="best run")
            ax.set_xticks(x, labels, rotation=30 if max(len(s) for s in labels) > 4 else 0)
            ax.set_xlabel(name.split(".")[-1])
            ax.grid(axis="y", alpha=0.3, lw=0.5)
        axes[0][0].set_ylabel(metric.replace("fewshot/", "").replace("/acc", " accuracy (%)"))
        axes[0][0].legend(frameon=False, fontsize=7, loc="best")
        fig.suptitle(f"{title} ({len(rows)} runs)", fontsize=9)
        paths = {}
        for suffix, options in (("pdf", {}), ("png", {"dpi": 300})):
            target = folder / f"summary.{suffix}"
            tmp = target.with_name(f".{target.stem}.tmp.{suffix}")
            fig.savefig(tmp, **options)
            os.replace(tmp, target)
            paths[f"figure_{suffix}"] = target
        plt.close(fig)
    return paths


def _ordered(groups: dict[str, list[float]]) -> list[str]:
    """Numbers in numeric order, then the rest (e.g. ``balanced``) in their order of appearance."""
    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None
    numeric = sorted((k for k in groups if number(k) is not None), key=lambda k: number(k))
    return numeric + [k for k in groups if number(k) is None]


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _write_text(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
