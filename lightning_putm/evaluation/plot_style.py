"""The house style of every figure: paper-ready sizes and fonts, one colour and marker per method, captions that
say what was measured, and atomic saving as PDF + 300-DPI PNG (SVG on request).

Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot, no global figure registry), and the
style is applied with ``rc_context`` only while drawing, so it never leaks into the caller's settings.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from lightning_putm.atomic import atomic_savefig
from lightning_putm.methods import method_display_name, method_order


BALANCED = "balanced"
UNIFORM = "uniform"
#: Raster resolution of the PNGs (print quality); the PDF/SVG are vector and resolution-free.
DPI = 300


#: Formats written for every figure: the PNG (for W&B and quick looks) and the PDF a paper includes.
DEFAULT_FORMATS: tuple[str, ...] = ("png", "pdf")


SUPPORTED_FORMATS: tuple[str, ...] = ("png", "pdf", "svg")


#: Text widths of a two-column conference page (CVPR/ICCV/NeurIPS): one column and the full text width.
SINGLE_COLUMN_INCHES = 3.4


DOUBLE_COLUMN_INCHES = 7.0


#: The paper style: serif text sized for a 3.4 in column (8 pt labels, 7 pt ticks and legend, as captions of
#: a 10 pt paper), thin axes without top/right spines, TrueType (Type 42) fonts so PDF checkers of IEEE/ACM
#: accept the file, tight bounding boxes, no timestamps in the files (identical inputs give identical PDFs).
PAPER_RC: dict[str, Any] = {
    "font.family": "serif",
    "font.serif": ["Times New Roman", "Times", "Nimbus Roman", "STIXGeneral", "DejaVu Serif"],
    "mathtext.fontset": "stix",
    "font.size": 8.0,
    "axes.titlesize": 8.0,
    "axes.labelsize": 8.0,
    "xtick.labelsize": 7.0,
    "ytick.labelsize": 7.0,
    "legend.fontsize": 7.0,
    "figure.titlesize": 8.5,
    "axes.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlepad": 4.0,
    "axes.labelpad": 2.5,
    "xtick.major.width": 0.6,
    "ytick.major.width": 0.6,
    "xtick.major.size": 2.5,
    "ytick.major.size": 2.5,
    "xtick.major.pad": 2.0,
    "ytick.major.pad": 2.0,
    "grid.linewidth": 0.4,
    "grid.color": "0.85",
    "lines.linewidth": 1.1,
    "lines.markersize": 3.8,
    "legend.frameon": False,
    "legend.handlelength": 2.0,
    "legend.columnspacing": 1.2,
    "legend.handletextpad": 0.4,
    "legend.borderaxespad": 0.2,
    "pdf.fonttype": 42,
    "ps.fonttype": 42,
    "svg.fonttype": "path",
    "svg.hashsalt": "lightning-putm",
    "savefig.dpi": DPI,
    "savefig.bbox": "tight",
    "savefig.pad_inches": 0.02,
    "figure.dpi": 100,
}


#: Colour-blind-safe colours: the Okabe–Ito palette (without its yellow, too faint on white) plus Paul Tol's
#: wine, olive, a mid grey, teal and indigo; with the marker as a second cue, twelve methods stay apart in greyscale
#: prints too.
PALETTE: tuple[str, ...] = ("#D55E00", "#0072B2", "#000000", "#E69F00", "#CC79A7", "#009E73", "#56B4E9",
                            "#882255", "#999933", "#777777", "#44AA99", "#332288")


MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p", "d", "*", "H", "8")


@contextmanager
def paper_style(**overrides: Any) -> Iterator[None]:
    """Apply :data:`PAPER_RC` inside the block (plus ``overrides``: rc names, e.g. ``**{"font.size": 9}``) and
    restore the caller's rcParams afterwards, so nothing leaks into the caller's matplotlib state.

    Usable for one's own figures too: ``with paper_style(): figure = Figure(figsize=(3.4, 2.4)); ...``.
    """
    with matplotlib.rc_context({**PAPER_RC, **overrides}):
        yield


@dataclass(frozen=True)
class MethodStyle:
    """How one method is drawn: colour, marker, line style and whether its markers are filled."""

    colour: str
    marker: str
    linestyle: str = "-"
    filled: bool = True


def method_styles(methods: Sequence[str | tuple[str, bool]]) -> dict[tuple[str, bool], MethodStyle]:
    """Colour and marker per ``(method code name, oracle_prior)``.

    Registered methods take fixed slots (their classes' ``plot_slot``: :func:`~lightning_putm.methods.method_order`),
    others the free slots in order of appearance, so
    the same method looks the same in every figure. An oracle-prior result shares its method's colour and
    marker but is drawn dashed with open markers: it is the same method given information a fair run lacks.
    """
    keys = [(m, False) if isinstance(m, str) else (str(m[0]), bool(m[1])) for m in methods]
    names = list(dict.fromkeys(name for name, _ in keys))
    order = method_order()
    slot = {name: order.index(name) for name in names if name in order}
    free_slots = (i for i in range(len(names) + len(order)) if i not in slot.values())
    for name in names:
        if name not in slot:
            slot[name] = next(free_slots)
    styles: dict[tuple[str, bool], MethodStyle] = {}
    for name, oracle in keys:
        s = slot[name]
        styles[(name, oracle)] = MethodStyle(colour=PALETTE[s % len(PALETTE)], marker=MARKERS[s % len(MARKERS)],
                                             linestyle="--" if oracle else "-", filled=not oracle)
    return styles


def display_label(method: str, oracle_prior: bool = False) -> str:
    """The name a figure prints: the method's display name, marked when it used the true query counts."""
    name = method_display_name(method)
    return f"{name} (oracle prior)" if oracle_prior else name


def class_colours(count: int) -> list[tuple[float, float, float, float]]:
    """One colour per class of a task: the colour-blind-safe :data:`PALETTE` without its black (black edges
    mark prototypes and support points) up to eleven classes, then tab20 and an evenly sampled continuous map
    (a 20+-way task cannot be told apart by colour alone anyway)."""
    palette = [c for c in PALETTE if c != "#000000"]
    if count <= len(palette):
        return [matplotlib.colors.to_rgba(c) for c in palette[:count]]
    if count <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(count)]
    cmap = colormaps["turbo"]
    return [cmap(i / max(count - 1, 1)) for i in range(count)]


def legend_labels(figure: Figure) -> list[str]:
    """The non-empty texts of every legend of ``figure`` (figure-level and per-axes), in drawing order."""
    legends = list(figure.legends) + [ax.get_legend() for ax in figure.get_axes() if ax.get_legend() is not None]
    return [text.get_text() for legend in legends for text in legend.get_texts() if text.get_text()]


def new_figure(width: float, height: float) -> Figure:
    """A figure bound to an Agg canvas (never to a GUI backend)."""
    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def column_width(width: str | float, wide: bool) -> float:
    """Inches for ``width``: ``"single"``, ``"double"``, a number, or ``"auto"`` (double when ``wide``)."""
    if isinstance(width, (int, float)) and not isinstance(width, bool):
        if not math.isfinite(width) or width <= 0:
            raise ValueError(f"figure width must be a positive number of inches, got {width!r}")
        return float(width)
    if width == "single":
        return SINGLE_COLUMN_INCHES
    if width == "double":
        return DOUBLE_COLUMN_INCHES
    if width == "auto":
        return DOUBLE_COLUMN_INCHES if wide else SINGLE_COLUMN_INCHES
    raise ValueError(f"figure width must be 'auto', 'single', 'double' or inches, got {width!r}")


# A figure seen alone (a slide, a W&B panel, a README) must say what it measured: the features it was computed
# on, the task shape, how many tasks stand behind each point and what the bars are.
def dataset_label(source: str | None) -> str | None:
    """A short name of a feature source: ``/runs/x/best.ckpt on omniglot/test`` → ``omniglot/test (best.ckpt)``,
    a feature file by its file name, anything else as it is."""
    if not source:
        return None
    text = str(source)
    if " on " in text:
        checkpoint, _, data = text.rpartition(" on ")
        return f"{data} ({Path(checkpoint).name})"
    return Path(text).name if ("/" in text or "\\" in text) else text


def protocol_text(ways: int | None = None, queries: int | None = None, tasks: Sequence[int] = (),
                  query_classes: int | None = None) -> str:
    """``5-way, 75 queries, 1000 tasks per point`` (each part only when known; ``100–1000`` when tasks differ);
    with K_eff ``20-way, 5 classes in the query set, 75 queries, ...``."""
    parts = []
    if ways:
        parts.append(f"{ways}-way")
    if query_classes is not None:
        parts.append(f"{query_classes} classes in the query set")
    if queries:
        parts.append(f"{queries} queries")
    known = sorted({int(t) for t in tasks if t})
    if known:
        count = str(known[0]) if len(known) == 1 else f"{known[0]}–{known[-1]}"
        parts.append(f"{count} task{'s' if known[-1] != 1 else ''} per point")
    return ", ".join(parts)


def task_caption(shots: int, alpha: str, task: int, dataset: str | None = None, ways: int | None = None,
                 queries: int | None = None, query_classes: int | None = None) -> str:
    """The line naming one task of a case-study figure: ``omniglot/test (best.ckpt): 5-way 1-shot, 75 queries,
    α = 1, task 0`` (with K_eff: ``20-way 1-shot, 5 classes in the query set, 75 queries, uniform, task 0``)."""
    shape = f"{ways}-way {shots}-shot" if ways else f"{shots}-shot"
    if query_classes is not None:
        shape += f", {query_classes} classes in the query set"
    if queries:
        shape += f", {queries} queries"
    imbalance = alpha if alpha in (BALANCED, UNIFORM) else rf"$\alpha$ = {alpha}"
    text = f"{shape}, {imbalance}, task {task}"
    return f"{dataset}: {text}" if dataset else text


def figure_paths(path: str | os.PathLike[str], formats: Sequence[str] = DEFAULT_FORMATS) -> list[Path]:
    """The files a figure saved to ``path`` consists of: ``path`` itself, then one sibling per extra format.

    ``plots/accuracy_vs_alpha.png`` with the default formats → ``[...png, ...pdf]``. Raises on an unknown format.
    """
    target = Path(path)
    primary = target.suffix.lower().lstrip(".")
    if primary not in SUPPORTED_FORMATS:
        raise ValueError(f"figure path {str(target)!r} must end in one of "
                         f"{', '.join('.' + f for f in SUPPORTED_FORMATS)}")
    wanted = [str(f).lower().lstrip(".") for f in formats]
    unknown = [f for f in wanted if f not in SUPPORTED_FORMATS]
    if unknown:
        raise ValueError(f"unknown figure format(s) {', '.join(unknown)}; supported: {', '.join(SUPPORTED_FORMATS)}")
    extra = [f for f in dict.fromkeys(wanted) if f != primary]
    return [target] + [target.with_suffix("." + f) for f in extra]


#: Metadata that would change on every save (creation dates); dropped so re-running a job rewrites identical files.
_METADATA = {"pdf": {"CreationDate": None}, "svg": {"Date": None}, "png": {}}


def save_figure(figure: Figure, paths: Sequence[Path]) -> Path:
    """Write ``figure`` to each path atomically (:func:`~lightning_putm.atomic.atomic_savefig`), release it, and
    return the first path."""
    try:
        with paper_style():
            for target in paths:
                fmt = target.suffix.lstrip(".").lower()
                atomic_savefig(figure, target, format=fmt, dpi=DPI, bbox_inches="tight", metadata=_METADATA[fmt])
    finally:
        figure.clear()
    return paths[0]


def format_number(value: float) -> str:
    return f"{int(round(value))}" if float(value).is_integer() else f"{value:g}"


def legend_columns(count: int, most: int) -> int:
    """Columns that spread ``count`` entries over as few, evenly filled rows as ``most`` columns allow."""
    rows = math.ceil(count / max(1, most))
    return max(1, math.ceil(count / max(1, rows)))


def method_legend(figure: Figure, styles: dict[tuple[str, bool], MethodStyle], keys: Sequence[tuple[str, bool]],
                  columns: int) -> None:
    """One legend entry per method (its colour, marker and line style, open markers for an oracle prior), below
    the panels: the legend of the accuracy figures (against α and against K_eff)."""
    handles = [Line2D([], [], color=styles[k].colour, marker=styles[k].marker, linestyle=styles[k].linestyle,
                      markeredgecolor=styles[k].colour, markeredgewidth=0.7,
                      markerfacecolor=styles[k].colour if styles[k].filled else "white",
                      label=display_label(*k)) for k in keys]
    figure.legend(handles=handles, loc="outside lower center", ncols=columns)


def accuracy_panel(ax: Axes, shot: int) -> None:
    """What every panel of an accuracy figure shares: the shot as its title, no x tick marks, horizontal grid
    lines behind the data."""
    ax.tick_params(axis="x", length=0)
    ax.set_title(f"{shot}-shot")
    ax.grid(True, axis="y")
    ax.set_axisbelow(True)

