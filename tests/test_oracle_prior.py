"""The explicit, default-off oracle prior (docs/protocol.md): only class-prior methods (PT-MAP) may receive the true
query counts, only when the switch is on, and every such result is marked in the table and both CSVs."""

from __future__ import annotations

import csv

import pytest
import torch

from lightning_putm.errors import ConfigError
from lightning_putm.evaluation import (evaluate_features, format_table, load_evaluate_config, runner as evaluation,
                                       settings_from_config, write_report)
from lightning_putm.features.files import FeatureSet
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.methods import build_method
from lightning_putm.methods.ptmap import PTMAP
from lightning_putm.methods.simpleshot import SimpleShot
from lightning_putm.tasks import TaskBatch

COUNTS = [[40, 20, 10, 5, 0], [5, 5, 5, 5, 55], [15, 15, 15, 15, 15]]


def imbalanced_tasks(spread: float = 0.15, seed: int = 0) -> tuple[TaskBatch, torch.Tensor, torch.Tensor]:
    """Well-separated non-negative clusters; task t has ``COUNTS[t][k]`` queries of class k."""
    g = torch.Generator().manual_seed(seed)
    supports, queries, labels = [], [], []
    for counts in COUNTS:
        centres = torch.rand(5, 32, generator=g) * 2
        q_labels = torch.cat([torch.full((c,), k) for k, c in enumerate(counts)])
        supports.append((centres + spread * torch.randn(5, 32, generator=g)).clamp_min(0))
        queries.append((centres[q_labels] + spread * torch.randn(75, 32, generator=g)).clamp_min(0))
        labels.append(q_labels)
    tasks = TaskBatch(torch.stack(supports), torch.arange(5).expand(3, 5).clone(), torch.stack(queries), 5,
                      torch.arange(3))
    return tasks, torch.stack(labels), torch.tensor(COUNTS)


def test_ptmap_oracle_columns_are_the_true_counts() -> None:
    tasks, _, counts = imbalanced_tasks(spread=0.6)
    method = PTMAP(query_counts=counts)
    assert method.oracle_prior
    probs = method.predict(tasks)
    plan = method.last_state["transport"]
    torch.testing.assert_close(plan.sum(1), counts.float(), atol=1e-4, rtol=0)
    assert (plan[0, :, 4] == 0).all()  # a class with no query gets no mass at all
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(2), torch.ones(3, 75), atol=1e-5, rtol=0)


def test_uniform_marginal_hurts_imbalanced_tasks_and_the_oracle_fixes_it() -> None:
    tasks, labels, counts = imbalanced_tasks()
    fair = (PTMAP().predict(tasks).argmax(2) == labels).double().mean(1)
    oracle = (PTMAP(query_counts=counts).predict(tasks).argmax(2) == labels).double().mean(1)
    assert (oracle >= 0.99).all()
    assert fair[0] < 0.9 and fair[1] < 0.9  # uniform Q/N columns force mass onto small / empty classes
    assert fair[2] >= 0.99  # balanced task: uniform is the truth


def test_only_class_prior_methods_take_counts() -> None:
    counts = torch.tensor(COUNTS)
    with pytest.raises(ValueError, match="does not use a class prior"):
        SimpleShot(query_counts=counts)
    # factories of other methods never forward counts, even if a caller puts them in the context
    for name in ("protonet", "simpleshot", "tim", "alpha_tim", "bdcspn", "laplacianshot", "putm"):
        assert not build_method(name, {}, shots=1, balanced=False, query_counts=counts).oracle_prior
    assert build_method("ptmap", {}, shots=1, balanced=False, query_counts=counts).oracle_prior
    assert not build_method("ptmap", {}, shots=1, balanced=False).oracle_prior


def test_oracle_counts_follow_the_chunks() -> None:
    tasks, _, counts = imbalanced_tasks(spread=0.8)
    whole = PTMAP(query_counts=counts).predict(tasks)
    chunked = PTMAP(query_counts=counts, memory_budget_mb=1e-3)
    assert chunked.num_chunks(tasks) == 3
    torch.testing.assert_close(chunked.predict(tasks), whole, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="expected"):
        PTMAP(query_counts=counts[:2]).predict(tasks)
    with pytest.raises(ValueError, match="summing to Q"):
        PTMAP(query_counts=counts + 1).predict(tasks)


def small_feature_set() -> FeatureSet:
    g = torch.Generator().manual_seed(1)
    labels = torch.arange(6).repeat_interleave(40)
    features = (torch.rand(6, 16, generator=g)[labels] * 2 + 0.5 * torch.randn(240, 16, generator=g)).clamp_min(0)
    return FeatureSet(features, labels, [f"c{c}" for c in range(6)])


@pytest.mark.parametrize("switch", [True, False])
def test_evaluation_marks_oracle_results(tmp_path, monkeypatch, switch: bool) -> None:
    received: dict[str, object] = {}
    real_build = evaluation.build_method

    def spy(name, params=None, **context):
        received[name] = context.get("query_counts")
        return real_build(name, params, **context)

    monkeypatch.setattr(evaluation, "build_method", spy)
    overrides = ["methods=[simpleshot,ptmap]", "shots=[1]", "alphas=[2]", "tasks=4", "queries=20",
                 "progress=false", "device=cpu", f"oracle_prior={str(switch).lower()}"]
    settings = settings_from_config(load_evaluate_config(overrides))
    assert settings.oracle_prior is switch
    results = evaluate_features(small_feature_set(), settings, lambda _: None)
    assert received["simpleshot"] is None  # never given to a method without a class prior
    if switch:
        assert torch.equal(received["ptmap"], results[1].bank.query_counts)
    else:
        assert received["ptmap"] is None
    flags = {r.method: r.summary().csv_row()["oracle_prior"] for r in results}
    assert flags == {"simpleshot": "false", "ptmap": "true" if switch else "false"}

    paths = write_report(results, tmp_path)
    with open(paths["results"]) as handle:
        rows = list(csv.DictReader(handle))
    assert {r["method"]: r["oracle_prior"] for r in rows} == flags
    with open(paths["per_task"]) as handle:
        per_task = list(csv.DictReader(handle))
    assert {(r["method"], r["oracle_prior"]) for r in per_task} == set(flags.items())
    table = format_table([r.summary() for r in results]).splitlines()
    assert "oracle_prior" in table[0]
    ptmap_line = next(line for line in table if line.startswith("ptmap"))
    assert ptmap_line.rstrip().endswith("true" if switch else "false")


def test_run_evaluate_warns_under_the_oracle(tmp_path) -> None:
    lines: list[str] = []
    run_evaluate(["methods=[simpleshot,ptmap]", "shots=[1]", "alphas=[2]", "tasks=3", "progress=false",
                  "device=cpu", "logger=none", "oracle_prior=true", f"output_dir={tmp_path}"], lines.append)
    assert any(line.startswith("WARNING") and "oracle_prior=true" in line for line in lines)
    lines.clear()
    run_evaluate(["methods=[simpleshot,ptmap]", "shots=[1]", "alphas=[2]", "tasks=3", "progress=false",
                  "device=cpu", "logger=none", f"output_dir={tmp_path}"], lines.append)
    assert not any(line.startswith("WARNING") for line in lines)


def test_oracle_prior_is_off_by_default_and_must_be_boolean() -> None:
    assert settings_from_config(load_evaluate_config([])).oracle_prior is False
    with pytest.raises(ConfigError, match="oracle_prior"):
        settings_from_config(load_evaluate_config(["oracle_prior=1"]))
