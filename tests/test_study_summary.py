"""The study summary (lightning_putm.studies.summary): every point's metric with its 95% CI, computed as
documented and checked against hand computations; SimpleShot as a baseline in table and figure when the runs
evaluated it, a note saying how to add it when they did not; a legend naming exactly what the figure draws."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from lightning_putm.evaluation.plot_style import legend_labels
from lightning_putm.studies.summary import BASELINE_COLUMN, StudyRow, with_intervals
from lightning_putm.studies.summary_report import (BASELINE_GID, BEST_GID, METHOD_GID, METRIC_GID, RANGE_GID,
                                                   study_figure, write_study_summary)

MEAN = {"method": "putm", "shots": None, "alpha": None, "gainer": None, "other": None}
ONE_SETTING = {**MEAN, "shots": "1", "alpha": "2"}
GAIN = {"method": None, "shots": None, "alpha": None, "gainer": "putm", "other": "simpleshot"}

#: Per-task accuracies in percent of one run: (method, α) -> 4 tasks. Hand-computed below.
TASKS = {
    ("putm", "2"): [60, 70, 80, 50],         # mean 65, squared deviations 25+25+225+225 = 500
    ("putm", "balanced"): [70, 90, 80, 60],  # mean 75, 500 again
    ("simpleshot", "2"): [50, 60, 75, 35],   # mean 55
    ("simpleshot", "balanced"): [60, 60, 70, 50],  # mean 60
}


def hand_ci(squared_deviations: float, n: int = 4) -> float:
    """1.96 · sample sd / √n from the sum of squared deviations, worked out by hand in the comments."""
    return 1.96 * math.sqrt(squared_deviations / (n - 1)) / math.sqrt(n)


def write_run(folder: Path, tasks: dict[tuple[str, str], list[float]], per_task: bool = True) -> list[dict]:
    """A run folder with per_task.csv (accuracy as a fraction, as evaluate.py writes it); returns its settings."""
    folder.mkdir(parents=True, exist_ok=True)
    settings, rows = [], []
    for (method, alpha), values in tasks.items():
        mean = sum(values) / len(values)
        ci = hand_ci(sum((v - mean) ** 2 for v in values), len(values))
        settings.append({"method": method, "shots": 1, "alpha": alpha, "accuracy": mean, "ci95": ci})
        rows += [{"method": method, "shots": 1, "alpha": alpha, "task": t, "accuracy": f"{v / 100:.6f}",
                  "oracle_prior": "false"} for t, v in enumerate(values)]
    if per_task:
        with open(folder / "per_task.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return settings


def row(folder: Path, point: dict, metric: float, tasks=TASKS, parts=MEAN, per_task: bool = True) -> StudyRow:
    settings = write_run(folder, tasks, per_task)
    return with_intervals(StudyRow(point=point, metric=metric, key=folder.name, output_dir=str(folder),
                                   settings=settings), parts)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


# ------------------------------------------------------------------------------------------------ intervals


def test_mean_over_settings_pairs_tasks_by_index(tmp_path: Path) -> None:
    # kills: treating the settings as independent (√Σci²/n = 8.94), averaging their CIs (12.65), or ignoring pairing
    result = row(tmp_path / "run", {"rho": 0.5}, 70.0)
    # putm per-task means over the two settings: 65, 80, 80, 55 → mean 70, squared deviations 25+100+100+225 = 450
    assert result.interval.value == pytest.approx(70.0)
    assert result.interval.ci95 == pytest.approx(hand_ci(450), abs=1e-3)  # 12.00
    assert result.interval.tasks == 4 and "paired" in result.interval.how
    # SimpleShot, same metric: 55, 60, 72.5, 42.5 → mean 57.5, squared deviations 6.25+6.25+225+225 = 462.5
    assert result.baseline.value == pytest.approx(57.5)
    assert result.baseline.ci95 == pytest.approx(hand_ci(462.5), abs=1e-3)


def test_without_per_task_the_ci_is_the_mean_of_the_settings_cis(tmp_path: Path) -> None:
    # kills: a narrower fallback than the bound that holds whatever the correlation of the settings
    result = row(tmp_path / "run", {"rho": 0.5}, 70.0, per_task=False)
    assert result.interval.ci95 == pytest.approx(hand_ci(500), abs=1e-9)  # both settings: 500 → 12.65
    assert "upper bound" in result.interval.how and result.interval.tasks is None


def test_one_setting_metric_uses_that_settings_ci(tmp_path: Path) -> None:
    result = row(tmp_path / "run", {"rho": 0.5}, 65.0, parts=ONE_SETTING)
    assert result.interval.value == pytest.approx(65.0)
    assert result.interval.ci95 == pytest.approx(hand_ci(500), abs=1e-9)
    assert result.baseline.value == pytest.approx(55.0)  # SimpleShot at 1-shot α=2 only


def test_worst_margin_ci_is_the_paired_difference_at_the_worst_setting(tmp_path: Path) -> None:
    # margins: α=2 65−55 = 10, balanced 75−60 = 15 → worst α=2;
    # per-task differences there 10, 10, 5, 15 → mean 10, squared deviations 0+0+25+25 = 50
    result = row(tmp_path / "run", {"rho": 0.5}, 10.0, parts=GAIN)
    assert result.interval.value == pytest.approx(10.0)
    assert result.interval.ci95 == pytest.approx(hand_ci(50), abs=1e-3)
    assert result.interval.setting == "1-shot alpha=2"
    assert result.baseline is None  # a margin over SimpleShot: SimpleShot is the zero line, not a column


# ------------------------------------------------------------------------------------------------ files


def test_csv_and_markdown_carry_the_ci_and_the_baseline(tmp_path: Path) -> None:
    rows = [row(tmp_path / "runs" / "a", {"method.putm.rho": 0.5}, 70.0),
            row(tmp_path / "runs" / "b", {"method.putm.rho": 1.0}, 65.0,
                tasks={**TASKS, ("putm", "2"): [50, 60, 70, 40], ("putm", "balanced"): [60, 80, 70, 50]})]
    write_study_summary(rows, "fewshot/putm/acc", "maximize", ["method.putm.rho"], tmp_path, "mini", MEAN)
    records = read_csv(tmp_path / "summary.csv")
    first = next(r for r in records if r["method.putm.rho"] == "0.5")
    assert float(first["fewshot/putm/acc_ci95"]) == pytest.approx(hand_ci(450), abs=1e-3)
    assert float(first[BASELINE_COLUMN]) == pytest.approx(57.5)
    assert float(first[f"{BASELINE_COLUMN}_ci95"]) == pytest.approx(hand_ci(462.5), abs=1e-3)
    assert first["tasks"] == "4"
    text = (tmp_path / "summary.md").read_text()
    assert "| 0.5 | 70.00 ± 12.00 | 57.50 ± 12.17 |" in text
    assert text.index("| 0.5 |") < text.index("| 1.0 |")  # best first
    assert "SimpleShot (± 95% CI)" in text and "4 tasks per" in text and "not evaluated" not in text


def test_no_simpleshot_means_no_baseline_and_a_note_how_to_add_it(tmp_path: Path) -> None:
    putm_only = {k: v for k, v in TASKS.items() if k[0] == "putm"}
    rows = [row(tmp_path / "runs" / "a", {"method.putm.rho": 0.5}, 70.0, tasks=putm_only)]
    assert rows[0].baseline is None
    write_study_summary(rows, "fewshot/putm/acc", "maximize", ["method.putm.rho"], tmp_path, "mini", MEAN)
    text = (tmp_path / "summary.md").read_text()
    assert "SimpleShot was not evaluated" in text and "add simpleshot to the sweep's `methods`" in text
    assert "SimpleShot (± 95% CI)" not in text
    assert read_csv(tmp_path / "summary.csv")[0][BASELINE_COLUMN] == ""
    figure = study_figure(rows, "fewshot/putm/acc", "maximize", ["method.putm.rho"], "mini", MEAN)
    assert not any("SimpleShot" in label for label in legend_labels(figure))
    assert not [a for a in drawn(figure) if (a.get_gid() or "").startswith(BASELINE_GID)]


# ------------------------------------------------------------------------------------------------ figure


def drawn(figure) -> list:
    """Every artist of every panel (lines, collections, patches)."""
    return [artist for ax in figure.get_axes() for artist in (*ax.lines, *ax.collections, *ax.patches)]


def drawn_labels(figure) -> set[str]:
    """The labels of the drawn artists that a legend may name (matplotlib never lists empty labels or ones
    starting with _)."""
    artists = [*drawn(figure), *(c for ax in figure.get_axes() for c in ax.containers)]
    return {a.get_label() for a in artists if a.get_label() and not a.get_label().startswith("_")}


def test_figure_has_ci_error_bars_a_baseline_band_and_a_legend_of_what_is_drawn(tmp_path: Path) -> None:
    rows = [row(tmp_path / "runs" / "a", {"method.putm.rho": 0.5}, 70.0),
            row(tmp_path / "runs" / "b", {"method.putm.rho": 1.0}, 65.0,
                tasks={**TASKS, ("putm", "2"): [50, 60, 70, 40], ("putm", "balanced"): [60, 80, 70, 50]})]
    figure = study_figure(rows, "fewshot/putm/acc", "maximize", ["method.putm.rho"], "mini", MEAN)
    (ax,) = figure.get_axes()
    (bars,) = [c for c in ax.containers if c.lines[0].get_gid() == METRIC_GID]
    assert bars.has_yerr
    segments = sorted(sorted(s[:, 1]) for s in bars.lines[2][0].get_segments())
    assert segments == [pytest.approx([65 - hand_ci(450), 65 + hand_ci(450)], abs=1e-3),
                        pytest.approx([70 - hand_ci(450), 70 + hand_ci(450)], abs=1e-3)]
    baseline = [a for a in ax.lines if a.get_gid() == BASELINE_GID]
    assert len(baseline) == 1 and baseline[0].get_ydata()[0] == pytest.approx(57.5)  # flat: same tasks everywhere
    band = [a for a in drawn(figure) if a.get_gid() == f"{BASELINE_GID}-band"]
    assert len(band) == 1
    # one swept parameter, one point per value: no worst–best range is drawn, and the legend does not name one
    assert not [a for a in drawn(figure) if a.get_gid() == RANGE_GID]
    assert sorted(legend_labels(figure)) == sorted(drawn_labels(figure)) == sorted(
        ["PUTM ± 95% CI", "SimpleShot ± 95% CI", "best run"])
    assert "bars: 95% CI" in figure._suptitle.get_text() and "4 tasks per setting" in figure._suptitle.get_text()


def test_range_is_drawn_and_named_only_when_a_value_has_several_points(tmp_path: Path) -> None:
    rows = [row(tmp_path / "runs" / f"{rho}-{steps}", {"rho": rho, "steps": steps}, 60.0 + rho + steps)
            for rho in (0, 1) for steps in (5, 10)]
    figure = study_figure(rows, "fewshot/putm/acc", "maximize", ["rho", "steps"], "mini", MEAN)
    assert len([a for a in drawn(figure) if a.get_gid() == RANGE_GID]) == 2  # one per panel
    assert sorted(legend_labels(figure)) == sorted(drawn_labels(figure))
    assert "range over the other swept values" in legend_labels(figure)


def test_margin_over_simpleshot_draws_the_zero_line(tmp_path: Path) -> None:
    rows = [row(tmp_path / "runs" / "a", {"rho": 0.5}, 10.0, parts=GAIN)]
    figure = study_figure(rows, "fewshot/putm/worst_gain_over_simpleshot", "maximize", ["rho"], "mini", GAIN)
    (line,) = [a for a in figure.get_axes()[0].lines if a.get_gid() == BASELINE_GID]
    assert list(line.get_ydata()) == [0.0, 0.0]
    assert sorted(legend_labels(figure)) == sorted(drawn_labels(figure))
    assert "SimpleShot (zero margin)" in legend_labels(figure)


# ------------------------------------------------------------------------------------------------ end to end


def test_a_study_writes_cis_from_its_runs_per_task_files(tmp_path: Path, single_thread) -> None:
    # kills: Study.rows() not attaching intervals, or run_study not passing the metric's parts to the summary
    import yaml

    from lightning_putm.jobs.evaluate import run_evaluate
    from lightning_putm.jobs.study import run_study

    spec = {"program": "evaluate.py", "name": "mini", "method": "grid",
            "metric": {"name": "fewshot/putm/acc", "goal": "maximize"},
            "parameters": {"method.putm.rho": {"values": [0.0, 1.0]}, "alphas": {"value": "[2,balanced]"},
                           "methods": {"value": "[putm,simpleshot]"}, "shots": {"value": 1}, "tasks": {"value": 4},
                           "method.putm.em_steps": {"value": 2}, "method.putm.inner_steps": {"value": 2},
                           "logger": {"value": "none"}, "plots": {"value": False}, "progress": {"value": False}}}
    (tmp_path / "mini.yaml").write_text(yaml.safe_dump(spec))
    folder = run_study([str(tmp_path / "mini.yaml"), "--dir", str(tmp_path / "study")], log=lambda _: None,
                       run=lambda args: run_evaluate(args, log=lambda _: None))
    for record in read_csv(folder / "summary.csv"):
        per_task = read_csv(Path(record["output_dir"]) / "per_task.csv")
        by_task: dict[str, list[float]] = {}
        for line in per_task:
            if line["method"] == "putm":
                by_task.setdefault(line["task"], []).append(100 * float(line["accuracy"]))
        means = [sum(v) / len(v) for v in by_task.values()]
        centre = sum(means) / len(means)
        expected = hand_ci(sum((m - centre) ** 2 for m in means), len(means))
        assert float(record["fewshot/putm/acc_ci95"]) == pytest.approx(expected, abs=1e-3)
        assert record[BASELINE_COLUMN] != "" and record["tasks"] == "4"
    assert "SimpleShot (± 95% CI)" in (folder / "summary.md").read_text()


# ------------------------------------------------------------------------------------- sweeps over test conditions


def alpha_run(folder: Path, alpha: str, point: dict, putm: list[float], parts=MEAN) -> StudyRow:
    """A run of one α with PUTM, SimpleShot and PT-MAP (4 tasks each; PT-MAP 10 points below PUTM)."""
    tasks = {("putm", alpha): putm, ("simpleshot", alpha): [v - 5 for v in putm],
             ("ptmap", alpha): [v - 10 for v in putm]}
    return row(folder, point, sum(putm) / len(putm), tasks=tasks, parts=parts)


def test_a_sweep_over_alpha_keeps_its_order_stars_nothing_and_names_the_axis_in_words(tmp_path: Path) -> None:
    """A study over α (a test condition): the table keeps the sweep's order (here 2, 0.5, balanced: neither by
    accuracy nor numeric), no run is starred or called best, the axis says "Dirichlet α".
    Kills: the table sorted by accuracy; a "best run" of a test condition; the axis labelled ``alphas``."""
    rows = [alpha_run(tmp_path / "runs" / a, a, {"alphas": a}, values) for a, values in
            (("2", [60, 70, 80, 50]), ("0.5", [40, 50, 60, 50]), ("balanced", [70, 90, 80, 60]))]
    write_study_summary(rows, "fewshot/putm/acc", "maximize", ["alphas"], tmp_path, "alpha", MEAN)
    text = (tmp_path / "summary.md").read_text()
    assert text.index("| 2 |") < text.index("| 0.5 |") < text.index("| balanced |")
    assert "Dirichlet α is a test condition" in text and "no run is marked best" in text
    figure = study_figure(rows, "fewshot/putm/acc", "maximize", ["alphas"], "alpha", MEAN)
    assert not [a for a in drawn(figure) if a.get_gid() == BEST_GID]
    assert not any("best" in label for label in legend_labels(figure))
    assert [ax.get_xlabel() for ax in figure.get_axes()] == ["Dirichlet α"]


def test_every_method_that_ran_is_in_the_table_and_the_figure(tmp_path: Path) -> None:
    """The runs evaluated PUTM, SimpleShot and PT-MAP: the table has PT-MAP's column (its mean ± CI) and the
    figure draws PT-MAP with its CI bars, named in the legend. Kills: a summary of PUTM and SimpleShot only."""
    rows = [alpha_run(tmp_path / "runs" / a, a, {"alphas": a}, values) for a, values in
            (("2", [60, 70, 80, 50]), ("balanced", [70, 90, 80, 60]))]
    write_study_summary(rows, "fewshot/putm/acc", "maximize", ["alphas"], tmp_path, "alpha", MEAN)
    text = (tmp_path / "summary.md").read_text()
    assert f"| 2 | 65.00 ± {hand_ci(500):.2f} | 60.00 ± {hand_ci(500):.2f} | 55.00 ± {hand_ci(500):.2f} |" in text
    assert "PT-MAP (± 95% CI)" in text.splitlines()[4]  # the table's header
    figure = study_figure(rows, "fewshot/putm/acc", "maximize", ["alphas"], "alpha", MEAN)
    (ptmap,) = [c for ax in figure.get_axes() for c in ax.containers if c.lines[0].get_gid() == f"{METHOD_GID}-ptmap"]
    assert ptmap.has_yerr and list(ptmap.lines[0].get_ydata()) == pytest.approx([55.0, 65.0])
    assert sorted(legend_labels(figure)) == sorted(drawn_labels(figure)) == sorted(
        ["PUTM ± 95% CI", "SimpleShot ± 95% CI", "PT-MAP ± 95% CI"])
    assert figure.get_axes()[0].get_ylabel() == "accuracy (%)"  # several methods: not "PUTM accuracy"


def test_with_a_hyper_parameter_and_a_condition_swept_the_star_marks_the_best_mean_over_the_conditions(
        tmp_path: Path) -> None:
    """rho × α: rho=0.5 has the best single run (80 at α=2) but the worse mean over α (65 against 70). The star
    marks rho=1.0 at 70 on the rho panel only, and the note names it.
    Kills: the best single run starred (a best α in disguise); a star on the α panel."""
    points = [({"method.putm.rho": rho, "alphas": a}, values) for rho, a, values in
              ((0.5, "2", [80] * 4), (0.5, "balanced", [50] * 4), (1.0, "2", [70] * 4), (1.0, "balanced", [70] * 4))]
    rows = [alpha_run(tmp_path / "runs" / f"{p['method.putm.rho']}-{p['alphas']}", p["alphas"], p, v)
            for p, v in points]
    swept = ["method.putm.rho", "alphas"]
    figure = study_figure(rows, "fewshot/putm/acc", "maximize", swept, "mixed", MEAN)
    rho_axis, alpha_axis = figure.get_axes()
    (star,) = [a for a in rho_axis.lines if a.get_gid() == BEST_GID]
    assert list(star.get_xdata()) == [1] and list(star.get_ydata()) == [70.0]  # x index 1: rho = 1.0
    assert not [a for a in alpha_axis.lines if a.get_gid() == BEST_GID]
    assert [rho_axis.get_xlabel(), alpha_axis.get_xlabel()] == ["PUTM rho", "Dirichlet α"]
    assert "best setting (mean over Dirichlet α)" in legend_labels(figure)
    write_study_summary(rows, "fewshot/putm/acc", "maximize", swept, tmp_path, "mixed", MEAN)
    assert "the best PUTM rho = 1.0 (70.00, mean over the Dirichlet α swept)" in (tmp_path / "summary.md").read_text()


def test_a_grid_studys_rows_come_in_the_sweeps_order_whatever_order_they_finished_in(tmp_path: Path) -> None:
    """Points finished in reverse order (as several processes may finish them): ``Study.rows()`` gives them in
    the file's order, which the summary of a test-condition sweep keeps. Kills: rows in finishing order."""
    import yaml
    from types import SimpleNamespace

    from lightning_putm.studies.study import Study
    from lightning_putm.studies.sweep import read_sweep

    spec = {"program": "evaluate.py", "name": "order", "method": "grid",
            "metric": {"name": "fewshot/putm/acc", "goal": "maximize"},
            "parameters": {"alphas": {"values": [2, 0.5, "balanced"]}, "shots": {"value": 1},
                           "methods": {"value": "[putm]"}, "logger": {"value": "none"}}}
    (tmp_path / "order.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = read_sweep(tmp_path / "order.yaml")
    study = Study(sweep, tmp_path / "study", log=lambda _: None)
    summary = SimpleNamespace(method="putm", shots=1, alpha_label="2", accuracy=50.0, ci95=1.0)
    objective = study.objective(lambda args: [SimpleNamespace(summary=lambda: summary)])
    for point in reversed(sweep.points()):
        study.study.enqueue_trial({k: Study._grid_value(v) for k, v in point.items()})
        study.study.optimize(objective, n_trials=1, catch=())
    assert [r.key for r in study.rows()] == [sweep.key(p) for p in sweep.points()]
