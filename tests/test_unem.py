"""UNEM, Gaussian variant (Zhou et al., CVPR 2025): each test names the mutants of lightning_putm/methods/unem.py,
unem_fit.py and studies/fit_unem.py it kills."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.tasks import clustered_tasks
from lightning_putm.errors import ConfigError
from lightning_putm.studies import fit_unem as cached_fit
from lightning_putm.features import FeatureSet
from lightning_putm.methods import build_method, method_display_name, method_uses_class_prior
from lightning_putm.methods.unem import UNEM, UNEMParams, load_params, preset_params, unem_forward
from lightning_putm.methods.unem_fit import FitSettings, evaluate_loss, fit_params, save_params, unrolling_loss
from lightning_putm.methods.unem_presets import PUBLISHED
from lightning_putm.tasks import TaskBatch


#: Tiny tasks: one torch thread (conftest's ``single_thread``) avoids two threads spinning on a shared machine.
pytestmark = pytest.mark.usefixtures("single_thread")


def softplus_inverse(y: float) -> float:
    return math.log(math.expm1(y))


def params_of(t1: float, gamma: list[float], t2: list[float]) -> UNEMParams:
    """Parameters given by their softplus values (what the equations use)."""
    return UNEMParams.from_values(softplus_inverse(t1), [softplus_inverse(g) for g in gamma],
                                  [softplus_inverse(t) for t in t2])


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return float((probs.argmax(2) == labels).double().mean())


# ------------------------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize("counts, shots, dim", [
    ([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55]], 1, 32),  # 5-way 1-shot, an empty class
    ([[4, 3, 3], [0, 9, 1]], 2, 48),  # 3-way 2-shot, Q = 10
    ([[1, 2, 0, 3, 4, 5, 8]], 5, 8),  # 7-way 5-shot, d < n
])
def test_probabilities_for_any_ways_shots_queries(counts, shots, dim) -> None:
    """Kills: hard-coded 5 ways / 75 queries, a softmax over queries instead of classes, NaN on an empty class."""
    tasks, _ = clustered_tasks(counts, shots, dim, spread=1.0)
    probs = build_method("unem", {}, shots=shots, balanced=False).predict(tasks)
    assert probs.shape == (tasks.num_tasks, tasks.num_queries, tasks.ways)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(2), torch.ones(tasks.num_tasks, tasks.num_queries), atol=1e-5, rtol=0)


def test_batched_equals_per_task_and_chunked() -> None:
    """Kills: statistics pooled over the batch (proportions or prototypes across tasks), chunk-dependent results."""
    tasks, _ = clustered_tasks([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55], [15] * 5, [1, 2, 3, 4, 65]], 2, 16, spread=0.8)
    method = UNEM(shots=2)
    together = method.predict(tasks)
    for i in range(tasks.num_tasks):
        alone = method.predict(tasks.slice(i, i + 1))
        torch.testing.assert_close(alone[0], together[i], atol=1e-6, rtol=0)
        assert torch.equal(alone[0].argmax(1), together[i].argmax(1))
    chunked = UNEM(shots=2, memory_budget_mb=1e-4).predict(tasks)  # one task per chunk
    torch.testing.assert_close(chunked, together, atol=1e-6, rtol=0)


def test_query_permutation_equivariance() -> None:
    """Kills: anything that depends on the query order (e.g. a prior taken from the first queries)."""
    tasks, _ = clustered_tasks([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55]], 1, 16, spread=0.8)
    perm = torch.randperm(tasks.num_queries, generator=torch.Generator().manual_seed(3))
    shuffled = TaskBatch(tasks.support, tasks.support_labels, tasks.query[:, perm], tasks.ways, tasks.task_seeds)
    method = UNEM(shots=1)
    moved, original = method.predict(shuffled), method.predict(tasks)[:, perm]
    torch.testing.assert_close(moved, original, atol=1e-5, rtol=0)  # only the summation order differs
    assert torch.equal(moved.argmax(2), original.argmax(2))


# ------------------------------------------------------------------------------------------------ the equations
def scalar_unem(support: list[list[float]], labels: list[int], query: list[list[float]], ways: int, t1: float,
                gammas: list[float], t2s: list[float]) -> list[list[float]]:
    """UNEM written with Python floats from the paper's updates (softplus values given): scale, init, L layers."""
    zs = [[t1 * x for x in row] for row in support]
    zq = [[t1 * x for x in row] for row in query]
    d = len(zs[0])
    w = [[sum(zs[i][c] for i in range(len(zs)) if labels[i] == k) / labels.count(k) for c in range(d)]
         for k in range(ways)]
    v = [1.0] * ways
    u: list[list[float]] = []
    for gamma, t2 in zip(gammas, t2s):
        u = []
        for z in zq:
            scores = [(-0.5 * sum((z[c] - w[k][c]) ** 2 for c in range(d)) + gamma * v[k]) / (1 + t2)
                      for k in range(ways)]
            top = max(scores)
            e = [math.exp(s - top) for s in scores]
            u.append([x / sum(e) for x in e])
        v = [math.log(sum(row[k] for row in u) / len(u) + 1e-6) + 1 for k in range(ways)]
        w = [[(sum(u[j][k] * zq[j][c] for j in range(len(zq)))
               + sum(zs[i][c] for i in range(len(zs)) if labels[i] == k))
              / (sum(u[j][k] for j in range(len(zq))) + labels.count(k)) for c in range(d)] for k in range(ways)]
    return u


def test_first_layer_by_hand() -> None:
    """One E-step on a 1-d task, computed by hand: support 0 (class 0) and 2 (class 1), query 0.5, τ₁ = 1, τ₂ = 1:
    u = softmax([−½·0.25, −½·2.25] / 2) → u₀ = 1 / (1 + e^−0.5) = 0.622459. Kills: the temperature applied as
    a product or without the 1 +, a missing ½, squared distances replaced by distances."""
    out = unem_forward(torch.tensor([[[0.0], [2.0]]]), F.one_hot(torch.tensor([[0, 1]]), 2).float(),
                       torch.tensor([[[0.5]]]), params_of(1.0, [3.0], [1.0]))
    assert out[0, 0, 0].item() == pytest.approx(1 / (1 + math.exp(-0.5)), abs=1e-6)


def test_three_layers_match_the_scalar_equations() -> None:
    """Kills: support rows left out of the M-step, a missing γ·v term, the feature scale τ₁ not applied to both
    sets, the last layer's u not the output, layers sharing γ or τ₂. (Proportions from sums instead of means, or
    without the + 1, are equivalent: they shift every class by the same amount before the softmax.)"""
    g = torch.Generator().manual_seed(0)
    support = torch.rand(5, 3, generator=g) * 2
    labels = [0, 1, 2, 0, 1]
    query = torch.rand(7, 3, generator=g) * 2
    t1, gammas, t2s = 1.7, [0.8, 2.5, 4.0], [0.3, 1.2, 0.6]
    expected = scalar_unem(support.tolist(), labels, query.tolist(), 3, t1, gammas, t2s)
    out = unem_forward(support[None].double(), F.one_hot(torch.tensor([labels]), 3).double(), query[None].double(),
                       params_of(t1, gammas, t2s))
    torch.testing.assert_close(out[0], torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_class_balance_weight_changes_the_assignments() -> None:
    """γ multiplies the log-proportions: from the second layer on, a larger γ pulls ambiguous queries into the
    classes that already hold most of the mass. Kills: γ ignored, γ applied with the wrong sign."""
    tasks, _ = clustered_tasks([[60, 10, 5]], 1, 8, spread=1.2, seed=4)
    low = unem_forward(tasks.support, tasks.one_hot_support(), tasks.query, params_of(1.0, [1.0, 0.01], [0.5, 0.5]))
    high = unem_forward(tasks.support, tasks.one_hot_support(), tasks.query, params_of(1.0, [1.0, 8.0], [0.5, 0.5]))
    big = int(low.mean(1).argmax())
    assert high.mean(1)[0, big] > low.mean(1)[0, big] + 0.01


# ------------------------------------------------------------------------------------------------ fairness
def test_oracle_free_never_reads_query_counts() -> None:
    """Kills: a class prior sneaking in (the flag) or the factory passing the oracle counts on."""
    tasks, _ = clustered_tasks([[40, 20, 10, 5, 0]], 1, 16, spread=0.8)
    counts = torch.tensor([[40, 20, 10, 5, 0]])
    assert not UNEM.uses_class_prior and not method_uses_class_prior("unem")
    assert method_display_name("unem") == "UNEM"
    with pytest.raises(ValueError, match="class prior"):
        UNEM(query_counts=counts)
    built = build_method("unem", {}, shots=1, balanced=False, query_counts=counts)
    assert not built.oracle_prior
    assert torch.equal(built.predict(tasks), build_method("unem", {}, shots=1, balanced=True).predict(tasks))


def test_normalise_l2_is_scale_invariant_and_none_is_not() -> None:
    """Kills: the normalise option ignored (either way)."""
    tasks, _ = clustered_tasks([[15] * 5], 1, 16, spread=1.0)
    scaled = TaskBatch(tasks.support * 7, tasks.support_labels, tasks.query * 7, tasks.ways, tasks.task_seeds)
    l2 = UNEM(shots=1, normalise="l2")
    torch.testing.assert_close(l2.predict(scaled), l2.predict(tasks), atol=1e-5, rtol=0)
    raw = UNEM(shots=1)
    assert (raw.predict(scaled) - raw.predict(tasks)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize("shots, published", [(1, 1), (2, 1), (3, 5), (5, 5), (7, 5), (15, 20), (40, 20)])
def test_learned_values_come_from_the_nearest_published_shot_count(shots: int, published: int) -> None:
    """Kills: another preset under its name, nearest shot count on a linear scale (3 → 1 or 15 → 10), raw and
    softplus values mixed up (the table holds raw values, as the authors' state dicts), a default (``auto``) that
    is anything but the untrained start where nothing was fitted."""
    method = UNEM(shots=shots, learned="mini_resnet18")
    entry = PUBLISHED["mini_resnet18"][published]
    assert method.params.t1.item() == pytest.approx(entry["t1"])
    assert method.params.gamma.tolist() == pytest.approx(entry["gamma"])
    assert method.params.t2.tolist() == pytest.approx(entry["t2"])
    assert method.params.layers == 10
    initial = UNEM(shots=shots, learned="initial").params
    assert initial.t1.item() == 1.0 and initial.gamma.tolist() == [1.0] * 10 and initial.t2.tolist() == [1.0] * 10
    default = UNEM(shots=shots)  # learned=auto, nothing fitted (evaluate.py fits on validation classes itself)
    assert default.learned == "auto" and default.learned_inputs()["params"] == UNEM(learned="initial").learned_inputs()[
        "params"] and "untrained start" in default.params_source


def test_reference_loss_is_cross_entropy_of_the_probabilities() -> None:
    """The reference feeds probabilities to CrossEntropyLoss: CE of softmax([1, 0]) is log(1 + e^-1); nll is -log 1.
    Kills: the two losses swapped, or the reference loss 'fixed' silently."""
    probs, labels = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[0]])
    assert unrolling_loss(probs, labels, "reference").item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert unrolling_loss(probs, labels, "nll").item() == pytest.approx(0.0, abs=1e-6)


def validation_tasks(seed: int) -> tuple[TaskBatch, torch.Tensor]:
    """Overlapping, imbalanced classes, so the unrolled EM has something to learn."""
    g = torch.Generator().manual_seed(seed)
    counts = []
    for _ in range(24):
        p = torch.distributions.Dirichlet(torch.full((5,), 2.0)).sample() if seed >= 0 else None
        c = (p * 30).floor().long()
        c[0] += 30 - int(c.sum())
        counts.append(c.tolist())
    torch.manual_seed(seed)
    return clustered_tasks(counts, 1, 8, spread=0.6, scale=1.5, seed=int(torch.randint(0, 1000, (1,), generator=g)))


def test_fit_lowers_the_held_out_loss_and_the_file_round_trips(tmp_path) -> None:
    """Kills: a fit that does not backpropagate through the layers (no change), an optimiser stepping the wrong way,
    a saved file that loses or reorders values, params_file not used by the method."""
    train, train_labels = validation_tasks(0)
    held, held_labels = validation_tasks(1)
    settings = FitSettings(iterations=40, loss="nll")
    fitted, history = fit_params(train, train_labels, settings)
    assert len(history) == 40 and history[-1] < history[0] - 0.05
    assert evaluate_loss(fitted, held, held_labels, settings) < evaluate_loss(UNEMParams.initial(), held, held_labels,
                                                                              settings) - 0.05
    assert not torch.equal(fitted.t1, UNEMParams.initial().t1) and (fitted.t2 != 1.0).all()
    path = save_params(tmp_path / "unem.json", fitted, {"note": "test"})
    loaded = load_params(path)
    assert torch.equal(loaded.t1, fitted.t1) and torch.equal(loaded.gamma, fitted.gamma)
    assert torch.equal(loaded.t2, fitted.t2)
    from_file = build_method("unem", {"params_file": str(path)}, shots=1, balanced=False)
    assert from_file.params_source == str(path)
    assert torch.equal(from_file.predict(held), UNEM(shots=1, params=fitted).predict(held))


def test_params_file_with_shots_placeholder_picks_the_file_of_the_setting(tmp_path) -> None:
    """One evaluation over several shot counts names one fitted file per shot count. Kills: the placeholder ignored
    (a missing-file error) or filled with another setting's shots."""
    save_params(tmp_path / "fit_1shot.json", params_of(1.0, [1.0, 2.0], [0.5, 0.5]))
    save_params(tmp_path / "fit_5shot.json", params_of(2.0, [1.0], [0.5]))
    template = str(tmp_path / "fit_{shots}shot.json")
    assert build_method("unem", {"params_file": template}, shots=1, balanced=False).params.layers == 2
    assert build_method("unem", {"params_file": template}, shots=5, balanced=True).params.layers == 1
    with pytest.raises(ConfigError, match="fit_3shot"):
        build_method("unem", {"params_file": template}, shots=3, balanced=False)


def test_cached_fit_runs_once_per_key(tmp_path, monkeypatch) -> None:
    """Kills: a cache that refits every time, or one that serves a file fitted on other features/settings."""
    g = torch.Generator().manual_seed(0)
    centres = torch.rand(8, 6, generator=g) * 2
    labels = torch.arange(8).repeat_interleave(20)
    features = FeatureSet(centres[labels] + 0.5 * torch.randn(160, 6, generator=g), labels,
                          [f"c{i}" for i in range(8)])
    fit = lambda **kw: cached_fit.fit_unem_cached(features, 1, queries=15, tasks=20, cache_dir=tmp_path,  # noqa: E731
                                                   settings=FitSettings(iterations=3), log=lambda _: None, **kw)
    path, first = fit()
    assert json.loads(path.read_text())["meta"]["episodes"]["tasks"] == 20
    calls = []
    monkeypatch.setattr("lightning_putm.methods.unem_fit.fit_params",  # fit_unem imports it when it fits
                        lambda *a, **k: calls.append(1) or (UNEMParams.initial(), [1.0]))
    again, second = fit()
    assert again == path and not calls and torch.equal(first.t2, second.t2)
    other, _ = fit(seed=1)  # other episodes: another key, fitted again
    assert other != path and calls == [1]


def test_authors_state_dict_loads(tmp_path) -> None:
    """The authors' U_PADDLE_EMBT_L_<K>shots.pt layout (t1, gamma.<i>, t2.<i>) is read weights-only, in layer order."""
    state = {"t1": torch.tensor(0.5)}
    state.update({f"gamma.{i}": torch.tensor(float(i)) for i in range(3)})
    state.update({f"t2.{i}": torch.tensor(-float(i)) for i in range(3)})
    torch.save(state, tmp_path / "U_PADDLE_EMBT_L_1shots.pt")
    params = load_params(tmp_path / "U_PADDLE_EMBT_L_1shots.pt")
    assert params.t1.item() == 0.5 and params.gamma.tolist() == [0.0, 1.0, 2.0] and params.t2.tolist() == [0, -1, -2]


class Payload(float):
    """A pickled custom object: a plain unpickler would accept it as a valid t1; weights_only must refuse it."""


@pytest.mark.parametrize("name, content", [
    ("missing.json", None),
    ("garbage.json", "not json {"),
    ("other.json", json.dumps({"format": "something-else", "t1": 1, "gamma": [1], "t2": [1]})),
    ("short.json", json.dumps({"format": "lightning-putm/unem-gaussian/1", "t1": 1, "gamma": [1, 2], "t2": [1]})),
    ("nan.json", '{"format": "lightning-putm/unem-gaussian/1", "t1": NaN, "gamma": [1], "t2": [1]}'),
    ("pickle.pt", Payload),
    ("wrongkeys.pt", {"t1": torch.tensor(1.0), "gamma": torch.ones(3)}),
])
def test_bad_params_file_is_a_clear_error_naming_the_file(tmp_path, name, content) -> None:
    """Kills: unpickling (weights_only=False), a traceback instead of a ConfigError, an error without the path."""
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content)
    elif content is Payload:
        torch.save({"t1": Payload(1.0), "gamma.0": torch.tensor(1.0), "t2.0": torch.tensor(1.0)}, path)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        build_method("unem", {"params_file": str(path)}, shots=1, balanced=False)


def test_unknown_learned_preset_is_refused() -> None:
    with pytest.raises(ConfigError, match="method.unem.learned"):
        build_method("unem", {"learned": "imagenet"}, shots=1, balanced=False)
    with pytest.raises(ConfigError, match="method.unem.learned"):
        preset_params("imagenet", 1)
