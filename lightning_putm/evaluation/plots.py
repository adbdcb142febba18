"""Figures of the evaluation report: accuracy vs α, true vs estimated class counts, prototype t-SNE.

They reproduce the three kinds of figure that Tian et al., ICCV 2023 (PUTM) use to argue their case: robustness
of accuracy to the Dirichlet imbalance level α, the case study comparing the true per-class query counts with the
counts PUTM's forward navigator implies, and a t-SNE view of prototypes before and after the CT-EM refinement.

The figures are meant to go into a paper as they are: each is written as a vector PDF next to a 300-DPI PNG
(SVG on request), sized for a single (3.4 in) or double (7 in) column, drawn in :func:`paper_style` (serif text
at 7–8 pt, no top/right spines, TrueType fonts embedded in the PDF). Methods appear under their display names
(``α-TIM``, not ``alpha_tim``) with one colour-blind-safe colour and marker each, the same in every figure.

Only matplotlib's object API with the Agg canvas is used (no pyplot, no windows, no global figure registry), so
the functions are safe in headless jobs and worker processes; the style is applied with ``rc_context`` and never
leaks into the caller's matplotlib settings. Every file is written atomically (:mod:`lightning_putm.atomic`:
a temporary file in the destination folder, then a rename), so a reader never sees a half-written figure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from lightning_putm.evaluation.plot_style import (BALANCED, DEFAULT_FORMATS, UNIFORM, accuracy_panel, class_colours,
                                                  column_width, display_label, figure_paths, format_number,
                                                  legend_columns, method_legend, method_styles, new_figure,
                                                  paper_style, protocol_text, save_figure)
from lightning_putm.evaluation.records import Summary, as_summaries

__all__ = ["class_labels", "plot_accuracy_vs_alpha", "plot_query_counts", "plot_prototype_tsne"]

EXACT_TSNE_MAX_POINTS = 500

#: The t-SNE legend entry of the queries: the colour is the query's true class, not a prediction.
QUERY_LEGEND = "query (colour: its true class)"

# gid prefixes of the artists that carry data (lets tests and callers find them among decoration lines)
ALPHA_LINE_GID = "alpha-line"
BALANCED_POINT_GID = "balanced-point"
UNIFORM_POINT_GID = "uniform-point"


def _as_array(value: Any, name: str) -> np.ndarray:
    """numpy view of a torch tensor or array-like (torch is not imported here: duck-typed ``detach``)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as error:  # noqa: BLE001 - report which argument is unusable
        raise ValueError(f"`{name}` cannot be converted to an array: {error}") from error


# ------------------------------------------------------------------------------------------- accuracy vs α


def _parse_accuracy_rows(rows: Sequence[Summary | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Summaries (or rows of a saved results.csv) as plot items keyed by (method, oracle prior)."""
    parsed: list[dict[str, Any]] = []
    seen: set[tuple[str, bool, int, float | str | None]] = set()
    for index, summary in enumerate(as_summaries(rows)):
        item = {"key": (summary.method, summary.oracle_prior), "shots": summary.shots, "alpha": summary.alpha,
                "accuracy": summary.accuracy, "ci95": summary.ci95, "tasks": summary.tasks}
        if (*item["key"], item["shots"], item["alpha"]) in seen:
            raise ValueError(f"row {index}: duplicate result for method={summary.label!r}, shots={item['shots']}, "
                             f"alpha={summary.alpha_label}")
        seen.add((*item["key"], item["shots"], item["alpha"]))
        parsed.append(item)
    return parsed


def _accuracy_vs_alpha_figure(rows: Sequence[Summary | Mapping[str, Any]], width: str | float = "auto",
                              dataset: str | None = None, ways: int | None = None, queries: int | None = None,
                              title: str | None = None, query_classes: int | None = None) -> Figure:
    """Build (without saving) the accuracy-vs-α figure: one panel per shot, one marker-and-line per method.

    The title says what stands behind the points: the features (``dataset``), the task shape, the tasks per point
    (the rows' ``tasks``) and that the bars are 95% CIs; ``title`` replaces its first line, ``""`` drops it.

    Numeric α values sit at evenly spaced positions (the paper's α grid spans orders of magnitude, so category
    spacing reads better than a linear axis); ``balanced`` gets its own position to the right, behind a dotted
    separator, because it is the limit α → ∞ rather than a point on the grid; ``uniform`` (PADDLE's draw, no α at
    all) sits after it. Every point carries its 95% CI as a capped error bar; methods are dodged sideways a little so
    ten of them stay readable. ``query_classes`` (K_eff) is named in the title.
    """
    parsed = _parse_accuracy_rows(rows)
    keys = list(dict.fromkeys(item["key"] for item in parsed))
    styles = method_styles(keys)
    shots = sorted({item["shots"] for item in parsed})
    alphas = sorted({item["alpha"] for item in parsed if item["alpha"] not in (None, UNIFORM)})
    # the words after the grid, each at its own position: None (balanced), then uniform
    words = [word for word in (None, UNIFORM) if any(item["alpha"] == word for item in parsed)]
    position = {alpha: float(i) for i, alpha in enumerate(alphas)}
    first_word_x = len(alphas) + 0.5 if alphas else 0.0
    word_x = {word: first_word_x + i for i, word in enumerate(words)}
    word_gid = {None: BALANCED_POINT_GID, UNIFORM: UNIFORM_POINT_GID}
    step = min(0.1, 0.7 / len(keys))
    dodge = {key: step * (i - (len(keys) - 1) / 2) for i, key in enumerate(keys)}

    with paper_style():
        inches = column_width(width, wide=len(shots) > 1)
        columns = legend_columns(len(keys), max(1, int(inches / 1.05)))  # ~1.05 in per "LaplacianShot" entry
        legend_rows = math.ceil(len(keys) / columns)
        figure = new_figure(inches, 2.3 + 0.15 * legend_rows)
        axes = figure.subplots(1, len(shots), sharey=True, squeeze=False)[0]
        for ax, shot in zip(axes, shots):
            for key in keys:
                style = styles[key]
                label = display_label(*key)
                common = {"color": style.colour, "marker": style.marker, "capsize": 1.8, "capthick": 0.6,
                          "elinewidth": 0.6, "markeredgewidth": 0.7, "markeredgecolor": style.colour,
                          "markerfacecolor": style.colour if style.filled else "white",
                          "zorder": 3 if key == ("putm", False) else 2}
                mine = [item for item in parsed if item["key"] == key and item["shots"] == shot]
                numeric = sorted((item for item in mine if item["alpha"] not in (None, UNIFORM)),
                                 key=lambda item: item["alpha"])
                if numeric:
                    x = np.array([position[item["alpha"]] for item in numeric]) + dodge[key]
                    container = ax.errorbar(x, [item["accuracy"] for item in numeric],
                                            yerr=[item["ci95"] for item in numeric], linestyle=style.linestyle,
                                            label=label, **common)
                    container.lines[0].set_gid(f"{ALPHA_LINE_GID}:{label}")
                    container.lines[0].set_label(label)  # errorbar labels only the container
                for item in mine:
                    if item["alpha"] in word_x:
                        word = BALANCED if item["alpha"] is None else item["alpha"]
                        container = ax.errorbar([word_x[item["alpha"]] + dodge[key]], [item["accuracy"]],
                                                yerr=[item["ci95"]], linestyle="none", label=f"_{label} ({word})",
                                                **common)
                        container.lines[0].set_gid(f"{word_gid[item['alpha']]}:{label}")
            ticks = [position[a] for a in alphas]
            labels = [f"{a:g}" for a in alphas]
            for word in words:
                ticks.append(word_x[word])
                labels.append(BALANCED if word is None else word)
            if words and alphas:
                ax.axvline((len(alphas) - 1 + first_word_x) / 2, color="0.6", linestyle=":", linewidth=0.7)
            ax.set_xticks(ticks, labels)
            ax.set_xlim(min(ticks) - 0.5, max(ticks) + 0.5)
            ax.set_xlabel(r"Dirichlet concentration $\alpha$")
            accuracy_panel(ax, shot)
        axes[0].set_ylabel("Accuracy (%)")
        method_legend(figure, styles, keys, columns)
        if title != "":
            protocol = protocol_text(ways, queries, [item["tasks"] for item in parsed], query_classes)
            first = title or ": ".join(p for p in (dataset, protocol) if p) or "Accuracy against query imbalance"
            figure.suptitle(f"{first}\nmean accuracy over the tasks; bars: 95% CI")
    return figure


def plot_accuracy_vs_alpha(rows: Sequence[Summary | Mapping[str, Any]], path: str | os.PathLike[str],
                           formats: Sequence[str] = DEFAULT_FORMATS, width: str | float = "auto",
                           dataset: str | None = None, ways: int | None = None, queries: int | None = None,
                           title: str | None = None, query_classes: int | None = None) -> Path:
    """Accuracy (mean with 95% CI error bars) against the Dirichlet α of the query imbalance, per method and shot.

    Reproduces the robustness-to-imbalance figure of Tian et al., ICCV 2023: methods that assume a uniform class
    prior lose accuracy as α shrinks (stronger imbalance), PUTM should degrade least. ``rows`` are summaries or
    rows of results.csv (``method``, ``shots``, ``alpha`` — a number or ``"balanced"`` —, ``accuracy``, ``ci95``;
    strings are accepted); a truthy ``oracle_prior`` column marks the method as such. ``path`` ends in ``.png``,
    ``.pdf`` or ``.svg``; the other ``formats`` are written next to it. ``width``: ``"auto"`` (one column for one
    shot, two columns for several), ``"single"``, ``"double"`` or inches. The title names ``dataset`` (see
    :func:`dataset_label`), ``ways``, ``queries``, the tasks per point and that the bars are 95% CIs; ``title``
    replaces its first line and ``title=""`` drops it (for a paper, where the caption says it). ``query_classes``:
    the K_eff of the rows (PADDLE's protocol; one figure per K_eff), named in the title. Returns ``path``.
    """
    paths = figure_paths(path, formats)
    return save_figure(_accuracy_vs_alpha_figure(rows, width, dataset, ways, queries, title, query_classes), paths)


# ------------------------------------------------------------------------------------ class names of a task


def _short_class_name(name: str, limit: int = 30) -> str:
    """A label: dataset class names can be long paths (Omniglot's alphabet/character/rotation); keep the last
    path parts that fit in ``limit`` characters."""
    if len(name) <= limit:
        return name
    parts = name.replace("\\", "/").split("/")
    kept = parts[-1]
    for part in reversed(parts[:-1]):
        if len(part) + 1 + len(kept) > limit:
            break
        kept = f"{part}/{kept}"
    return kept if len(kept) <= limit else "…" + kept[-(limit - 1):]


def class_labels(class_names: Sequence[Any] | None, count: int) -> list[str]:
    """The label of each class of one task, as every task figure prints it (count plot and t-SNE alike).

    ``None`` gives ``class 0 … class N-1``; long path-like names keep their last parts (see
    :func:`_short_class_name`); names that shorten to the same text get a ``[k]`` suffix so they stay distinct.
    """
    if class_names is None:
        return [f"class {k}" for k in range(count)]
    names = [str(name) for name in class_names]
    if len(names) != count:
        raise ValueError(f"class_names has {len(names)} entries but there are {count} classes")
    short = [_short_class_name(name) for name in names]
    repeated = {label for label in short if short.count(label) > 1}
    return [f"{label} [{k}]" if label in repeated else label for k, label in enumerate(short)]


# ------------------------------------------------------------------------------------ true vs estimated counts


def _query_counts_figure(true_counts: Sequence[float], estimated_counts: Sequence[float],
                         class_names: Sequence[str] | None = None, title: str | None = None,
                         width: str | float = "auto") -> Figure:
    """Build (without saving) the grouped-bar figure of true vs estimated per-class query counts."""
    true = _as_array(true_counts, "true_counts").astype(float, copy=False)
    estimated = _as_array(estimated_counts, "estimated_counts").astype(float, copy=False)
    if true.ndim != 1 or estimated.ndim != 1:
        raise ValueError(f"counts must be 1-D per-class vectors, got shapes {true.shape} (true) and "
                         f"{estimated.shape} (estimated)")
    if true.size == 0:
        raise ValueError("counts are empty: expected one count per class")
    if true.size != estimated.size:
        raise ValueError(f"true_counts has {true.size} classes but estimated_counts has {estimated.size}")
    for name, values in (("true_counts", true), ("estimated_counts", estimated)):
        if not np.all(np.isfinite(values)) or np.any(values < 0):
            raise ValueError(f"`{name}` must be finite and non-negative, got {values.tolist()}")
    labels = class_labels(class_names, true.size)
    colours = class_colours(true.size)

    with paper_style():
        inches = column_width(width, wide=true.size > 10)
        figure = new_figure(inches, 2.4)
        ax: Axes = figure.subplots()
        x = np.arange(true.size)
        bar = 0.38
        # same class colour in both bars (and in the t-SNE); the estimate is filled, the true count an outline
        true_bars = ax.bar(x - bar / 2, true, bar, facecolor="white", edgecolor=colours, linewidth=0.9,
                           hatch="//////", gid="true-counts")
        estimated_bars = ax.bar(x + bar / 2, estimated, bar, color=colours, edgecolor=colours, linewidth=0.9,
                                gid="estimated-counts")
        ax.bar_label(true_bars, labels=[format_number(v) for v in true], padding=1.5, fontsize=6)
        ax.bar_label(estimated_bars, labels=[f"{v:.1f}" for v in estimated], padding=1.5, fontsize=6)
        long_names = max(len(label) for label in labels) * true.size > 12 * inches  # ~12 characters per inch
        ax.set_xticks(x, labels, rotation=30 if long_names else 0, ha="right" if long_names else "center",
                      rotation_mode="anchor", fontsize=6 if long_names else None)
        ax.tick_params(axis="x", length=0)
        ax.set_ylabel("Queries per class")
        ax.set_ylim(0, max(float(true.max()), float(estimated.max()), 1.0) * 1.3)  # headroom for the legend
        handles = [Patch(facecolor="white", edgecolor="0.35", hatch="//////", linewidth=0.9, label="true count"),
                   Patch(facecolor="0.35", edgecolor="0.35", linewidth=0.9,
                         label=r"PUTM estimate $\Sigma_j\,\pi_f(k\,|\,j)$")]
        ax.legend(handles=handles, loc="upper center", ncols=2)
        if title != "":
            ax.set_title(title or "Class prior of the query set: true vs estimated")
    return figure


def plot_query_counts(true_counts: Sequence[float], estimated_counts: Sequence[float],
                      path: str | os.PathLike[str], class_names: Sequence[str] | None = None,
                      title: str | None = None, formats: Sequence[str] = DEFAULT_FORMATS,
                      width: str | float = "auto") -> Path:
    """Grouped bars of the true per-class query counts and PUTM's estimate Σ_j π_f(k|j).

    Reproduces the prior case study of Tian et al., ICCV 2023: the forward navigator should recover the
    imbalanced class marginal of the query set, which uniform-prior methods cannot. Classes are labelled and
    coloured as in :func:`plot_prototype_tsne` for the same ``class_names``; ``title=""`` drops the title (for
    a paper, where the caption says it). Writes ``path`` and the other ``formats`` next to it; returns ``path``.
    """
    paths = figure_paths(path, formats)
    return save_figure(_query_counts_figure(true_counts, estimated_counts, class_names, title, width), paths)


# ------------------------------------------------------------------------------------------- prototype t-SNE


def _tsne_perplexity(n_points: int) -> float:
    """Perplexity small enough for tiny tasks (t-SNE requires perplexity < number of points)."""
    return float(min(30, max(2, (n_points - 1) // 3)))


def _tsne_embedding(points: np.ndarray, seed: int) -> np.ndarray:
    """2-D t-SNE of all points at once, so every panel shares one embedding; deterministic for a seed."""
    from sklearn.manifold import TSNE  # local import: scikit-learn is needed only for this figure

    if points.shape[0] < 4:
        raise ValueError(f"t-SNE needs at least 4 points in all, got {points.shape[0]}")
    # A few-shot task has ~100 points: the exact gradient is cheap there, more faithful than Barnes-Hut, and
    # avoids Barnes-Hut's OpenMP threads, which stall badly on busy machines.
    method = "exact" if points.shape[0] <= EXACT_TSNE_MAX_POINTS else "barnes_hut"
    tsne = TSNE(n_components=2, perplexity=_tsne_perplexity(points.shape[0]), init="pca", random_state=seed,
                method=method)
    return tsne.fit_transform(points.astype(np.float64, copy=False))


def _validate_tsne_inputs(queries: Any, query_labels: Any, initial_prototypes: Any, refined_prototypes: Any,
                          support: Any, support_labels: Any) -> tuple[np.ndarray, ...]:
    q = _as_array(queries, "queries").astype(np.float64, copy=False)
    y = _as_array(query_labels, "query_labels")
    p0 = _as_array(initial_prototypes, "initial_prototypes").astype(np.float64, copy=False)
    p1 = _as_array(refined_prototypes, "refined_prototypes").astype(np.float64, copy=False)
    if q.ndim != 2 or q.shape[0] == 0:
        raise ValueError(f"queries must be a non-empty [Q, m] matrix, got shape {tuple(q.shape)}")
    if p0.ndim != 2 or p0.shape[0] == 0:
        raise ValueError(f"initial_prototypes must be a non-empty [N, m] matrix, got shape {tuple(p0.shape)}")
    if p1.shape != p0.shape:
        raise ValueError(f"refined_prototypes has shape {tuple(p1.shape)} but initial_prototypes has "
                         f"{tuple(p0.shape)}; they must match")
    if p0.shape[1] != q.shape[1]:
        raise ValueError(f"queries have {q.shape[1]} features but prototypes have {p0.shape[1]}")
    n_classes = p0.shape[0]
    y = _validate_labels(y, "query_labels", q.shape[0], n_classes)
    if (support is None) != (support_labels is None):
        raise ValueError("give both `support` and `support_labels`, or neither")
    if support is None:
        s = np.zeros((0, q.shape[1]))
        sy = np.zeros(0, dtype=np.int64)
    else:
        s = _as_array(support, "support").astype(np.float64, copy=False)
        if s.ndim != 2 or s.shape[1] != q.shape[1]:
            raise ValueError(f"support must be a [S, {q.shape[1]}] matrix (same features as queries), "
                             f"got shape {tuple(s.shape)}")
        sy = _validate_labels(_as_array(support_labels, "support_labels"), "support_labels", s.shape[0], n_classes)
    for name, values in (("queries", q), ("support", s), ("initial_prototypes", p0), ("refined_prototypes", p1)):
        if not np.all(np.isfinite(values)):
            raise ValueError(f"`{name}` contains NaN or infinite values")
    return q, y, p0, p1, s, sy


def _validate_labels(labels: np.ndarray, name: str, count: int, n_classes: int) -> np.ndarray:
    if labels.shape != (count,):
        raise ValueError(f"{name} must have shape [{count}] (one label per row), got {tuple(labels.shape)}")
    if count and not np.all(np.equal(np.mod(labels, 1), 0)):
        raise ValueError(f"{name} must be integer class indices, got {labels.tolist()}")
    labels = labels.astype(np.int64)
    if count and (labels.min() < 0 or labels.max() >= n_classes):
        raise ValueError(f"{name} must be task-relative class indices in [0, {n_classes}) to match the "
                         f"{n_classes} prototypes, got values in [{labels.min()}, {labels.max()}]")
    return labels


def plot_prototype_tsne(queries: Any, query_labels: Any, initial_prototypes: Any, refined_prototypes: Any,
                        path: str | os.PathLike[str], support: Any = None, support_labels: Any = None,
                        seed: int = 0, title: str | None = None, class_names: Sequence[str] | None = None,
                        formats: Sequence[str] = DEFAULT_FORMATS, width: str | float = "double") -> Path:
    """t-SNE of one task: queries by true class with the support-mean and the PUTM-refined prototypes.

    Reproduces the prototype visualisation of Tian et al., ICCV 2023: under imbalance the support means sit off
    the query clusters, the CT-EM refinement should move each prototype into its class's cluster. One t-SNE is
    fitted on all points (queries, support, both prototype sets) so the two panels share coordinates; arrows in
    the second panel show each prototype's move. Inputs are torch tensors or arrays: queries [Q, m], labels [Q]
    (task-relative 0..N-1), prototypes [N, m], optional support [S, m] with labels [S]; ``class_names`` label
    the classes exactly as :func:`plot_query_counts` does. Writes ``path`` and the other ``formats``; returns
    ``path``.
    """
    paths = figure_paths(path, formats)
    return save_figure(_prototype_tsne_figure(queries, query_labels, initial_prototypes, refined_prototypes,
                                        support, support_labels, seed, title, class_names, width), paths)


def _prototype_tsne_figure(queries: Any, query_labels: Any, initial_prototypes: Any, refined_prototypes: Any,
                           support: Any = None, support_labels: Any = None, seed: int = 0,
                           title: str | None = None, class_names: Sequence[str] | None = None,
                           width: str | float = "double") -> Figure:
    """Build (without saving) the two-panel prototype t-SNE figure."""
    q, y, p0, p1, s, sy = _validate_tsne_inputs(queries, query_labels, initial_prototypes, refined_prototypes,
                                                 support, support_labels)
    n_q, n_s, n_c = q.shape[0], s.shape[0], p0.shape[0]
    labels = class_labels(class_names, n_c)
    embedded = _tsne_embedding(np.concatenate([q, s, p0, p1]), seed)
    eq = embedded[:n_q]
    es = embedded[n_q:n_q + n_s]
    e0 = embedded[n_q + n_s:n_q + n_s + n_c]
    e1 = embedded[n_q + n_s + n_c:]
    colours = np.array(class_colours(n_c))

    with paper_style():
        inches = column_width(width, wide=True)
        figure = new_figure(inches, 0.36 * inches + 0.6)
        before, after = figure.subplots(1, 2, sharex=True, sharey=True)
        for ax, prototypes, panel_title in ((before, e0, "Before refinement (support means)"),
                                            (after, e1, "After PUTM refinement")):
            ax.scatter(eq[:, 0], eq[:, 1], s=9, c=colours[y], alpha=0.7, linewidths=0)
            if n_s:
                ax.scatter(es[:, 0], es[:, 1], s=16, c=colours[sy], marker="s", edgecolors="black",
                           linewidths=0.4)
            ax.scatter(prototypes[:, 0], prototypes[:, 1], s=110, c=colours, marker="*", edgecolors="black",
                       linewidths=0.6, zorder=3)
            ax.set_title(panel_title)
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ("top", "right", "bottom", "left"):
                ax.spines[side].set_visible(True)
                ax.spines[side].set_color("0.7")
        after.scatter(e0[:, 0], e0[:, 1], s=60, marker="*", facecolors="none", edgecolors=colours, linewidths=0.6,
                      zorder=2)
        for k in range(n_c):
            after.annotate("", xy=tuple(e1[k]), xytext=tuple(e0[k]),
                           arrowprops={"arrowstyle": "->", "color": colours[k], "linewidth": 0.7,
                                       "shrinkA": 3, "shrinkB": 5})
        # marker = kind of point, colour = class; queries are coloured by their TRUE class (the labels given),
        # not by a method's prediction, so a query of another colour inside a cluster is a hard query
        kinds = [Line2D([], [], linestyle="", marker="o", markersize=3.5, color="0.45", markeredgewidth=0,
                        label=QUERY_LEGEND)]
        if n_s:
            kinds.append(Line2D([], [], linestyle="", marker="s", markersize=3.5, color="0.45",
                                markeredgecolor="black", markeredgewidth=0.4, label="support sample"))
        kinds += [Line2D([], [], linestyle="", marker="*", markersize=8, color="0.45", markeredgecolor="black",
                         markeredgewidth=0.6, label="prototype (left: support mean; right: refined)"),
                  Line2D([], [], linestyle="", marker="*", markersize=7, markerfacecolor="none",
                         markeredgecolor="0.45", markeredgewidth=0.6, label="support mean, before (right)")]
        classes = [Line2D([], [], linestyle="", marker="o", markersize=4.5, color=colours[k], markeredgewidth=0,
                          label=labels[k]) for k in range(n_c)]
        # one legend: the marker kinds on the first row, the classes (same labels and colours as the count
        # plot) on the rows below; matplotlib fills legends column by column, so the grid is transposed
        entry = max(0.6, 0.075 * max(len(label) for label in labels) + 0.35)  # inches per class entry
        columns = max(len(kinds), legend_columns(n_c, max(1, int(inches / entry))))
        blank = Line2D([], [], linestyle="", marker="", label="")
        grid = [kinds + [blank] * (columns - len(kinds))]
        for start in range(0, n_c, columns):
            chunk = classes[start:start + columns]
            grid.append(chunk + [blank] * (columns - len(chunk)))
        ordered = [row[c] for c in range(columns) for row in grid]
        figure.legend(handles=ordered, loc="outside lower center", ncols=columns)
        if title:
            figure.suptitle(title)
    return figure
