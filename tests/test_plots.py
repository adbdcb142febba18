"""Report figures (lightning_putm.evaluation.plots): valid PDFs and 300-DPI PNGs, display names, typeset α, error
bars on every point, one class naming across the task plots, a style that does not leak, clear errors, atomic
writes."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from lightning_putm.evaluation.plots import (ALPHA_LINE_GID, BALANCED_POINT_GID, _accuracy_vs_alpha_figure,
                                             _query_counts_figure, _tsne_embedding, plot_accuracy_vs_alpha,
                                             plot_prototype_tsne, plot_query_counts)


def assert_valid_png(path: Path) -> None:
    assert path.is_file() and path.suffix == ".png"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(image[..., :3].std()) > 0.0, "image is blank"
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        p.name for p in path.parent.iterdir() if not p.name.startswith(".")), "temporary file left behind"


def summary_rows(methods=("putm", "ptmap"), shots=(1, 5), alphas=("0.5", "2", "balanced")) -> list[dict]:
    rows = []
    for m, method in enumerate(methods):
        for shot in shots:
            for a, alpha in enumerate(alphas):
                rows.append({"method": method, "shots": shot, "alpha": alpha,
                             "accuracy": 60.0 + 5 * m + 10 * (shot > 1) + a, "ci95": 0.4 + 0.1 * a,
                             "tasks": 100, "seconds": 1.0, "oracle_prior": "false"})
    return rows


def as_csv_rows(rows: list[dict]) -> list[dict[str, str]]:
    """Round-trip through CSV text, as when reading results.csv back: every value becomes a string."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return list(csv.DictReader(io.StringIO(buffer.getvalue())))


def data_lines(ax, prefix: str) -> list:
    return [line for line in ax.get_lines() if (line.get_gid() or "").startswith(prefix + ":")]


# ---------------------------------------------------------------------------------------------- accuracy vs α


def test_accuracy_vs_alpha_from_csv_strings(tmp_path: Path) -> None:
    rows = as_csv_rows(summary_rows())
    assert all(isinstance(v, str) for row in rows for v in row.values())
    path = plot_accuracy_vs_alpha(rows, tmp_path / "acc.png")
    assert path == tmp_path / "acc.png"
    assert_valid_png(path)


def test_accuracy_vs_alpha_one_panel_per_shot_one_line_per_method() -> None:
    methods, shots = ("putm", "ptmap", "tim"), (1, 3, 5)
    figure = _accuracy_vs_alpha_figure(as_csv_rows(summary_rows(methods, shots, ("4", "0.5", "1", "balanced"))))
    axes = figure.get_axes()
    assert len(axes) == len(shots)
    assert [ax.get_title() for ax in axes] == ["1-shot", "3-shot", "5-shot"]
    assert axes[0].get_ylabel() == "Accuracy (%)"
    for ax in axes:
        lines = data_lines(ax, ALPHA_LINE_GID)
        assert sorted(line.get_label() for line in lines) == sorted(["PUTM", "PT-MAP", "TIM"])
        for line in lines:  # α sorted ascending at evenly spaced positions (each method dodged by a constant)
            x = np.asarray(line.get_xdata())
            np.testing.assert_allclose(np.diff(x), [1.0, 1.0])
            assert abs(x[0]) < 0.5
        # methods are dodged apart: no two methods share an x position
        assert len({float(line.get_xdata()[0]) for line in lines}) == len(methods)
        assert len(data_lines(ax, BALANCED_POINT_GID)) == len(methods)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0.5", "1", "4", "balanced"]
        assert ax.get_xlabel() == r"Dirichlet concentration $\alpha$"
    # same colour for a method in every panel
    colours = [{line.get_label(): line.get_color() for line in data_lines(ax, ALPHA_LINE_GID)} for ax in axes]
    assert colours[0] == colours[1] == colours[2]
    assert len(figure.legends) == 1


def test_accuracy_vs_alpha_balanced_only(tmp_path: Path) -> None:
    rows = summary_rows(shots=(5,), alphas=("balanced",))
    figure = _accuracy_vs_alpha_figure(rows)
    (ax,) = figure.get_axes()
    assert data_lines(ax, ALPHA_LINE_GID) == []
    assert len(data_lines(ax, BALANCED_POINT_GID)) == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["balanced"]
    assert_valid_png(plot_accuracy_vs_alpha(rows, tmp_path / "balanced.png"))


def test_accuracy_vs_alpha_labels_oracle_prior_rows() -> None:
    rows = summary_rows(methods=("ptmap",), shots=(1,))
    rows += [dict(row, oracle_prior="true") for row in rows]
    (ax,) = _accuracy_vs_alpha_figure(rows).get_axes()
    assert sorted(line.get_label() for line in data_lines(ax, ALPHA_LINE_GID)) == ["PT-MAP", "PT-MAP (oracle prior)"]
    styles = {line.get_label(): line for line in data_lines(ax, ALPHA_LINE_GID)}
    fair, oracle = styles["PT-MAP"], styles["PT-MAP (oracle prior)"]
    assert fair.get_color() == oracle.get_color() and fair.get_marker() == oracle.get_marker()
    assert fair.get_linestyle() == "-" and oracle.get_linestyle() == "--"


@pytest.mark.parametrize(("rows", "message"), [
    ([], "no result rows"),
    ([{"method": "PUTM", "shots": 1, "alpha": "2", "accuracy": 70.0}], "missing key.*ci95"),
    ([{"method": "PUTM", "shots": "one", "alpha": "2", "accuracy": 70, "ci95": 1}], "shots"),
    ([{"method": "PUTM", "shots": 1, "alpha": "-1", "accuracy": 70, "ci95": 1}], "alpha"),
    ([{"method": "PUTM", "shots": 1, "alpha": "2", "accuracy": "n/a", "ci95": 1}], "accuracy"),
    ([{"method": "PUTM", "shots": 1, "alpha": "2", "accuracy": 70, "ci95": 1}] * 2, "duplicate"),
])
def test_accuracy_vs_alpha_rejects_bad_rows(tmp_path: Path, rows, message) -> None:
    with pytest.raises(ValueError, match=message):
        plot_accuracy_vs_alpha(rows, tmp_path / "bad.png")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ true vs estimated


def test_query_counts_png_and_annotations(tmp_path: Path) -> None:
    true, estimated = [30, 2, 15, 0, 28], [27.64, 3.21, 16.0, 0.49, 27.66]
    figure = _query_counts_figure(true, estimated, class_names=list("abcde"), title="task 0")
    (ax,) = figure.get_axes()
    texts = [t.get_text() for t in ax.texts]
    for count in true:
        assert str(count) in texts
    for value in estimated:
        assert f"{value:.1f}" in texts
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcde")
    path = plot_query_counts(torch.tensor(true), np.array(estimated), tmp_path / "sub" / "counts.png")
    assert_valid_png(path)


@pytest.mark.parametrize(("true", "estimated", "names", "message"), [
    ([1, 2, 3], [1.0, 2.0], None, "3 classes.*2"),
    ([], [], None, "empty"),
    ([1, -2], [1.0, 2.0], None, "non-negative"),
    ([1, 2], [1.0, 2.0], ["a"], "class_names has 1"),
])
def test_query_counts_rejects_bad_input(tmp_path: Path, true, estimated, names, message) -> None:
    with pytest.raises(ValueError, match=message):
        plot_query_counts(true, estimated, tmp_path / "bad.png", class_names=names)


# ---------------------------------------------------------------------------------------------- prototype t-SNE


def tiny_task(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.randn(5, 8, generator=generator)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 4, 4])
    queries = centres[labels] + 0.3 * torch.randn(10, 8, generator=generator)
    support = centres + 0.5 * torch.randn(5, 8, generator=generator)
    refined = 0.5 * (support + centres)
    return queries, labels, support, refined


def test_prototype_tsne_tiny_task(tmp_path: Path) -> None:
    queries, labels, support, refined = tiny_task()
    path = plot_prototype_tsne(queries, labels, support, refined, tmp_path / "tsne.png",
                               support=support, support_labels=torch.arange(5), seed=1, title="one task")
    assert_valid_png(path)
    path = plot_prototype_tsne(queries.numpy(), labels.numpy(), support.numpy(), refined.numpy(),
                               tmp_path / "tsne_np.png")
    assert_valid_png(path)


def test_tsne_embedding_is_deterministic_for_a_seed() -> None:
    queries, _, support, refined = tiny_task()
    points = torch.cat([queries, support, refined]).numpy().astype(np.float64)
    first = _tsne_embedding(points, seed=3)
    assert first.shape == (20, 2)
    np.testing.assert_array_equal(first, _tsne_embedding(points, seed=3))


@pytest.mark.parametrize(("change", "message"), [
    ({"queries": torch.zeros(10)}, r"queries must be a non-empty \[Q, m\]"),
    ({"query_labels": torch.zeros(9, dtype=torch.long)}, r"query_labels must have shape \[10\]"),
    ({"query_labels": torch.full((10,), 7)}, r"\[0, 5\)"),
    ({"refined_prototypes": torch.zeros(4, 8)}, "refined_prototypes has shape"),
    ({"initial_prototypes": torch.zeros(5, 6), "refined_prototypes": torch.zeros(5, 6)}, "8 features"),
    ({"support": torch.zeros(5, 8)}, "both `support` and `support_labels`"),
])
def test_prototype_tsne_rejects_bad_shapes(tmp_path: Path, change, message) -> None:
    queries, labels, support, refined = tiny_task()
    kwargs = {"queries": queries, "query_labels": labels, "initial_prototypes": support,
              "refined_prototypes": refined, "path": tmp_path / "bad.png"}
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        plot_prototype_tsne(**kwargs)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ atomic writes


def test_failed_save_keeps_previous_png_and_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    path = plot_query_counts([3, 1], [2.5, 1.5], tmp_path / "counts.png")
    before = path.read_bytes()
    pdf_before = path.with_suffix(".pdf").read_bytes()

    def broken_savefig(self, fname, **kwargs):  # half a file, then a failure (fname: a path or an open file)
        fname.write(b"partial") if hasattr(fname, "write") else Path(fname).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        plot_query_counts([1, 3], [1.5, 2.5], path)
    assert path.read_bytes() == before
    assert path.with_suffix(".pdf").read_bytes() == pdf_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counts.pdf", "counts.png"]


def test_long_class_names_are_shortened_to_their_last_path_parts_on_the_count_plot(tmp_path):
    from lightning_putm.evaluation.plots import _query_counts_figure

    names = ["images_evaluation/Malayalam/character30/rot000", "images_evaluation/Syriac_(Serto)/character11/rot180",
             "digit 5"]
    figure = _query_counts_figure([2, 4, 5], [2.0, 4.0, 5.0], class_names=names)
    labels = [tick.get_text() for tick in figure.axes[0].get_xticklabels()]
    assert labels == ["Malayalam/character30/rot000", "character11/rot180", "digit 5"]


# ------------------------------------------------------------------------------------------ paper-ready output

ALL_METHODS = ["putm", "simpleshot", "protonet", "ptmap", "tim", "alpha_tim", "bdcspn", "laplacianshot", "ilpc",
               "bavardage"]
DISPLAY = {"putm": "PUTM", "simpleshot": "SimpleShot", "protonet": "ProtoNet", "ptmap": "PT-MAP", "tim": "TIM",
           "alpha_tim": "α-TIM", "bdcspn": "BD-CSPN", "laplacianshot": "LaplacianShot", "ilpc": "iLPC",
           "bavardage": "BAVARDAGE", "alpha_am": "α-AM", "unem": "UNEM"}
OMNIGLOT = ["images_evaluation/Malayalam/character30/rot000", "images_evaluation/Syriac_(Serto)/character11/rot180",
            "images_evaluation/Bengali/character02/rot090", "images_evaluation/Kannada/character07/rot270",
            "images_evaluation/Atlantean/character13/rot000"]


def assert_pdf(path: Path) -> bytes:
    data = path.read_bytes()
    assert data.startswith(b"%PDF-") and data.rstrip().endswith(b"%%EOF"), f"{path} is not a complete PDF"
    return data


def png_inches(path: Path) -> tuple[float, float]:
    """Printed size of a PNG from its pixel size and the DPI stored in its pHYs chunk (which must be 300)."""
    from PIL import Image

    with Image.open(path) as image:
        image.load()
        dpi = image.info.get("dpi")
        assert dpi is not None and dpi == pytest.approx((300, 300), rel=1e-3), f"PNG DPI is {dpi}"
        return image.size[0] / dpi[0], image.size[1] / dpi[1]


def test_every_figure_is_a_pdf_next_to_a_300_dpi_png_at_column_width(tmp_path: Path) -> None:
    queries, labels, support, refined = tiny_task()
    one_shot = plot_accuracy_vs_alpha(summary_rows(shots=(1,)), tmp_path / "acc1.png")
    two_shots = plot_accuracy_vs_alpha(summary_rows(shots=(1, 5)), tmp_path / "acc2.png")
    counts = plot_query_counts([3, 1], [2.5, 1.5], tmp_path / "counts.png")
    tsne = plot_prototype_tsne(queries, labels, support, refined, tmp_path / "tsne.png")
    for png in (one_shot, two_shots, counts, tsne):
        assert_valid_png(png)
        data = assert_pdf(png.with_suffix(".pdf"))
        assert b"/Type3" not in data, "fonts must be embedded as TrueType (Type 42), not Type 3"
    single, double = 3.4, 7.0
    for png, width in ((one_shot, single), (counts, single), (two_shots, double), (tsne, double)):
        inches = png_inches(png)[0]
        assert width - 0.3 < inches <= width + 0.05, f"{png.name} is {inches:.2f} in wide, expected ~{width}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{n}.{ext}" for n in ("acc1", "acc2", "counts", "tsne") for ext in ("pdf", "png"))


def test_svg_on_request_and_bad_formats_fail_before_writing(tmp_path: Path) -> None:
    path = plot_query_counts([3, 1], [2.5, 1.5], tmp_path / "counts.pdf", formats=("svg",))
    assert path == tmp_path / "counts.pdf"
    assert_pdf(path)
    assert b"<svg" in (tmp_path / "counts.svg").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counts.pdf", "counts.svg"]
    with pytest.raises(ValueError, match=r"must end in one of \.png, \.pdf, \.svg"):
        plot_query_counts([3, 1], [2.5, 1.5], tmp_path / "other" / "counts.jpg")
    with pytest.raises(ValueError, match="unknown figure format.*eps"):
        plot_query_counts([3, 1], [2.5, 1.5], tmp_path / "other" / "counts.png", formats=("png", "eps"))
    assert not (tmp_path / "other").exists()


def test_registry_display_names() -> None:
    from lightning_putm.methods import available_methods, method_display_name

    assert sorted(available_methods()) == sorted(DISPLAY)
    assert {name: method_display_name(name) for name in available_methods()} == DISPLAY
    assert method_display_name("my_method") == "my_method"  # unknown or user-registered: the code name


def test_legend_shows_display_names_in_run_order() -> None:
    from lightning_putm.evaluation.plot_style import legend_labels

    rows = summary_rows(methods=ALL_METHODS + ["my_method"], shots=(1,), alphas=("1", "2", "balanced"))
    figure = _accuracy_vs_alpha_figure(rows)
    assert legend_labels(figure) == [DISPLAY[m] for m in ALL_METHODS] + ["my_method"]


def test_ten_methods_get_distinct_styles_that_do_not_depend_on_the_other_methods() -> None:
    def styles(methods):
        (ax,) = _accuracy_vs_alpha_figure(summary_rows(methods=methods, shots=(1,))).get_axes()
        return {line.get_label(): (line.get_color(), line.get_marker()) for line in data_lines(ax, ALPHA_LINE_GID)}

    everything = styles(ALL_METHODS)
    assert len({colour for colour, _ in everything.values()}) == 10
    assert len({marker for _, marker in everything.values()}) == 10
    assert styles(["ptmap", "putm"]) == {"PT-MAP": everything["PT-MAP"], "PUTM": everything["PUTM"]}
    # a method outside the built-in list takes a slot no shown method uses
    custom = styles(["putm", "my_method"])
    assert custom["my_method"] != custom["PUTM"]


def test_error_bars_on_every_point_also_with_a_single_alpha() -> None:
    rows = summary_rows(methods=("putm", "ptmap"), shots=(1,), alphas=("2", "balanced"))
    (ax,) = _accuracy_vs_alpha_figure(rows).get_axes()
    expected = {(DISPLAY[r["method"]], r["alpha"]): (r["accuracy"], r["ci95"]) for r in rows}
    checked = 0
    for container in ax.containers:
        data_line = container.lines[0]
        gid = data_line.get_gid() or ""
        if not gid.startswith((ALPHA_LINE_GID, BALANCED_POINT_GID)):
            continue
        method = gid.split(":", 1)[1]
        alpha = "2" if gid.startswith(ALPHA_LINE_GID) else "balanced"
        accuracy, ci = expected[(method, alpha)]
        assert container.has_yerr
        (bars,) = container.lines[2]
        (segment,) = bars.get_segments()
        assert sorted(segment[:, 1]) == pytest.approx([accuracy - ci, accuracy + ci])
        assert len(container.lines[1]) == 2, "error bars must be capped"
        checked += 1
    assert checked == 4  # two methods × (α = 2, balanced)


def test_alpha_is_typeset_everywhere() -> None:
    figure = _accuracy_vs_alpha_figure(summary_rows(shots=(1, 5)))
    texts = [ax.get_xlabel() for ax in figure.get_axes()] + [ax.get_title() for ax in figure.get_axes()]
    assert all(label == r"Dirichlet concentration $\alpha$" for label in texts[:2])
    assert not any("alpha" in text.replace(r"$\alpha$", "") for text in texts)


def test_count_plot_and_tsne_name_and_colour_classes_identically() -> None:
    from matplotlib.colors import to_rgba

    from lightning_putm.evaluation.plots import _prototype_tsne_figure

    queries, labels, support, refined = tiny_task()
    counts = _query_counts_figure([3, 2, 2, 1, 2], [2.5, 2.0, 2.1, 1.2, 2.2], class_names=OMNIGLOT)
    (ax,) = counts.get_axes()
    count_labels = [tick.get_text() for tick in ax.get_xticklabels()]
    estimate_bars = next(c for c in ax.containers if c.patches[0].get_gid() == "estimated-counts")
    count_colours = [to_rgba(patch.get_facecolor()) for patch in estimate_bars.patches]

    tsne = _prototype_tsne_figure(queries, labels, support, refined, support=support,
                                  support_labels=torch.arange(5), class_names=OMNIGLOT)
    (legend,) = tsne.legends
    tsne_colours = {text.get_text(): to_rgba(handle.get_color())
                    for text, handle in zip(legend.get_texts(), legend.legend_handles)}
    assert count_labels == ["Malayalam/character30/rot000", "character11/rot180", "Bengali/character02/rot090",
                            "Kannada/character07/rot270", "Atlantean/character13/rot000"]
    assert [tsne_colours[label] for label in count_labels] == count_colours
    assert len(set(count_colours)) == 5


def test_class_labels_stay_distinct_and_default_to_indices() -> None:
    from lightning_putm.evaluation.plots import class_labels

    long = "a_very_long_alphabet_name_that_is_dropped"
    names = [f"{long}_one/character11/rot180", f"{long}_two/character11/rot180", "digit 5"]
    assert class_labels(names, 3) == ["character11/rot180 [0]", "character11/rot180 [1]", "digit 5"]
    assert class_labels(None, 2) == ["class 0", "class 1"]
    with pytest.raises(ValueError, match="class_names has 3 entries but there are 2 classes"):
        class_labels(names, 2)


def test_paper_style_is_applied_to_the_figures_and_never_leaks(tmp_path: Path) -> None:
    import matplotlib

    from lightning_putm.evaluation.plot_style import PAPER_RC, paper_style

    before = dict(matplotlib.rcParams)
    figure = _accuracy_vs_alpha_figure(summary_rows(shots=(1,)))
    (ax,) = figure.get_axes()
    assert not ax.spines["top"].get_visible() and not ax.spines["right"].get_visible()
    assert ax.title.get_fontsize() == PAPER_RC["axes.titlesize"]
    assert "serif" in ax.xaxis.label.get_fontfamily()
    plot_accuracy_vs_alpha(summary_rows(shots=(1,)), tmp_path / "acc.png")
    plot_query_counts([3, 1], [2.5, 1.5], tmp_path / "counts.png")
    assert dict(matplotlib.rcParams) == before
    with paper_style(**{"font.size": 11.0}):
        assert matplotlib.rcParams["font.size"] == 11.0 and matplotlib.rcParams["pdf.fonttype"] == 42
    assert dict(matplotlib.rcParams) == before


def test_wandb_gets_the_pngs_and_not_the_pdfs(tmp_path: Path, monkeypatch) -> None:
    import sys
    import types

    from lightning_putm.evaluation.records import Summary
    from lightning_putm.evaluation.report import log_to_wandb

    images: list[str] = []
    fake = types.SimpleNamespace(Table=lambda **kwargs: kwargs, Image=lambda path: images.append(path) or path,
                                 plot=types.SimpleNamespace(line_series=lambda **kwargs: kwargs))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    png = plot_query_counts([3, 1], [2.5, 1.5], tmp_path / "counts.png")
    logged: list[dict] = []
    run = types.SimpleNamespace(log=logged.append)
    log_to_wandb(run, [Summary("putm", 1, 2.0, 70.0, 1.0)], {"counts": png, "counts_pdf": png.with_suffix(".pdf")},
                 "fewshot")
    assert images == [str(png)]
    assert "fewshot/plots/counts" in logged[0] and "fewshot/plots/counts_pdf" not in logged[0]


# ------------------------------------------------------------------------------------------ what a figure says


def test_accuracy_vs_alpha_title_names_features_task_shape_tasks_and_the_bars() -> None:
    # kills: a figure that, seen alone, does not say what it measured or what its bars are
    figure = _accuracy_vs_alpha_figure(summary_rows(shots=(1, 5)), dataset="omniglot/test (best.ckpt)", ways=5,
                                       queries=75)
    title = figure._suptitle.get_text()
    assert title.splitlines() == ["omniglot/test (best.ckpt): 5-way, 75 queries, 100 tasks per point",
                                  "mean accuracy over the tasks; bars: 95% CI"]
    rows = summary_rows(shots=(1,))
    rows[0]["tasks"] = 20
    assert "20–100 tasks per point" in _accuracy_vs_alpha_figure(rows)._suptitle.get_text()
    assert _accuracy_vs_alpha_figure(summary_rows(shots=(1,)), title="")._suptitle is None


def test_case_study_captions_and_dataset_labels() -> None:
    from lightning_putm.evaluation.plot_style import dataset_label, task_caption

    assert dataset_label("/runs/x/best.ckpt on omniglot/test") == "omniglot/test (best.ckpt)"
    assert dataset_label("/data/features/novel.pt") == "novel.pt"
    assert dataset_label("sklearn.datasets.load_digits") == "sklearn.datasets.load_digits"
    assert dataset_label(None) is None
    assert task_caption(1, "2", 0, "omniglot/test (best.ckpt)", 5, 75) == \
        r"omniglot/test (best.ckpt): 5-way 1-shot, 75 queries, $\alpha$ = 2, task 0"
    assert task_caption(5, "balanced", 3) == "5-shot, balanced, task 3"


def test_tsne_queries_are_coloured_by_their_true_class_and_the_legend_says_so() -> None:
    # kills: colouring queries by anything but the labels given, or a legend silent on what colour and marker mean
    from matplotlib.colors import to_rgba_array

    from lightning_putm.evaluation.plots import QUERY_LEGEND, _prototype_tsne_figure
    from lightning_putm.evaluation.plot_style import class_colours, legend_labels

    queries, labels, support, refined = tiny_task()
    figure = _prototype_tsne_figure(queries, labels, support, refined, support=support,
                                    support_labels=torch.arange(5))
    expected = to_rgba_array(class_colours(5))[labels.numpy()][:, :3]
    for ax in figure.get_axes():
        query_points = ax.collections[0]  # drawn first: the queries
        assert len(query_points.get_offsets()) == len(labels)
        np.testing.assert_allclose(query_points.get_facecolors()[:, :3], expected)
    texts = legend_labels(figure)
    assert QUERY_LEGEND in texts and "true class" in QUERY_LEGEND
    assert {"support sample", "prototype (left: support mean; right: refined)",
            "support mean, before (right)"} <= set(texts)
