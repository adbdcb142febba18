"""``compare-presets`` and ``combine-tunes`` (lightning_putm/studies/): the verdict "never below SimpleShot beyond its CI", the
paired gain, the means, and one selection from several validation sets.

Two run folders in ``evaluate.py``'s real output format (``results.csv`` and ``per_task.csv``) are written by
hand, so every number the command prints is known in advance.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_putm.studies import combine_tunes, compare_presets

RESULT_COLUMNS = ["method", "shots", "alpha", "accuracy", "ci95", "tasks"]
TASK_COLUMNS = ["method", "shots", "alpha", "task", "accuracy"]


def write_run(folder: Path, results: list[tuple], per_task: list[tuple]) -> Path:
    folder.mkdir()
    with open(folder / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(RESULT_COLUMNS)
        writer.writerows(results)
    with open(folder / "per_task.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TASK_COLUMNS)
        writer.writerows(per_task)
    return folder


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    base = write_run(tmp_path / "base", [("putm", 1, "2", 70.0, 2.0, 2), ("putm", 1, "balanced", 90.0, 1.0, 2)], [])
    candidate = write_run(
        tmp_path / "candidate",
        [("putm", 1, "2", 74.0, 2.0, 2), ("simpleshot", 1, "2", 75.0, 1.5, 2),
         ("putm", 1, "balanced", 80.0, 1.0, 2), ("simpleshot", 1, "balanced", 82.0, 1.0, 2)],
        [("putm", 1, "2", 0, 0.8), ("putm", 1, "2", 1, 0.6), ("simpleshot", 1, "2", 0, 0.7),
         ("simpleshot", 1, "2", 1, 0.8), ("putm", 1, "balanced", 0, 0.8), ("simpleshot", 1, "balanced", 0, 0.8)])
    return base, candidate


def test_verdict_paired_gain_and_means(runs):
    base, candidate = runs
    lines, summary = compare_presets.compare("toy", base, candidate)
    # 74 >= 75 - 1.5 holds; 80 >= 82 - 1 does not
    assert summary["failures"] == ["1-shot α=balanced"]
    assert summary["means"] == (80.0, 77.0)
    gains = compare_presets.paired_gain(candidate, "putm", "simpleshot")
    assert gains[("1", "2")][0] == pytest.approx(((80 - 70) + (60 - 80)) / 2)  # task by task, in points
    assert gains[("1", "balanced")] == (0.0, 0.0)
    text = "\n".join(lines)
    assert "| 1 | 2 | 75.00 ± 1.50 | 70.00 ± 2.00 | **74.00** ± 2.00 | -5.00 ±" in text
    assert "base 80.00, candidate 77.00 (-3.00 points)" in text and "1-shot α=balanced" in text


def test_compact_table_marks_the_failing_setting(runs):
    _, summary = compare_presets.compare("toy", *runs)
    lines = compare_presets.compact(summary)
    assert "| 2 | 75.00 ± 1.50 | 70.00 | **74.00** |" in lines
    assert "| balanced | 82.00 ± 1.00 | 90.00 | **80.00** ✗ |" in lines


def test_without_a_base_run_the_candidate_is_checked_against_simpleshot_alone(runs):
    _, candidate = runs
    lines, summary = compare_presets.compare("toy", Path(compare_presets.NO_BASE), candidate)
    assert summary["failures"] == ["1-shot α=balanced"] and "means" not in summary
    text = "\n".join(lines)
    assert "| 1 | 2 | 75.00 ± 1.50 | — | **74.00** ± 2.00 | -5.00 ±" in text
    assert "Below SimpleShot beyond its CI: 1-shot α=balanced." in text
    assert "| balanced | 82.00 ± 1.00 | — | **80.00** ✗ |" in compare_presets.compact(summary)


def test_figure_is_written(runs, tmp_path: Path):
    _, summary = compare_presets.compare("toy", *runs)
    compare_presets.figure([summary], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 1000


def test_a_folder_without_results_is_a_clear_error(tmp_path: Path):
    with pytest.raises(SystemExit, match="results.csv: not found"):
        compare_presets.read_results(tmp_path)


# ------------------------------------------------------------------ combine-tunes

def write_summary(folder: Path, rows: list[tuple]) -> Path:
    folder.mkdir()
    with open(folder / "summary.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method.putm.support_weight", "method.putm.beta", "fewshot/putm/worst_gain_over_simpleshot",
                         "putm/1shot/alpha_2", "output_dir"])
        writer.writerows(rows)
    return folder


def test_combine_takes_the_worst_validation_set_then_the_best_point(tmp_path: Path):
    strong = write_summary(tmp_path / "strong", [(1, 0.6, -1.5, "", ""), (5, 0.6, 0.2, "", ""), (5, 1.0, 0.1, "", "")])
    weak = write_summary(tmp_path / "weak", [(1, 0.6, -8.0, "", ""), (5, 0.6, -6.0, "", ""), (5, 1.0, -2.0, "", "")])
    lines, best, tied = combine_tunes.combine([strong, weak])
    assert best.point == {"method.putm.support_weight": "5", "method.putm.beta": "1.0"} and best.metric == -2.0
    assert tied == [best]
    assert any(line.startswith("| 5 | 1.0 | +0.10 | -2.00 | **-2.00** (selected)") for line in lines)


def test_combine_breaks_ties_with_prefer(tmp_path: Path):
    a = write_summary(tmp_path / "a", [(2, 0.6, 0.15, "", ""), (10, 0.6, 0.15, "", "")])
    b = write_summary(tmp_path / "b", [(2, 0.6, 0.5, "", ""), (10, 0.6, 0.4, "", "")])
    _, best, tied = combine_tunes.combine([a, b], prefer=("method.putm.support_weight", "max"))
    assert best.point["method.putm.support_weight"] == "10" and len(tied) == 2
    _, best, _ = combine_tunes.combine([a, b], prefer=("method.putm.support_weight", "min"))
    assert best.point["method.putm.support_weight"] == "2"
