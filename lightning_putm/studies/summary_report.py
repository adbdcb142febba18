"""The study summary written: ``summary.csv``, ``summary.md`` and the figure (the metric per swept value with
95% CIs and the SimpleShot baseline)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from lightning_putm.atomic import atomic_savefig, atomic_write_text
from lightning_putm.evaluation.report import write_csv
from lightning_putm.studies.summary import (BASELINE_NAME, StudyRow, best_setting, cell_text, ci_column,
                                            conditions_swept, margin_over_baseline, markdown_table, mean_ci_or_none,
                                            mean_or_none, other_methods, parameter_label, range_text, row_tasks,
                                            summary_notes, summary_rows)

#: Legend order of the summary figure's entries (labels are built from the metric's method; see study_figure).
METRIC_GID, BASELINE_GID, RANGE_GID, BEST_GID = "metric", "baseline", "range", "best"
#: gid prefix of the other methods' lines (``method-<name>``).
METHOD_GID = "method"


def study_figure(rows: Sequence[StudyRow], metric: str, goal: str, swept: Sequence[str], title: str,
                 parts: Mapping[str, str | None] | None = None):
    """Build (without saving) the summary figure: one panel per swept parameter (named in words), the metric ±
    95% CI per value, every other method that ran (not for a margin: its axis is in margin points), SimpleShot as
    a dashed line with its CI band, the best setting starred (:func:`~lightning_putm.studies.summary.best_setting`:
    none when only test conditions are swept, and only on the hyper-parameters' panels); one legend of exactly
    what is drawn.

    Every drawn artist that the legend names carries a gid (:data:`METRIC_GID`, ...), so tests can match the
    legend against what was drawn.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from lightning_putm.evaluation.plot_style import paper_style

    best = best_setting(rows, goal, swept)
    best_label = "best run" if not conditions_swept(swept) else \
        f"best setting (mean over {', '.join(parameter_label(k) for k in conditions_swept(swept))})"
    name = _metric_name(metric, parts)
    margin = parts is not None and margin_over_baseline(parts)
    others = [] if parts is None or parts.get("gainer") else other_methods(rows, parts)
    styles = _method_styles(others)
    entries: dict[str, Any] = {}  # legend label -> handle, first drawn first
    with paper_style():
        figure = Figure(figsize=(max(2.4 * len(swept) + 0.4, 3.4), 2.7), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(1, len(swept), squeeze=False)[0]
        for ax, parameter in zip(axes, swept):
            groups: dict[str, list[StudyRow]] = defaultdict(list)
            for row in rows:
                groups[cell_text(row.point.get(parameter))].append(row)
            labels = _ordered(groups)
            x = list(range(len(labels)))
            means = [mean_or_none([r.metric for r in groups[k]]) for k in labels]
            cis = [mean_ci_or_none([r.ci95 for r in groups[k]]) for k in labels]
            if all(c is not None for c in cis):
                label = f"{name} ± 95% CI"
                handle = ax.errorbar(x, means, yerr=cis, fmt="o-", color="#0072B2", ms=3.5, lw=1.1, capsize=2.5,
                                     elinewidth=0.8, zorder=3, label=label)
                handle.lines[0].set_gid(METRIC_GID)
            else:  # some runs have no per-setting records: no bar rather than a bar of unknown meaning
                label = f"{name} (no CI: runs without per-setting records)"
                (handle,) = ax.plot(x, means, "o-", color="#0072B2", ms=3.5, lw=1.1, zorder=3, label=label,
                                    gid=METRIC_GID)
            entries.setdefault(label, handle)
            drawn = _draw_baseline(ax, x, [groups[k] for k in labels], margin)
            if drawn is not None:
                entries.setdefault(*drawn)
            for method in others:
                entries.update(_draw_method(ax, x, [groups[k] for k in labels], method, styles[method], entries))
            spread = [k for k in labels if len(groups[k]) > 1]
            if spread:  # the points that share this value differ in the other swept parameters
                label = "range over the other swept values"
                handle = ax.vlines([labels.index(k) - 0.12 for k in spread],
                                   [min(r.metric for r in groups[k]) for k in spread],
                                   [max(r.metric for r in groups[k]) for k in spread], colors="#7fb8da", linewidth=3,
                                   zorder=1, label=label, gid=RANGE_GID)
                entries.setdefault(label, handle)
            if best is not None and best[0].get(parameter) in labels:
                (handle,) = ax.plot(labels.index(best[0][parameter]), best[1], marker="*", ms=9,
                                    color="#D55E00", ls="none", zorder=4, label=best_label, gid=BEST_GID)
                entries.setdefault(best_label, handle)
            ax.set_xticks(x, labels, rotation=30 if max(len(s) for s in labels) > 4 else 0)
            ax.set_xlabel(parameter_label(parameter))
            ax.grid(axis="y", alpha=0.3, lw=0.5)
        axes[0].set_ylabel(_axis_label(metric, name if not others else ""))
        figure.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=min(4, len(entries)))
        tasks = sorted({t for t in (row_tasks(r) for r in rows) if t})
        detail = f"{len(rows)} runs" + (f", {range_text(tasks)} tasks per setting" if tasks else "")
        how = "points: mean over the other swept values; " if len(swept) > 1 else ""
        figure.suptitle(f"{title} ({detail})\n{how}bars: 95% CI")
    return figure


def plot_study(rows: Sequence[StudyRow], metric: str, goal: str, swept: Sequence[str], folder: Path,
               title: str, parts: Mapping[str, str | None] | None = None) -> dict[str, Path]:
    """Write :func:`study_figure` as ``summary.pdf`` and a 300-DPI ``summary.png``, each atomically."""
    figure = study_figure(rows, metric, goal, swept, title, parts)
    paths = {}
    for suffix, options in (("pdf", {"metadata": {"CreationDate": None}}), ("png", {"dpi": 300})):
        paths[f"figure_{suffix}"] = atomic_savefig(figure, folder / f"summary.{suffix}", bbox_inches="tight", **options)
    return paths


def _draw_baseline(ax: Any, x: list[int], groups: list[list[StudyRow]], margin: bool) -> tuple[str, Any] | None:
    """SimpleShot: a dashed line with its CI band (flat across the panel when it does not change), or the zero
    line when the metric is a margin over SimpleShot; nothing when the runs did not evaluate it. Returns the
    legend label and handle of what was drawn."""
    colour = "0.35"
    if margin:
        label = f"{BASELINE_NAME} (zero margin)"
        return label, ax.axhline(0.0, color=colour, ls="--", lw=0.9, zorder=2, label=label, gid=BASELINE_GID)
    known = []
    for i, group in zip(x, groups):
        values = [r.baseline for r in group if r.baseline is not None]
        if values:
            known.append((i, mean_or_none([b.value for b in values]), mean_ci_or_none([b.ci95 for b in values])))
    if not known:
        return None
    with_ci = all(c is not None for _, _, c in known)
    label = f"{BASELINE_NAME} ± 95% CI" if with_ci else BASELINE_NAME
    if max(v for _, v, _ in known) - min(v for _, v, _ in known) < 1e-9:  # the same everywhere (same tasks)
        value, ci = known[0][1], known[0][2]
        line = ax.axhline(value, color=colour, ls="--", lw=0.9, zorder=2, label=label, gid=BASELINE_GID)
        band = ax.axhspan(value - ci, value + ci, color=colour, alpha=0.15, lw=0, zorder=0) if with_ci else None
    else:
        xs = [i for i, _, _ in known]
        (line,) = ax.plot(xs, [v for _, v, _ in known], color=colour, ls="--", lw=0.9, marker="_", zorder=2,
                          label=label, gid=BASELINE_GID)
        band = ax.fill_between(xs, [v - c for _, v, c in known], [v + c for _, v, c in known], color=colour,
                               alpha=0.15, lw=0, zorder=0) if with_ci else None
    if band is not None:
        band.set_gid(f"{BASELINE_GID}-band")
    return label, line if band is None else (band, line)


def _method_styles(methods: Sequence[str]) -> dict[str, Any]:
    """Each other method's house colour and marker (:func:`~lightning_putm.evaluation.plot_style.method_styles`),
    with a free colour where it would repeat the metric's blue or the star's vermilion (or be black, which reads
    as the baseline's grey)."""
    from lightning_putm.evaluation.plot_style import PALETTE, MethodStyle, method_styles

    taken = {"#0072B2", "#D55E00", "#000000"}
    spare = (c for c in PALETTE if c not in taken and c not in {s.colour for s in method_styles(methods).values()})
    styles = {}
    for (name, _), style in method_styles(methods).items():
        colour = style.colour if style.colour not in taken else next(spare, "0.5")
        styles[name] = MethodStyle(colour, style.marker)
    return styles


def _draw_method(ax: Any, x: list[int], groups: list[list[StudyRow]], method: str, style: Any,
                 entries: Mapping[str, Any]) -> dict[str, Any]:
    """Another method's value of the metric per swept value (mean over the points sharing it) with its mean CI,
    where the runs evaluated it; returns its legend entry (none when nothing was drawn)."""
    from lightning_putm.methods import method_display_name

    known = [(i, [r.methods[method] for r in group if method in r.methods]) for i, group in zip(x, groups)]
    known = [(i, values) for i, values in known if values]
    if not known:
        return {}
    xs = [i for i, _ in known]
    means = [mean_or_none([v.value for v in values]) for _, values in known]
    cis = [mean_ci_or_none([v.ci95 for v in values]) for _, values in known]
    label = method_display_name(method) + (" ± 95% CI" if all(c is not None for c in cis) else "")
    if all(c is not None for c in cis):
        handle = ax.errorbar(xs, means, yerr=cis, fmt="-", marker=style.marker, color=style.colour, ms=3, lw=0.9,
                             capsize=2, elinewidth=0.6, zorder=2.5, label=label)
        handle.lines[0].set_gid(f"{METHOD_GID}-{method}")
    else:
        (handle,) = ax.plot(xs, means, "-", marker=style.marker, color=style.colour, ms=3, lw=0.9, zorder=2.5,
                            label=label, gid=f"{METHOD_GID}-{method}")
    return {} if label in entries else {label: handle}


def _metric_name(metric: str, parts: Mapping[str, str | None] | None) -> str:
    """The metric as the legend names it: ``PUTM``, or ``PUTM − SimpleShot (worst)`` for a margin."""
    from lightning_putm.methods import method_display_name

    if parts is None:
        return metric
    if parts.get("gainer"):
        return f"{method_display_name(str(parts['gainer']))} − {method_display_name(str(parts['other']))} (worst)"
    return method_display_name(str(parts["method"])) if parts.get("method") else metric


def _axis_label(metric: str, name: str) -> str:
    """The y axis: ``PUTM accuracy (%)`` (``name=""``, several methods drawn: ``accuracy (%)``), the setting of a
    one-setting metric, or ``worst margin (points)``."""
    if "worst_gain_over_" in metric:
        return "worst margin (points)"
    setting = metric.split("/")[2:-1]  # [<k>shot, alpha_<a>] for one setting's accuracy
    where = " " + " ".join(setting).replace("alpha_", "α=") if setting else ""
    if name and name != metric:
        return f"{name}{where} accuracy (%)"
    return f"accuracy{where} (%)"


def _ordered(groups: Mapping[str, Any]) -> list[str]:
    """Numbers in numeric order, then the rest (e.g. ``balanced``) in their order of appearance (a grid study's
    rows come in the sweep's order: :meth:`~lightning_putm.studies.study.Study.rows`)."""
    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None
    numeric = sorted((k for k in groups if number(k) is not None), key=lambda k: number(k))
    return numeric + [k for k in groups if number(k) is None]


def write_study_summary(rows: Sequence[StudyRow], metric: str, goal: str, swept: Sequence[str], folder: Path,
                        title: str, parts: Mapping[str, str | None] | None = None) -> dict[str, Path]:
    """``summary.csv``, ``summary.md`` and the figure (PDF + 300-DPI PNG) in ``folder``, each written atomically.

    ``parts``: the named groups of the metric pattern (``method``, ``shots``, ``alpha``, ``gainer``, ``other``);
    they say what SimpleShot's baseline is. Rows should carry their intervals (:func:`with_intervals`)."""
    folder.mkdir(parents=True, exist_ok=True)
    records = summary_rows(rows, metric)
    columns = list(dict.fromkeys(k for r in records for k in r))
    paths = {"csv": write_csv(folder / "summary.csv", records, columns or [*swept, metric, ci_column(metric)])}
    text = f"# Study {title}\n\n{len(rows)} finished run(s); metric `{metric}` ({goal}), mean ± 95% CI.\n\n"
    if rows:
        text += markdown_table(rows, metric, goal, swept, parts) + "\n" + "".join(
            f"- {note}\n" for note in summary_notes(rows, parts, swept, goal))
    else:
        text += "No run has finished yet.\n"
    paths["markdown"] = atomic_write_text(folder / "summary.md", text)
    if rows:
        paths.update(plot_study(rows, metric, goal, swept, folder, title, parts))
    return paths
