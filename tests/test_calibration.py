"""Temperature scaling, ECE, reliability bins and soft class counts (lightning_putm.methods.calibration), the fit
on validation tasks (lightning_putm.evaluation.calibration) and benchmarks/calibration.py."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_putm.config import load_group, to_container
from lightning_putm.evaluation.calibration import draw_calibration_tasks, fit_calibration, predict_in_chunks
from lightning_putm.evaluation.settings import method_arguments
from lightning_putm.features.files import FeatureSet
from lightning_putm.methods import build_method
from lightning_putm.methods.calibration import (PROBABILITY_FLOOR, expected_calibration_error, fit_temperature,
                                                negative_log_likelihood, reliability_bins, scale_probabilities,
                                                soft_counts)


def _overconfident(seed: int = 0, queries: int = 20000, ways: int = 5, sharpen: float = 3.0):
    """Labels drawn from softmax(z); the 'method' reports softmax(sharpen·z): overconfident by ``sharpen``."""
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(queries, ways, generator=generator, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits, 1), 1, generator=generator).squeeze(1)
    return torch.softmax(sharpen * logits, 1), labels


def test_scaling_keeps_every_prediction_and_sums_to_one() -> None:
    probabilities, _ = _overconfident(queries=500)
    for temperature in (0.3, 1.0, 7.0):
        scaled = scale_probabilities(probabilities, temperature)
        assert torch.equal(scaled.argmax(1), probabilities.argmax(1))
        assert torch.allclose(scaled.sum(1), torch.ones(500, dtype=torch.float64))
    assert torch.allclose(scale_probabilities(probabilities, 1.0), probabilities, atol=1e-10)  # T = 1: unchanged
    assert scale_probabilities(probabilities, 4.0).max(1).values.mean() < probabilities.max(1).values.mean()  # softer
    with pytest.raises(ValueError, match="temperature"):
        scale_probabilities(probabilities, 0.0)


def test_exact_zeros_count_as_the_floor() -> None:
    """PUTM and ProtoNet return exact zeros; log 0 would make every scaled row NaN or one-hot."""
    probabilities = torch.tensor([[1.0, 0.0, 0.0]])
    scaled = scale_probabilities(probabilities, 10.0)
    assert torch.isfinite(scaled).all()
    expected = torch.softmax(torch.tensor([0.0, math.log(PROBABILITY_FLOOR), math.log(PROBABILITY_FLOOR)]) / 10.0, 0)
    assert torch.allclose(scaled[0], expected.float(), atol=1e-7)


@pytest.mark.parametrize("sharpen", [0.5, 3.0])
def test_the_fit_recovers_how_over_or_underconfident_the_method_is(sharpen: float) -> None:
    probabilities, labels = _overconfident(sharpen=sharpen)
    temperature = fit_temperature(probabilities, labels)
    assert temperature == pytest.approx(sharpen, rel=0.05)
    nll = negative_log_likelihood(probabilities, labels, temperature)
    for other in (0.8 * temperature, 1.25 * temperature):  # the fit is the minimum
        assert nll < negative_log_likelihood(probabilities, labels, other)


def test_ece_of_hand_computed_cases() -> None:
    labels = torch.zeros(10, dtype=torch.long)
    right_9_of_10 = torch.tensor([[0.9, 0.1]] * 9 + [[0.1, 0.9]])  # confidence 0.9 everywhere, 9 right
    assert expected_calibration_error(right_9_of_10, labels) == pytest.approx(0.0, abs=1e-6)
    half_right = torch.tensor([[0.95, 0.05]] * 5 + [[0.05, 0.95]] * 5)  # confidence 0.95, accuracy 0.5
    assert expected_calibration_error(half_right, labels) == pytest.approx(0.45)
    # two bins: 0.6 (1 of 2 right) and 1.0 (2 of 2 right): (2·0.1 + 2·0) / 4
    mixed = torch.tensor([[0.6, 0.4], [0.4, 0.6], [1.0, 0.0], [1.0, 0.0]])
    assert expected_calibration_error(mixed, torch.zeros(4, dtype=torch.long)) == pytest.approx(0.05)


def test_reliability_bins_are_right_closed_and_cover_every_query() -> None:
    probabilities = torch.tensor([[1.0, 0.0], [0.6, 0.4], [0.2, 0.8]], dtype=torch.float64)
    table = reliability_bins(probabilities, torch.tensor([0, 1, 1]), bins=5)
    assert [b.count for b in table] == [0, 0, 1, 1, 1]  # 0.6 in (0.4, 0.6], 0.8 in (0.6, 0.8], 1.0 in (0.8, 1.0]
    assert (table[2].confidence, table[2].accuracy) == (pytest.approx(0.6), 0.0)
    assert (table[3].confidence, table[3].accuracy) == (pytest.approx(0.8), 1.0)
    assert math.isnan(table[0].confidence)


def test_soft_counts_and_their_interval() -> None:
    probabilities = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.2, 0.8]])
    counts = soft_counts(probabilities)
    assert torch.allclose(counts.estimate, torch.tensor([1.7, 1.3], dtype=torch.float64))
    half = 1.96 * math.sqrt(0.25 + 0.0 + 0.16)
    assert counts.low.tolist() == pytest.approx([1.7 - half, 1.3 - half])
    assert counts.high.tolist() == pytest.approx([1.7 + half, 1.3 + half])
    sure = soft_counts(torch.tensor([[1.0, 0.0]] * 3))  # certain queries: a zero-width interval, clipped to [0, Q]
    assert sure.low.tolist() == sure.high.tolist() == [3.0, 0.0]


def test_the_interval_covers_about_95_percent_of_counts_drawn_from_calibrated_probabilities() -> None:
    generator = torch.Generator().manual_seed(1)
    probabilities = torch.softmax(torch.randn(400, 60, 5, generator=generator, dtype=torch.float64), -1)
    draws = torch.multinomial(probabilities.reshape(-1, 5), 1, generator=generator).reshape(400, 60)
    true_counts = torch.nn.functional.one_hot(draws, 5).sum(1).double()
    counts = soft_counts(probabilities)
    inside = ((true_counts >= counts.low) & (true_counts <= counts.high)).double().mean()
    assert 0.92 <= float(inside) <= 0.98


def test_calibration_tasks_shrink_their_query_set_to_what_small_classes_hold() -> None:
    features = torch.randn(6 * 4, 3)
    small = FeatureSet(features, torch.arange(6).repeat_interleave(4), [f"c{i}" for i in range(6)])
    drawn, queries = draw_calibration_tasks(small, ways=5, shots=1, queries=300, tasks=3, seed=0)
    assert queries <= 5 * 3  # each class has 4 images: 1 support + at most 3 queries
    assert drawn.batch.query.shape == (3, queries, 3) and drawn.query_labels.shape == (3, queries)


def test_chunks_give_the_same_probabilities_as_one_call(clustered: FeatureSet, single_thread) -> None:
    drawn, _ = draw_calibration_tasks(clustered, ways=3, shots=1, queries=12, tasks=7, seed=2)
    method = build_method("tim", method_arguments(to_container(load_group("method", "tim"))), shots=1, balanced=False)
    whole = method.predict(drawn.batch).double()
    assert torch.equal(predict_in_chunks(method, drawn.batch, chunk=3), whole)


def test_fitting_on_validation_tasks_lowers_protonets_calibration_error(single_thread) -> None:
    """ProtoNet on raw digit pixels is overconfident (exact zeros and ones); the fit must cut its ECE on other
    tasks drawn from other classes."""
    from lightning_putm.data.digits import digits_feature_set

    method = build_method("protonet", {}, shots=1, balanced=False)
    validation, test = digits_feature_set([0, 1, 2, 3, 4]), digits_feature_set([5, 6, 7, 8, 9])
    fitted = fit_calibration(method, validation, ways=5, shots=1, queries=40, tasks=60, seed=0)
    assert fitted.temperature > 2.0 and fitted.ece_after < fitted.ece_before
    drawn, _ = draw_calibration_tasks(test, ways=5, shots=1, queries=40, tasks=60, seed=1)
    raw = method.predict(drawn.batch).double()
    calibrated = scale_probabilities(raw, fitted.temperature)
    assert expected_calibration_error(calibrated, drawn.query_labels) < 0.5 * expected_calibration_error(
        raw, drawn.query_labels)
    assert torch.equal(calibrated.argmax(-1), raw.argmax(-1))  # accuracy unchanged


def test_a_fit_that_runs_to_the_end_of_its_range_is_no_calibration(single_thread) -> None:
    """Kills: the temperature of tasks the method gets all right (T → 0, the search's lower end: every probability
    then 1.0, also those of wrong predictions on the user's task) applied as a calibration. That happened in
    `predict` with the demo checkpoint, whose val split holds its training classes."""
    from pathlib import Path

    from lightning_putm.methods.calibration import at_search_bound
    from lightning_putm.prediction.checkpoint_splits import usable

    probabilities, labels = _overconfident(queries=500)
    assert not at_search_bound(fit_temperature(probabilities, labels))
    right = probabilities.argmax(1)
    assert at_search_bound(fit_temperature(probabilities, right))  # every query right: T → 0
    assert at_search_bound(fit_temperature(probabilities, (right + 1) % 5))  # every query wrong: T → ∞
    # far-apart classes: ProtoNet labels every validation query correctly
    features = torch.cat([torch.full((12, 4), 100.0 * c) + torch.randn(12, 4) for c in range(5)])
    separated = FeatureSet(features, torch.arange(5).repeat_interleave(12), [f"c{i}" for i in range(5)])
    method = build_method("protonet", {}, shots=1, balanced=False)
    fitted = fit_calibration(method, separated, ways=5, shots=1, queries=20, tasks=10, seed=0)
    assert fitted.accuracy == 100.0 and not fitted.fitted
    notices: list[str] = []
    assert usable(fitted, Path("val.pt"), notices.append) is None
    assert notices == ["notice: probabilities are the method's own (uncalibrated): the method labelled every query "
                       "of the 10 tasks of val.pt correctly, so they cannot show how sure it should be (classes the "
                       "backbone was trained on?); pass calibration=<feature file of classes the backbone did not "
                       "train on> or calibration=<T>"]
    from lightning_putm.data.digits import digits_feature_set

    real = fit_calibration(method, digits_feature_set([0, 1, 2, 3, 4]), ways=5, shots=1, queries=40, tasks=20, seed=0)
    assert real.fitted and usable(real, Path("val.pt"), notices.append) is real and len(notices) == 1


def test_the_benchmark_script_writes_its_table_csv_and_reliability_figure(tmp_path, monkeypatch,
                                                                          single_thread) -> None:
    """benchmarks/calibration.py on digits features (validation: digits 0–4, test: 5–9), two methods, few tasks."""
    import csv
    import importlib.util
    import sys
    from pathlib import Path

    from lightning_putm.data.digits import digits_feature_set
    from lightning_putm.features.files import save_features

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "calibration.py"
    spec = importlib.util.spec_from_file_location("_calibration_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    val = save_features(digits_feature_set([0, 1, 2, 3, 4]), tmp_path / "val.pt")
    test = save_features(digits_feature_set([5, 6, 7, 8, 9]), tmp_path / "test.pt")
    assert module.main(["--val-features", str(val), "--test-features", str(test), "--methods", "simpleshot,protonet",
                        "--tasks", "40", "--threads", "1", "--output", str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / "calibration_5way_1shot.csv", newline="") as handle:
        rows = {row["method"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"SimpleShot", "ProtoNet"}
    protonet = rows["ProtoNet"]
    assert float(protonet["test ECE cal."]) < float(protonet["test ECE raw"])  # its exact zeros are tamed
    assert float(protonet["temperature"]) > 1.0
    assert (tmp_path / "out" / "reliability_5way_1shot.png").stat().st_size > 10_000
    assert "| ProtoNet | 40 |" in (tmp_path / "out" / "calibration_5way_1shot.md").read_text()


def test_the_cached_temperature_follows_the_base_statistics_and_learned_parameters(tmp_path, single_thread) -> None:
    """Kills: a calibration cache keyed by the base_features *path* (a regenerated file reused the temperature
    fitted with the old mean) or blind to UNEM's fitted parameters file."""
    from dataclasses import replace
    from pathlib import Path

    from lightning_putm.data.digits import digits_feature_set
    from lightning_putm.features.files import save_features
    from lightning_putm.methods.unem import UNEMParams
    from lightning_putm.methods.unem_fit import save_params
    from lightning_putm.prediction.checkpoint_splits import resolve_calibration
    from lightning_putm.prediction.settings import PredictSettings

    validation = save_features(digits_feature_set([0, 1, 2, 3, 4]), tmp_path / "val.pt")
    settings = PredictSettings(checkpoint=Path("unused.ckpt"), support=tmp_path, query=tmp_path, method="simpleshot",
                               method_params={}, output=tmp_path / "p.csv", counts_output=tmp_path / "c.csv",
                               base_features=None, data_root=None, feature_cache_dir=tmp_path / "cache",
                               batch_size=8, seed=0, device=torch.device("cpu"), memory_budget_mb=2048.0,
                               calibration=str(validation), calibration_tasks=10)
    lines: list[str] = []

    def fit(mean: torch.Tensor | None, method_name: str = "simpleshot", params: dict | None = None):
        method = build_method(method_name, params or {}, shots=1, balanced=False, base_mean=mean)
        lines.clear()
        chosen = replace(settings, method=method_name, method_params=params or {})
        return resolve_calibration(chosen, method, 5, 1, 20, "CL2N (base.pt)", lines.append, base=(mean, None))

    one, other = torch.full((64,), 4.0), torch.full((64,), 12.0)
    first = fit(one)
    assert not any(line.startswith("calibration: reusing") for line in lines)
    assert fit(one) == first and any(line.startswith("calibration: reusing") for line in lines)
    moved = fit(other)  # the same description and path, another mean: fitted anew
    assert not any(line.startswith("calibration: reusing") for line in lines) and moved != first
    params_file = tmp_path / "unem.json"
    save_params(params_file, UNEMParams.initial())
    fit(None, "unem", {"params_file": str(params_file)})
    fit(None, "unem", {"params_file": str(params_file)})
    assert any(line.startswith("calibration: reusing") for line in lines)
    save_params(params_file, UNEMParams.from_values(3.0, [0.2] * 10, [3.0] * 10))  # refitted: same path
    fit(None, "unem", {"params_file": str(params_file)})
    assert not any(line.startswith("calibration: reusing") for line in lines)
