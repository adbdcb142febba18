"""benchmarks/sensitivity_figure.py: which value each run changes (resolved per shot as PUTM resolves it), the
tables and the figure. Run folders are written in ``evaluate.py``'s real format (``results.csv`` and a
``config.yaml`` whose ``method.putm`` block is the shipped default), so every number is known in advance."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sensitivity_figure  # noqa: E402


def write_run(folder: Path, accuracies: dict[tuple[str, int], float], **putm: float) -> Path:
    folder.mkdir(parents=True)
    block = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "method" / "putm.yaml"), putm)
    OmegaConf.save(OmegaConf.create({"method": {"putm": block}}), folder / "config.yaml")
    with open(folder / "results.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "shots", "alpha", "accuracy", "ci95", "tasks"])
        for (method, shots), accuracy in accuracies.items():
            writer.writerow([method, shots, "2", accuracy, 1.5, 100])
    return folder


@pytest.fixture
def study(tmp_path: Path) -> Path:
    write_run(tmp_path / "reference", {("putm", 1): 70.0, ("putm", 5): 85.0, ("simpleshot", 1): 68.0,
                                       ("simpleshot", 5): 86.0})
    write_run(tmp_path / "beta0.8", {("putm", 1): 72.0, ("putm", 5): 84.0}, beta=0.8)
    write_run(tmp_path / "inertia0.1", {("putm", 1): 71.0, ("putm", 5): 85.0}, inertia=0.1)
    (tmp_path / "unfinished").mkdir()  # a run still in flight: no results.csv yet
    return tmp_path


def test_each_run_is_placed_at_the_value_it_changes_per_shot(study: Path) -> None:
    defaults, base, curves = sensitivity_figure.collect(study)
    assert defaults["1"]["inertia"] == pytest.approx(0.2) and defaults["5"]["inertia"] == pytest.approx(0.1)
    assert curves[("beta", ("1", "2"))] == [(pytest.approx(0.6), 70.0), (pytest.approx(0.8), 72.0)]
    assert curves[("beta", ("5", "2"))] == [(pytest.approx(0.6), 85.0), (pytest.approx(0.8), 84.0)]
    assert curves[("inertia", ("1", "2"))] == [(pytest.approx(0.1), 71.0), (pytest.approx(0.2), 70.0)]
    assert ("inertia", ("5", "2")) not in curves  # inertia 0.1 is the 5-shot default: no change there
    assert base[("1", "2")]["simpleshot"] == (68.0, 1.5)


def test_the_table_marks_the_reference_and_shows_simpleshot(study: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figure = study / "figure.png"
    text = sensitivity_figure.main(["--set", "toy", str(study), "--figure", str(figure)])
    assert "| `reference` (beta 0.6, rho 0.5, inertia 0.2 / 0.1) | **70.00 ± 1.50** | **85.00 ± 1.50** |" in text
    assert "| beta 0.8 | 72.00 | 84.00 |" in text
    assert "| inertia 0.1 | 71.00 | (reference) |" in text
    assert "| SimpleShot | 68.00 ± 1.50 | 86.00 ± 1.50 |" in text
    assert "beta 0.6 |" not in text  # the reference value is the reference row, not a row of its own
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "unfinished has no results.csv" in capsys.readouterr().err


def test_a_run_that_changes_two_values_is_refused(study: Path) -> None:
    write_run(study / "both", {("putm", 1): 60.0, ("putm", 5): 80.0}, beta=0.8, rho=0.0)
    with pytest.raises(SystemExit, match="both: changes beta, rho at once"):
        sensitivity_figure.collect(study)


def test_a_missing_reference_run_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--reference NAME"):
        sensitivity_figure.collect(tmp_path)
