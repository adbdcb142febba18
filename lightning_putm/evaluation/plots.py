"""Figures of the evaluation report: accuracy vs α, true vs estimated class counts, prototype t-SNE.

They reproduce the three kinds of figure that Tian et al., ICCV 2023 (PUTM) use to argue their case: robustness
of accuracy to the Dirichlet imbalance level α, the case study comparing the true per-class query counts with the
counts PUTM's forward navigator implies, and a t-SNE view of prototypes before and after the CT-EM refinement.

Only matplotlib's object API with the Agg canvas is used (no pyplot, no windows, no global figure registry), so
the functions are safe in headless jobs and worker processes. Every figure is written atomically: a temporary
file in the destination folder, then ``os.replace``, so a reader never sees a half-written PNG.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from lightning_putm.evaluation.records import Summary, as_summaries

__all__ = ["plot_accuracy_vs_alpha", "plot_query_counts", "plot_prototype_tsne"]

BALANCED = "balanced"
DPI = 120
EXACT_TSNE_MAX_POINTS = 500

# gid prefixes of the artists that carry data (lets tests and callers find them among decoration lines)
ALPHA_LINE_GID = "alpha-line"
BALANCED_POINT_GID = "balanced-point"


# ---------------------------------------------------------------------------------------------------- helpers


def _new_figure(width: float, height: float) -> Figure:
    """A figure bound to an Agg canvas (never to a GUI backend)."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _save_png(figure: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``figure`` as a PNG atomically (temporary file in the same folder, then rename) and release it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # a unique name created by savefig itself, so the PNG gets the usual umask permissions (mkstemp gives 0600)
    tmp_name = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        figure.savefig(tmp_name, format="png", dpi=DPI, bbox_inches="tight")
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    finally:
        figure.clear()
    return target


def _colours(count: int) -> list[tuple[float, float, float, float]]:
    """Distinct colours: tab10 / tab20 for small counts, then an evenly sampled continuous map."""
    if count <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(count)]
    if count <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(count)]
    cmap = colormaps["turbo"]
    return [cmap(i / max(count - 1, 1)) for i in range(count)]


def _as_array(value: Any, name: str) -> np.ndarray:
    """numpy view of a torch tensor or array-like (torch is not imported here: duck-typed ``detach``)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as error:  # noqa: BLE001 - report which argument is unusable
        raise ValueError(f"`{name}` cannot be converted to an array: {error}") from error


def _format_number(value: float) -> str:
    return f"{int(round(value))}" if float(value).is_integer() else f"{value:g}"


# ------------------------------------------------------------------------------------------- accuracy vs α


def _parse_accuracy_rows(rows: Sequence[Summary | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Summaries (or rows of a saved results.csv) as plot items; oracle-prior results get their own label."""
    parsed: list[dict[str, Any]] = []
    seen: set[tuple[str, int, float | None]] = set()
    for index, summary in enumerate(as_summaries(rows)):
        item = {"method": summary.label, "shots": summary.shots, "alpha": summary.alpha,
                "accuracy": summary.accuracy, "ci95": summary.ci95}
        key = (item["method"], item["shots"], item["alpha"])
        if key in seen:
            raise ValueError(f"row {index}: duplicate result for method={item['method']!r}, shots={item['shots']}, "
                             f"alpha={summary.alpha_label}")
        seen.add(key)
        parsed.append(item)
    return parsed


def _accuracy_vs_alpha_figure(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Build (without saving) the accuracy-vs-α figure: one panel per shot, one line per method.

    Numeric α values sit at evenly spaced positions (the paper's α grid spans orders of magnitude, so
    category spacing reads better than a linear axis); ``balanced`` gets its own position to the right, behind
    a dotted separator, because it is the limit α → ∞ rather than a point on the grid.
    """
    parsed = _parse_accuracy_rows(rows)
    methods = list(dict.fromkeys(item["method"] for item in parsed))
    shots = sorted({item["shots"] for item in parsed})
    alphas = sorted({item["alpha"] for item in parsed if item["alpha"] is not None})
    has_balanced = any(item["alpha"] is None for item in parsed)
    colour = dict(zip(methods, _colours(len(methods))))
    position = {alpha: float(i) for i, alpha in enumerate(alphas)}
    balanced_x = len(alphas) + 0.5 if alphas else 0.0

    width = 1.0 + 4.2 * len(shots)
    figure = _new_figure(width, 4.2)
    axes = figure.subplots(1, len(shots), sharey=True, squeeze=False)[0]
    for ax, shot in zip(axes, shots):
        for method in methods:
            mine = [item for item in parsed if item["method"] == method and item["shots"] == shot]
            numeric = sorted((item for item in mine if item["alpha"] is not None), key=lambda item: item["alpha"])
            if numeric:
                x = np.array([position[item["alpha"]] for item in numeric])
                y = np.array([item["accuracy"] for item in numeric])
                ci = np.array([item["ci95"] for item in numeric])
                ax.fill_between(x, y - ci, y + ci, color=colour[method], alpha=0.2, linewidth=0)
                ax.plot(x, y, marker="o", markersize=4, color=colour[method], label=method,
                        gid=f"{ALPHA_LINE_GID}:{method}")
            for item in mine:
                if item["alpha"] is None:
                    # spread the methods a little around the balanced position, so their CI bars stay readable
                    spread = 0.08 * (methods.index(method) - (len(methods) - 1) / 2)
                    container = ax.errorbar([balanced_x + spread], [item["accuracy"]], yerr=[item["ci95"]], fmt="s",
                                            markersize=5, capsize=4, color=colour[method])
                    container.lines[0].set_gid(f"{BALANCED_POINT_GID}:{method}")
        ticks = [position[a] for a in alphas]
        labels = [f"{a:g}" for a in alphas]
        if has_balanced:
            ticks.append(balanced_x)
            labels.append(BALANCED)
            if alphas:
                ax.axvline((len(alphas) - 1 + balanced_x) / 2, color="0.5", linestyle=":",
                           linewidth=1.0)
        ax.set_xticks(ticks, labels)
        ax.set_xlim(min(ticks) - 0.5, max(ticks) + 0.5)
        ax.set_xlabel("Dirichlet α")
        ax.set_title(f"{shot}-shot")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    handles = [Line2D([], [], color=colour[m], marker="o", markersize=5, label=m) for m in methods]
    columns = max(1, min(len(methods), int(width / 1.6)))  # about 1.6 inch per method name: nothing clipped
    figure.legend(handles=handles, loc="outside lower center", ncols=columns, frameon=False)
    return figure


def plot_accuracy_vs_alpha(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Accuracy (mean, shaded 95% CI) against the Dirichlet α of the query imbalance, per method and shot.

    Reproduces the robustness-to-imbalance figure of Tian et al., ICCV 2023: methods that assume a uniform class
    prior lose accuracy as α shrinks (stronger imbalance), PUTM should degrade least. ``rows`` are summary dicts
    as in results.csv (``method``, ``shots``, ``alpha`` — a number or ``"balanced"`` —, ``accuracy``, ``ci95``;
    strings are accepted); a truthy ``oracle_prior`` column labels the method as such. Returns the PNG path.
    """
    return _save_png(_accuracy_vs_alpha_figure(rows), path)


# ------------------------------------------------------------------------------------ true vs estimated counts


def _short_class_name(name: str, limit: int = 30) -> str:
    """A tick label: dataset class names can be long paths (Omniglot's alphabet/character/rotation); keep the
    last path parts that fit in ``limit`` characters."""
    if len(name) <= limit:
        return name
    parts = name.replace("\\", "/").split("/")
    kept = parts[-1]
    for part in reversed(parts[:-1]):
        if len(part) + 1 + len(kept) > limit:
            break
        kept = f"{part}/{kept}"
    return kept if len(kept) <= limit else "…" + kept[-(limit - 1):]


def _query_counts_figure(true_counts: Sequence[float], estimated_counts: Sequence[float],
                         class_names: Sequence[str] | None = None, title: str | None = None) -> Figure:
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
    if class_names is None:
        names = [f"class {k}" for k in range(true.size)]
    else:
        names = [str(name) for name in class_names]
        if len(names) != true.size:
            raise ValueError(f"class_names has {len(names)} entries but there are {true.size} classes")

    figure = _new_figure(max(4.5, 1.1 * true.size + 1.5), 4.0)
    ax: Axes = figure.subplots()
    x = np.arange(true.size)
    width = 0.38
    true_bars = ax.bar(x - width / 2, true, width, color="0.55", label="true query count")
    estimated_bars = ax.bar(x + width / 2, estimated, width, color=colormaps["tab10"](0),
                            label="PUTM estimate (Σ_j π_f(k|j))")
    ax.bar_label(true_bars, labels=[_format_number(v) for v in true], padding=2, fontsize=8)
    ax.bar_label(estimated_bars, labels=[f"{v:.1f}" for v in estimated], padding=2, fontsize=8)
    short = [_short_class_name(name) for name in names]
    long_names = max(len(name) for name in short) > 8
    ax.set_xticks(x, short, rotation=30 if long_names else 0, ha="right" if long_names else "center",
                  fontsize=8 if long_names else None)
    ax.set_ylabel("queries per class")
    ax.set_ylim(0, max(float(true.max()), float(estimated.max()), 1.0) * 1.35)  # headroom for the legend
    ax.legend(frameon=False, loc="upper center", ncols=2, fontsize=8)
    ax.set_title(title or "class prior of the query set: true vs estimated")
    return figure


def plot_query_counts(true_counts: Sequence[float], estimated_counts: Sequence[float],
                      path: str | os.PathLike[str], class_names: Sequence[str] | None = None,
                      title: str | None = None) -> Path:
    """Grouped bars of the true per-class query counts and PUTM's estimate Σ_j π_f(k|j).

    Reproduces the prior case study of Tian et al., ICCV 2023: the forward navigator should recover the
    imbalanced class marginal of the query set, which uniform-prior methods cannot. Returns the PNG path.
    """
    return _save_png(_query_counts_figure(true_counts, estimated_counts, class_names, title), path)


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
                        seed: int = 0, title: str | None = None) -> Path:
    """t-SNE of one task: queries by true class with the support-mean and the PUTM-refined prototypes.

    Reproduces the prototype visualisation of Tian et al., ICCV 2023: under imbalance the support means sit off
    the query clusters, the CT-EM refinement should move each prototype into its class's cluster. One t-SNE is
    fitted on all points (queries, support, both prototype sets) so the two panels share coordinates; arrows in
    the second panel show each prototype's move. Inputs are torch tensors or arrays: queries [Q, m], labels [Q]
    (task-relative 0..N-1), prototypes [N, m], optional support [S, m] with labels [S]. Returns the PNG path.
    """
    return _save_png(_prototype_tsne_figure(queries, query_labels, initial_prototypes, refined_prototypes,
                                            support, support_labels, seed, title), path)


def _prototype_tsne_figure(queries: Any, query_labels: Any, initial_prototypes: Any, refined_prototypes: Any,
                           support: Any = None, support_labels: Any = None, seed: int = 0,
                           title: str | None = None) -> Figure:
    """Build (without saving) the two-panel prototype t-SNE figure."""
    q, y, p0, p1, s, sy = _validate_tsne_inputs(queries, query_labels, initial_prototypes, refined_prototypes,
                                                 support, support_labels)
    embedded = _tsne_embedding(np.concatenate([q, s, p0, p1]), seed)
    n_q, n_s, n_c = q.shape[0], s.shape[0], p0.shape[0]
    eq = embedded[:n_q]
    es = embedded[n_q:n_q + n_s]
    e0 = embedded[n_q + n_s:n_q + n_s + n_c]
    e1 = embedded[n_q + n_s + n_c:]
    colours = np.array(_colours(n_c))

    figure = _new_figure(10.0, 5.0)
    before, after = figure.subplots(1, 2, sharex=True, sharey=True)
    for ax, prototypes, panel_title in ((before, e0, "before refinement (support means)"),
                                        (after, e1, "after PUTM refinement")):
        ax.scatter(eq[:, 0], eq[:, 1], s=18, c=colours[y], alpha=0.75, linewidths=0)
        if n_s:
            ax.scatter(es[:, 0], es[:, 1], s=30, c=colours[sy], marker="s", edgecolors="black", linewidths=0.5)
        ax.scatter(prototypes[:, 0], prototypes[:, 1], s=260, c=colours, marker="*", edgecolors="black",
                   linewidths=0.9, zorder=3)
        ax.set_title(panel_title)
        ax.set_xticks([])
        ax.set_yticks([])
    after.scatter(e0[:, 0], e0[:, 1], s=120, marker="*", facecolors="none", edgecolors=colours, linewidths=0.8,
                  zorder=2)
    for k in range(n_c):
        after.annotate("", xy=tuple(e1[k]), xytext=tuple(e0[k]),
                       arrowprops={"arrowstyle": "->", "color": colours[k], "linewidth": 0.8,
                                   "shrinkA": 4, "shrinkB": 6})
    handles = [Line2D([], [], linestyle="", marker="o", color="0.4", label="query (true class colour)"),
               Line2D([], [], linestyle="", marker="*", markersize=12, color="0.4", markeredgecolor="black",
                      label="prototype")]
    if n_s:
        handles.insert(1, Line2D([], [], linestyle="", marker="s", color="0.4", markeredgecolor="black",
                                 label="support"))
    handles += [Line2D([], [], linestyle="", marker="o", color=colours[k], label=f"class {k}") for k in range(n_c)]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), frameon=False,
                  fontsize=8)
    if title:
        figure.suptitle(title)
    return figure
