"""``navigator-confidence`` (lightning_putm/studies/navigator_confidence.py): accuracy and confidence of PUTM's navigator, and its preset options."""

from __future__ import annotations

import pytest
import torch

from lightning_putm.studies import navigator_confidence


def test_confidence_stats_are_accuracy_and_mean_largest_probability_after_renormalising() -> None:
    probabilities = torch.tensor([[[2.0, 1.0, 1.0], [0.1, 0.1, 0.2]], [[0.5, 0.25, 0.25], [0.2, 0.6, 0.2]]])
    labels = torch.tensor([[0, 0], [1, 1]])
    accuracy, confidence = navigator_confidence.confidence_stats(probabilities, labels)
    assert accuracy == pytest.approx(50.0)  # right: task 0 query 0, task 1 query 1
    assert confidence == pytest.approx(100 * (0.5 + 0.5 + 0.5 + 0.6) / 4)


def test_preset_options_read_the_preset_file_then_the_overrides() -> None:
    assert navigator_confidence.preset_options("reference", []) == {}
    options = navigator_confidence.preset_options("support_anchored", ["support_weight=20", "prototype_update=backward"])
    assert options == {"em_steps": 20, "inner_steps": 10, "support_weight": 20, "prototype_update": "backward"}
    with pytest.raises(SystemExit, match="presets: .*support_anchored"):
        navigator_confidence.preset_options("nonesuch", [])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        navigator_confidence.preset_options("fast", ["support_weight"])


def test_nearest_mean_labels_pick_the_closest_support_mean_in_putm_space() -> None:
    from lightning_putm.methods.putm import PUTM
    from lightning_putm.tasks import TaskBatch

    # 2 ways, 1 shot: support rows along two axes; queries near one or the other. beta=1 keeps the pixels' ratios.
    support = torch.tensor([[[5.0, 0.1, 0.1], [0.1, 5.0, 0.1]]])
    query = torch.tensor([[[4.0, 0.5, 0.2], [0.3, 6.0, 0.1], [0.2, 3.0, 0.4]]])
    tasks = TaskBatch(support, torch.tensor([[0, 1]]), query, ways=2, task_seeds=torch.tensor([0]))
    labels = navigator_confidence.nearest_mean_labels(PUTM(shots=1, balanced=True, beta=1.0), tasks)
    assert labels.tolist() == [[0, 1, 1]]


def test_main_prints_one_row_per_setting_with_the_solver_accuracy(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    argv = ["--features", "demo", "--preset", "fast", "--set", "em_steps=2", "--set", "inner_steps=2",
            "--shots", "1", "--alphas", "2", "balanced", "--tasks", "3", "--queries", "10"]
    rows = navigator_confidence.main(argv)
    assert [(shots, alpha) for shots, alpha, *_ in rows] == [(1, "2"), (1, "balanced")]
    feature_set = navigator_confidence.load_feature_set("demo")
    options = {"em_steps": 2, "inner_steps": 2}
    assert rows[0][2:] == pytest.approx(navigator_confidence.measure(feature_set, options, 1, 2.0, 10, 3))
    for _, _, accuracy, confidence, nearest, agreement in rows:
        assert 0 <= accuracy <= 100 and 20 <= confidence <= 100  # 5 ways: the largest probability is >= 1/5
        assert 0 <= nearest <= 100 and 0 <= agreement <= 100
    assert capsys.readouterr().out.count("| 1 |") == 2
