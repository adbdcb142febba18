"""Report figures (lightning_putm.evaluation.plots): valid non-blank PNGs, the right artists, clear errors, atomic writes."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

from lightning_putm.evaluation.plots import (
    ALPHA_LINE_GID,
    BALANCED_POINT_GID,
    _accuracy_vs_alpha_figure,
    _query_counts_figure,
    _tsne_embedding,
    plot_accuracy_vs_alpha,
    plot_prototype_tsne,
    plot_query_counts,
)


def assert_valid_png(path: Path) -> None:
    assert path.is_file() and path.suffix == ".png"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(image[..., :3].std()) > 0.0, "image is blank"
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        p.name for p in path.parent.iterdir() if not p.name.startswith(".")), "temporary file left behind"


def summary_rows(methods=("PUTM", "PT-MAP"), shots=(1, 5), alphas=("0.5", "2", "balanced")) -> list[dict]:
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
    methods, shots = ("PUTM", "PT-MAP", "TIM"), (1, 3, 5)
    figure = _accuracy_vs_alpha_figure(as_csv_rows(summary_rows(methods, shots, ("4", "0.5", "1", "balanced"))))
    axes = figure.get_axes()
    assert len(axes) == len(shots)
    assert [ax.get_title() for ax in axes] == ["1-shot", "3-shot", "5-shot"]
    assert axes[0].get_ylabel() == "accuracy (%)"
    for ax in axes:
        lines = data_lines(ax, ALPHA_LINE_GID)
        assert sorted(line.get_label() for line in lines) == sorted(methods)
        for line in lines:  # α sorted ascending at evenly spaced positions
            assert list(line.get_xdata()) == [0.0, 1.0, 2.0]
        assert len(data_lines(ax, BALANCED_POINT_GID)) == len(methods)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0.5", "1", "4", "balanced"]
        assert ax.get_xlabel() == "Dirichlet α"
        assert len(ax.collections) >= len(methods)  # one CI band per method
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
    rows = summary_rows(methods=("PT-MAP",), shots=(1,))
    rows += [dict(row, oracle_prior="true") for row in rows]
    (ax,) = _accuracy_vs_alpha_figure(rows).get_axes()
    assert sorted(line.get_label() for line in data_lines(ax, ALPHA_LINE_GID)) == ["PT-MAP", "PT-MAP (oracle prior)"]


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

    def broken_savefig(self, fname, **kwargs):
        Path(fname).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        plot_query_counts([1, 3], [1.5, 2.5], path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["counts.png"]


def test_long_class_names_are_shortened_to_their_last_path_parts_on_the_count_plot(tmp_path):
    from lightning_putm.evaluation.plots import _query_counts_figure

    names = ["images_evaluation/Malayalam/character30/rot000", "images_evaluation/Syriac_(Serto)/character11/rot180",
             "digit 5"]
    figure = _query_counts_figure([2, 4, 5], [2.0, 4.0, 5.0], class_names=names)
    labels = [tick.get_text() for tick in figure.axes[0].get_xticklabels()]
    assert labels == ["Malayalam/character30/rot000", "character11/rot180", "digit 5"]
