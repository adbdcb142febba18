"""``sensitivity-figure`` (lightning_putm/studies/sensitivity_figure.py): which value each run changes (resolved per shot as PUTM resolves it), the
tables and the figure. Run folders are written in ``evaluate.py``'s real format (``results.csv`` and a
``config.yaml`` whose ``method.putm`` block is the shipped default), so every number is known in advance."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_putm.studies import sensitivity_figure

ROOT = Path(__file__).resolve().parents[1]


def write_run(folder: Path, accuracies: dict[tuple[str, int], float], tasks: dict[int, list[float]] | None = None,
              episode_shift: int = 9, **putm: float) -> Path:
    """A finished run; ``tasks`` gives PUTM's per-task accuracies (fractions) per shot count."""
    folder.mkdir(parents=True)
    block = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "method" / "putm.yaml"), putm)
    OmegaConf.save(OmegaConf.create({"method": {"putm": block}}), folder / "config.yaml")
    with open(folder / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "shots", "alpha", "accuracy", "ci95", "tasks"])
        for (method, shots), accuracy in accuracies.items():
            writer.writerow([method, shots, "2", accuracy, 1.5, 100])
    with open(folder / "per_task.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "shots", "alpha", "task", "accuracy", "query_counts", "class_ids"])
        for shots, values in (tasks or {1: [0.7, 0.7], 5: [0.85, 0.85]}).items():
            writer.writerows(["putm", shots, "2", task, value, "1;2", f"{task};{episode_shift}"]
                             for task, value in enumerate(values))
            writer.writerow(["simpleshot", shots, "2", 0, 0.0, "1;2", "0;0"])  # another method's rows: not PUTM's
    return folder


@pytest.fixture
def study(tmp_path: Path) -> Path:
    write_run(tmp_path / "reference", {("putm", 1): 70.0, ("putm", 5): 85.0, ("simpleshot", 1): 68.0,
                                       ("simpleshot", 5): 86.0})
    write_run(tmp_path / "beta0.8", {("putm", 1): 72.0, ("putm", 5): 84.0}, {1: [0.74, 0.70], 5: [0.84, 0.84]},
              beta=0.8)
    write_run(tmp_path / "inertia0.1", {("putm", 1): 71.0, ("putm", 5): 85.0}, {1: [0.71, 0.71], 5: [0.85, 0.85]},
              inertia=0.1)
    (tmp_path / "unfinished").mkdir()  # a run still in flight: no results.csv yet
    return tmp_path


def test_each_run_is_placed_at_the_value_it_changes_per_shot(study: Path) -> None:
    defaults, base, curves = sensitivity_figure.collect(study)
    assert defaults["1"]["inertia"] == pytest.approx(0.2) and defaults["5"]["inertia"] == pytest.approx(0.1)
    # (value, accuracy, paired Δ over the same tasks, its CI): task gains +4 and 0 -> +2 ± 1.96·sd/√2
    assert curves[("beta", ("1", "2"))] == [(pytest.approx(0.6), 70.0, 0.0, 0.0),
                                            (pytest.approx(0.8), 72.0, pytest.approx(2.0), pytest.approx(3.92))]
    assert curves[("beta", ("5", "2"))] == [(pytest.approx(0.6), 85.0, 0.0, 0.0),
                                            (pytest.approx(0.8), 84.0, pytest.approx(-1.0), pytest.approx(0.0))]
    assert curves[("inertia", ("1", "2"))] == [(pytest.approx(0.1), 71.0, pytest.approx(1.0), pytest.approx(0.0)),
                                               (pytest.approx(0.2), 70.0, 0.0, 0.0)]
    assert ("inertia", ("5", "2")) not in curves  # inertia 0.1 is the 5-shot default: no change there
    assert base[("1", "2")]["simpleshot"] == (68.0, 1.5)


def test_the_table_marks_the_reference_and_shows_simpleshot(study: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figure = study / "figure.png"
    text = sensitivity_figure.main(["--set", "toy", str(study), "--figure", str(figure)])
    assert "| `reference` (beta 0.6, rho 0.5, inertia 0.2 / 0.1) | **70.00 ± 1.50** | **85.00 ± 1.50** |" in text
    assert "| beta 0.8 | 72.00 (+2.00 ± 3.92) | 84.00 (-1.00 ± 0.00) |" in text
    assert "| inertia 0.1 | 71.00 (+1.00 ± 0.00) | (reference) |" in text
    assert "| SimpleShot | 68.00 ± 1.50 | 86.00 ± 1.50 |" in text
    assert "beta 0.6 |" not in text  # the reference value is the reference row, not a row of its own
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "unfinished has no results.csv" in capsys.readouterr().err


def test_a_run_that_changes_two_values_is_refused(study: Path) -> None:
    write_run(study / "both", {("putm", 1): 60.0, ("putm", 5): 80.0}, beta=0.8, rho=0.0)
    with pytest.raises(SystemExit, match="both: changes beta, rho at once"):
        sensitivity_figure.collect(study)


def test_runs_on_other_episodes_are_refused(study: Path) -> None:
    write_run(study / "rho0", {("putm", 1): 60.0, ("putm", 5): 80.0}, {1: [], 5: []}, rho=0.0)
    with pytest.raises(SystemExit, match="rho0: no tasks in common"):
        sensitivity_figure.collect(study)


def test_runs_that_drew_other_classes_are_refused(study: Path) -> None:
    write_run(study / "rho0", {("putm", 1): 60.0, ("putm", 5): 80.0}, episode_shift=3, rho=0.0)
    with pytest.raises(SystemExit, match="rho0: its episodes differ"):
        sensitivity_figure.collect(study)


def test_a_missing_reference_run_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--reference NAME"):
        sensitivity_figure.collect(tmp_path)
