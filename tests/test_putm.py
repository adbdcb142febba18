"""PUTM's CT-EM solver (arXiv 2308.03047, Algorithm 1): navigators, QR, M-step, batching invariance, errors."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_clustered_features
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.errors import ConfigError, FeatureError
from lightning_putm.methods import build_method
from lightning_putm.methods.preprocessing import qr_reduce
from lightning_putm.methods.putm import PUTM
from lightning_putm.methods.putm.engines import e_step_autograd
from lightning_putm.methods.putm.loss import ct_loss
from lightning_putm.methods.putm.m_step import m_step
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.metrics import task_accuracy
from lightning_putm.tasks import TaskBatch

FAST = dict(em_steps=4, inner_steps=5)


def make_tasks(ways=5, shots=1, queries=40, alpha=2.0, tasks=6, dim=32, seed=0, spread=0.15):
    features = make_clustered_features(classes=10, per_class=60, dim=dim, spread=spread, seed=seed)
    bank = sample_episode_bank(features.labels, ways, shots, queries, alpha, tasks, seed)
    return bank.gather(features.features)


def test_navigators_are_normalised_over_classes_and_queries():
    gathered = make_tasks()
    putm = PUTM(shots=1, balanced=False, **FAST)
    x = putm.preprocess(gathered.batch)
    batch = gathered.batch
    prototypes = batch.support_means(x[:, : batch.num_support])
    gens = [torch.Generator().manual_seed(i) for i in range(batch.num_tasks)]
    nav = Navigator([x.shape[2], 128, 64, 1], gens, 1000, x.device, x.dtype, 0.01)
    optimiser = torch.optim.Adam(nav.parameters(), lr=1e-3, betas=(0.5, 0.99))
    query = x[:, batch.num_support :]
    forward, backward = e_step_autograd(nav, optimiser, query, prototypes, batch.ways, putm.settings)
    assert forward.shape == backward.shape == (6, 40, 5)
    assert torch.allclose(forward.sum(2), torch.ones(6, 40), atol=1e-5)  # π_f(·|j) over classes
    assert torch.allclose(backward.sum(1), torch.ones(6, 5), atol=1e-5)  # π_b(·|k) over queries


@pytest.mark.parametrize("dim,rows", [(640, 80), (64, 80), (20, 20)])
def test_qr_reduction_preserves_pairwise_geometry(dim, rows):
    x = torch.rand(3, rows, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(dim + rows))
    reduced = qr_reduce(x)
    assert reduced.shape == (3, rows, min(dim, rows))
    # cdist's default matmul form (|a|² + |b|² − 2ab) loses ~1e-6 near zero distances at d = 640 and made this test
    # fail on some seeds; the direct form is exact to ~1e-14 in float64 here, so the tolerance can be tight
    exact = "donot_use_mm_for_euclid_dist"
    assert torch.allclose(torch.cdist(reduced, reduced, compute_mode=exact), torch.cdist(x, x, compute_mode=exact),
                          atol=1e-10)
    assert torch.allclose(reduced @ reduced.transpose(1, 2), x @ x.transpose(1, 2), atol=1e-8)


def test_m_step_on_a_hand_made_case():
    rows = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 4.0]]])  # 2 support rows, 2 queries
    support_one_hot = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    query_weights = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    prototypes = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    updated = m_step(rows, support_one_hot, query_weights, prototypes, inertia=0.5)
    # class 0: weights (1, 0, 1, 0.5) -> mean ((1+2+0, 0+0+2) / 2.5) = (1.2, 0.8); class 1: (0,1,0,.5) -> (0, 3/1.5=2)
    estimate = torch.tensor([[[1.2, 0.8], [0.0, 2.0]]])
    assert torch.allclose(updated, prototypes + 0.5 * (estimate - prototypes))


def test_ct_loss_matches_its_formula():
    torch.manual_seed(0)
    cost = torch.rand(2, 4, 3)
    logits = torch.randn(2, 4, 3)
    forward, backward = logits.softmax(2), logits.softmax(1)
    rho, theta = 0.3, 0.2
    transport = rho * (cost * forward).sum(2).mean(1) + (1 - rho) * (cost * backward).sum(1).mean(1)
    balance = ((rho * forward + (1 - rho) * backward).sum(1) - 1 / 3).pow(2).mean(1)
    assert torch.allclose(ct_loss(cost, forward, backward, rho, theta), theta * balance + (1 - theta) * transport)
    assert torch.allclose(ct_loss(cost, forward, backward, rho, 0.0), transport)


def test_task_alone_equals_task_inside_batch():
    gathered = make_tasks(tasks=5)
    putm = PUTM(shots=1, balanced=False, **FAST)
    together = putm.predict(gathered.batch)
    for t in range(5):
        alone = putm.predict(gathered.batch.slice(t, t + 1))
        assert torch.equal(alone, together[t : t + 1])


def test_chunking_by_memory_budget_does_not_change_results():
    gathered = make_tasks(tasks=6)
    whole = PUTM(shots=1, balanced=False, memory_budget_mb=4096, **FAST)
    tiny = PUTM(shots=1, balanced=False, memory_budget_mb=0.5, **FAST)
    assert whole.num_chunks(gathered.batch) == 1 and tiny.num_chunks(gathered.batch) > 1
    assert torch.equal(whole.predict(gathered.batch), tiny.predict(gathered.batch))


def test_permuting_queries_permutes_predictions():
    gathered = make_tasks(tasks=3)
    batch = gathered.batch
    putm = PUTM(shots=1, balanced=False, **FAST)
    original = putm.predict(batch)
    perm = torch.randperm(batch.num_queries, generator=torch.Generator().manual_seed(1))
    shuffled = TaskBatch(batch.support, batch.support_labels, batch.query[:, perm], batch.ways, batch.task_seeds)
    assert torch.equal(putm.predict(shuffled), original[:, perm])


def test_navigator_initial_scale_uses_fixed_task_count_not_batch_size():
    gens = [torch.Generator().manual_seed(s) for s in range(200)]
    nav = Navigator([80, 128, 64, 1], gens, 1000, torch.device("cpu"), torch.float32, 0.01)
    for w, (fan_in, fan_out) in zip(nav.weights, [(80, 128), (128, 64), (64, 1)]):
        expected = math.sqrt(2.0 / (fan_out * (fan_in + 1000)))
        assert abs(float(w.detach().std()) / expected - 1) < 0.05
    assert all(float(b.abs().max()) == 0.0 for b in nav.biases)
    # task 3's weights do not depend on which batch it is drawn in
    alone = Navigator([80, 128, 64, 1], [torch.Generator().manual_seed(3)], 1000, torch.device("cpu"), torch.float32, 0.01)
    assert torch.equal(alone.weights[0][0], nav.weights[0][3])


def test_high_accuracy_on_clear_imbalanced_problem():
    gathered = make_tasks(alpha=1.0, tasks=8, queries=60, spread=0.35)
    putm = build_method("putm", {}, shots=1, balanced=False)
    accuracy = task_accuracy(putm.predict(gathered.batch), gathered.query_labels)
    assert float(accuracy.mean()) > 0.95


def test_settings_default_by_sampling_mode_and_shot():
    dirichlet = PUTM(shots=1, balanced=False).settings
    balanced = PUTM(shots=5, balanced=True).settings
    assert (dirichlet.rho, dirichlet.theta, dirichlet.inertia) == (0.5, 0.0, 0.2)
    assert (balanced.rho, balanced.theta, balanced.inertia) == (1.0, 0.001, 0.1)
    assert PUTM(shots=5, balanced=True, rho=0.7, inertia=0.3).settings.rho == 0.7
    with pytest.raises(ConfigError):
        PUTM(shots=1, balanced=False, prototype_update="sideways")
    with pytest.raises(ConfigError):
        PUTM(shots=1, balanced=False, rho=1.5)


@pytest.mark.parametrize("options", [dict(reinit_navigator=True), dict(prototype_update="backward"),
                                     dict(prototype_update="mixed"), dict(theta=0.1, rho=0.8)])
def test_options_give_valid_probabilities(options):
    gathered = make_tasks(ways=3, shots=2, queries=13, tasks=2)
    probabilities = PUTM(shots=2, balanced=False, **FAST, **options).predict(gathered.batch)
    assert probabilities.shape == (2, 13, 3)
    assert torch.allclose(probabilities.sum(2), torch.ones(2, 13), atol=1e-5)


def test_features_narrower_than_the_task_work():
    gathered = make_tasks(dim=16, queries=75)  # d = 16 < n = 80
    probabilities = PUTM(shots=1, balanced=False, **FAST).predict(gathered.batch)
    assert probabilities.shape == (6, 75, 5) and torch.isfinite(probabilities).all()


def test_negative_and_nan_features_give_clear_errors():
    gathered = make_tasks(tasks=1)
    batch = gathered.batch
    negative = TaskBatch(batch.support - 5.0, batch.support_labels, batch.query, batch.ways, batch.task_seeds)
    with pytest.raises(FeatureError, match="non-negative"):
        PUTM(shots=1, balanced=False, **FAST).predict(negative)
    nan_query = batch.query.clone()
    nan_query[0, 3, 1] = float("nan")
    with pytest.raises(FeatureError, match="NaN"):
        PUTM(shots=1, balanced=False, **FAST).predict(
            TaskBatch(batch.support, batch.support_labels, nan_query, batch.ways, batch.task_seeds))
