"""The accuracy-against-K_eff figure of a run over several K_eff at one α (PADDLE's protocol, Martin et al.,
NeurIPS 2022: N-way tasks whose query set holds only K_eff of the N classes). Drawn like :mod:`.plots`'s
accuracy-vs-α figure (same style, colours and markers per method, atomic PDF + PNG), in its own module."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from lightning_putm.evaluation.plot_style import (BALANCED, DEFAULT_FORMATS, UNIFORM, accuracy_panel, column_width,
                                                  display_label, figure_paths, legend_columns, method_legend,
                                                  method_styles, new_figure, paper_style, protocol_text,
                                                  save_figure)
from lightning_putm.evaluation.records import Summary, as_summaries

__all__ = ["plot_accuracy_vs_query_classes"]

#: gid prefix of the data lines (lets tests and callers find them among decoration lines)
KEFF_LINE_GID = "keff-line"


def _accuracy_vs_query_classes_figure(rows: Sequence[Summary | Mapping[str, Any]], width: str | float = "auto",
                                      dataset: str | None = None, ways: int | None = None,
                                      queries: int | None = None, title: str | None = None) -> Figure:
    """Build (without saving) the accuracy-vs-K_eff figure: one panel per shot, one line per method over the
    K_eff values of the rows (one α; the caller splits by α). K_eff values sit at evenly spaced positions in
    increasing order; the default protocol's rows (K_eff = all N, ``query_classes`` None) come last as "all"."""
    summaries = as_summaries(rows)
    alphas = {s.alpha for s in summaries}
    if len(alphas) > 1:
        raise ValueError(f"one α per accuracy-vs-K_eff figure, got {sorted(map(str, alphas))}")
    seen: set[tuple[str, bool, int, int | None]] = set()
    for index, summary in enumerate(summaries):
        key = (summary.method, summary.oracle_prior, summary.shots, summary.query_classes)
        if key in seen:
            raise ValueError(f"row {index}: duplicate result for method={summary.label!r}, shots={summary.shots}, "
                             f"K_eff={summary.query_classes_label}")
        seen.add(key)
    keys = list(dict.fromkeys((s.method, s.oracle_prior) for s in summaries))
    styles = method_styles(keys)
    shots = sorted({s.shots for s in summaries})
    values = sorted({s.query_classes for s in summaries if s.query_classes is not None})
    if any(s.query_classes is None for s in summaries):
        values.append(None)
    position = {value: float(i) for i, value in enumerate(values)}
    step = min(0.1, 0.7 / len(keys))
    dodge = {key: step * (i - (len(keys) - 1) / 2) for i, key in enumerate(keys)}
    [alpha] = alphas

    with paper_style():
        inches = column_width(width, wide=len(shots) > 1)
        columns = legend_columns(len(keys), max(1, int(inches / 1.05)))
        figure = new_figure(inches, 2.3 + 0.15 * math.ceil(len(keys) / columns))
        axes = figure.subplots(1, len(shots), sharey=True, squeeze=False)[0]
        for ax, shot in zip(axes, shots):
            for key in keys:
                style = styles[key]
                label = display_label(*key)
                mine = sorted((s for s in summaries if (s.method, s.oracle_prior) == key and s.shots == shot),
                              key=lambda s: position[s.query_classes])
                if not mine:
                    continue
                container = ax.errorbar(
                    np.array([position[s.query_classes] for s in mine]) + dodge[key], [s.accuracy for s in mine],
                    yerr=[s.ci95 for s in mine], color=style.colour, marker=style.marker,
                    linestyle=style.linestyle, capsize=1.8, capthick=0.6, elinewidth=0.6, markeredgewidth=0.7,
                    markeredgecolor=style.colour, markerfacecolor=style.colour if style.filled else "white",
                    zorder=3 if key == ("putm", False) else 2, label=label)
                container.lines[0].set_gid(f"{KEFF_LINE_GID}:{label}")
                container.lines[0].set_label(label)
            ax.set_xticks([position[v] for v in values], ["all" if v is None else str(v) for v in values])
            ax.set_xlim(-0.5, len(values) - 0.5)
            ax.set_xlabel(r"classes in the query set $K_\mathrm{eff}$")
            accuracy_panel(ax, shot)
        axes[0].set_ylabel("Accuracy (%)")
        method_legend(figure, styles, keys, columns)
        if title != "":
            imbalance = alpha if alpha in (BALANCED, UNIFORM) else (BALANCED if alpha is None else rf"$\alpha$ = {alpha}")
            protocol = protocol_text(ways, queries, [s.tasks for s in summaries])
            first = title or ": ".join(p for p in (dataset, protocol) if p) or "Accuracy against absent classes"
            figure.suptitle(f"{first}, {imbalance}\nmean accuracy over the tasks; bars: 95% CI")
    return figure


def plot_accuracy_vs_query_classes(rows: Sequence[Summary | Mapping[str, Any]], path: str | os.PathLike[str],
                                   formats: Sequence[str] = DEFAULT_FORMATS, width: str | float = "auto",
                                   dataset: str | None = None, ways: int | None = None, queries: int | None = None,
                                   title: str | None = None) -> Path:
    """Accuracy (mean with 95% CI error bars) against K_eff, the number of the N classes present in the query set
    (PADDLE's protocol, Martin et al., NeurIPS 2022), per method and shot, for one α. A method that assumes all N
    classes present loses accuracy as K_eff falls. ``rows`` as for :func:`plot_accuracy_vs_alpha`, with a
    ``query_classes`` column (empty = all N, drawn last as "all"). Returns ``path``."""
    paths = figure_paths(path, formats)
    return save_figure(_accuracy_vs_query_classes_figure(rows, width, dataset, ways, queries, title), paths)


