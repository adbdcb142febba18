"""iLPC (Lazarou et al., ICCV 2021): each test names the mutant of lightning_putm/methods/ilpc.py it kills."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.tasks import clustered_tasks
from lightning_putm.errors import ConfigError
from lightning_putm.methods import build_method, method_uses_class_prior
from lightning_putm.methods.ilpc import (
    ILPC,
    balance_scores,
    knn_graph,
    select_per_class,
    signed_power,
)
from lightning_putm.tasks import TaskBatch


@pytest.fixture(autouse=True)
def one_thread():
    """These tasks are tiny (hundreds of small matmuls each): on a shared 2-core machine two torch threads
    spin against other processes and the file takes ~45 s instead of ~3 s. Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_tasks(counts: list[list[int]], shots: int = 1, dim: int = 16, spread: float = 0.15,
               seed: int = 0) -> tuple[TaskBatch, torch.Tensor]:
    """One tight non-negative cluster per class; ``counts[t][k]`` queries of class k in task t."""
    return clustered_tasks(counts, shots, dim, spread, seed=seed, task_seeds=torch.arange(len(counts)) * 7919 + 11)


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return float((probs.argmax(2) == labels).double().mean())


# ------------------------------------------------------------------------------------------------ graph
def test_knn_graph_matches_a_hand_built_symmetric_normalised_graph() -> None:
    """Kills: wrong k, self loops, missing W + Wᵀ, missing s^γ, missing/one-sided D^-1/2 normalisation."""
    g = torch.Generator().manual_seed(1)
    rows = torch.nn.functional.normalize(torch.rand(1, 7, 3, generator=g) + 0.1, dim=2).double()
    k, gamma = 2, 3.0
    x = rows[0].numpy()
    sims = x @ x.T
    w = np.zeros((7, 7))
    for i in range(7):
        order = [j for j in np.argsort(-sims[i]) if j != i][:k]
        w[i, order] = sims[i, order] ** gamma
    w = w + w.T
    np.fill_diagonal(w, 0)
    d = w.sum(1)
    expected = w / np.sqrt(np.outer(d, d))
    got = knn_graph(rows, k, gamma)[0].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert ((got > 0).sum(1) >= k).all() and (np.diag(got) == 0).all()
    np.testing.assert_allclose(got, got.T)


def test_knn_graph_clips_negative_similarities_only_when_asked() -> None:
    """Kills: cubing negative similarities under positive_affinity (negative weights and degrees), or
    clipping them when the reference's behaviour (positive=False) is asked for."""
    rows = torch.nn.functional.normalize(torch.tensor([[[1.0, 0.0], [0.6, 0.8], [-1.0, 0.1]]]), dim=2).double()
    clipped = knn_graph(rows, 2, 3.0, positive=True)[0]
    raw = knn_graph(rows, 2, 3.0, positive=False)[0]
    assert (clipped >= 0).all() and clipped[0, 2] == 0 and clipped[1, 2] == 0
    assert raw[0, 2] < 0


def test_knn_graph_caps_k_at_n_minus_one() -> None:
    """Kills: topk(k) on fewer than k other rows (crash) for tiny tasks."""
    rows = torch.nn.functional.normalize(torch.rand(2, 4, 3) + 0.1, dim=2)
    graph = knn_graph(rows, 20)
    assert torch.isfinite(graph).all() and ((graph > 0).sum(2) == 3).all()


def test_propagation_is_the_closed_form_on_a_hand_made_graph() -> None:
    """Kills: wrong α, Y not one-hot of the labelled rows, unlabelled rows leaking into Y, no clip / L1 step."""
    w = torch.tensor([[0, 1, 0, 0, 1], [1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [0, 0, 1, 0, 1], [1, 0, 0, 1, 0]],
                     dtype=torch.float64)
    d = w.sum(1).rsqrt()
    wn = d[:, None] * w * d[None, :]
    alpha = 0.6
    method = ILPC(alpha=alpha)
    lu = torch.linalg.lu_factor((torch.eye(5, dtype=torch.float64) - alpha * wn)[None])
    labels = torch.tensor([[0, 1, 1, 0, 1]])  # rows 2..4 carry junk labels but are unlabelled except row 3
    labelled = torch.tensor([[True, True, False, True, False]])
    got = method.propagate(lu, labels, labelled, 2)[0]
    y = np.zeros((5, 2))
    y[0, 0] = y[1, 1] = y[3, 0] = 1
    z = np.linalg.solve(np.eye(5) - alpha * wn.numpy(), y).clip(min=0)
    np.testing.assert_allclose(got.numpy(), z / z.sum(1, keepdims=True), rtol=1e-10)


# ------------------------------------------------------------------------------------------------ balancing
def test_sinkhorn_marginals_and_power() -> None:
    """Kills: swapped marginals, masked (already labelled) rows getting mass, missing scores^power."""
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(3, 9, 4, generator=g, dtype=torch.float64) + 0.01
    rows = torch.ones(3, 9, dtype=torch.float64)
    rows[:, :3] = 0  # three queries already labelled
    columns = torch.tensor([[1.5, 1.5, 1.5, 1.5], [3.0, 2.0, 1.0, 0.0], [6.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    plan = balance_scores(scores * rows[..., None], rows, columns, power=3.0, eps=1e-12, max_iters=5000)
    torch.testing.assert_close(plan.sum(1), columns)
    torch.testing.assert_close(plan.sum(2), rows, atol=1e-9, rtol=0)
    # one iteration only: exactly one row then one column scaling of scores^3
    one = balance_scores(scores, torch.ones(3, 9, dtype=torch.float64), columns + 0.75, power=3.0, max_iters=1)
    p = scores.pow(3)
    p = p / p.sum(2, keepdim=True)
    p = p * ((columns + 0.75) / p.sum(1)).unsqueeze(1)
    torch.testing.assert_close(one, p)


def test_select_per_class_takes_the_lowest_losses_of_each_class() -> None:
    """Kills: highest instead of lowest loss, a global instead of per-class top, picking labelled rows."""
    loss = torch.tensor([[0.5, 0.1, 0.9, 0.2, 0.3, 0.05, 0.7]])
    labels = torch.tensor([[0, 0, 0, 1, 1, 1, 0]])
    candidates = torch.tensor([[True, True, True, True, True, False, True]])
    chosen = select_per_class(loss, labels, candidates, ways=3, per_class=2)
    assert chosen[0].tolist() == [True, True, False, True, True, False, False]


# ------------------------------------------------------------------------------------------------ cleaning
def test_cleaning_losses_match_torch_sgd_on_a_linear_layer() -> None:
    """Kills: wrong gradient, momentum, learning rate, weight decay (incl. on the bias), imprinting or loss
    averaging — compared with the reference's recipe: nn.Linear + torch.optim.SGD + autograd."""
    g = torch.Generator().manual_seed(3)
    n, d, ways = 12, 6, 3
    x = torch.nn.functional.normalize(torch.randn(1, n, d, generator=g, dtype=torch.float64), dim=2)
    labels = torch.randint(0, ways, (1, n), generator=g)
    labels[0, :ways] = torch.arange(ways)
    labelled = torch.zeros(1, n, dtype=torch.bool)
    labelled[0, :5] = True
    bias = torch.randn(1, ways, generator=g, dtype=torch.float64) * 0.1
    method = ILPC(denoising_iterations=25)
    got = method.cleaning_losses(x, labels, labelled, ways, bias)[0]

    layer = torch.nn.Linear(d, ways).double()
    means = torch.stack([x[0, :5][labels[0, :5] == c].mean(0) for c in range(ways)])
    with torch.no_grad():
        layer.weight.copy_(torch.nn.functional.normalize(means, dim=1))
        layer.bias.copy_(bias[0])
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(25):
        each = torch.nn.functional.cross_entropy(layer(x[0]), labels[0], reduction="none")
        sgd.zero_grad()
        each.mean().backward()
        sgd.step()
        total += each.detach() / 25
    torch.testing.assert_close(got, total)


def test_classifier_bias_is_what_nn_linear_draws_after_manual_seed() -> None:
    """Kills: a bias not seeded from task_seeds, or drawn without first consuming the weight draw (then the
    reference seeded with the task seed would use a different bias)."""
    method = ILPC()
    seeds = [5, 123456789]
    got = method._initial_bias([torch.Generator().manual_seed(s) for s in seeds], 4, 10, torch.device("cpu"),
                               torch.float32)
    for row, seed in zip(got, seeds):
        torch.manual_seed(seed)
        torch.testing.assert_close(row, torch.nn.Linear(10, 4).bias.detach())


# ------------------------------------------------------------------------------------------------ rounds
@pytest.mark.parametrize("best, expected", [(3, [15] * 5), (2, [10] * 7 + [5])])
def test_rounds_move_best_samples_per_class_until_all_are_labelled(best: int, expected: list[int]) -> None:
    """Kills: a wrong number of queries moved per class and round, or stopping before all are labelled."""
    tasks, labels = make_tasks([[15] * 5, [15] * 5])
    method = ILPC(balanced=True, best_samples=best, denoising_iterations=10)
    probs = method.predict(tasks)
    moved = method.last_state["moved_per_round"]
    assert moved[0].tolist() == expected and moved[1].tolist() == expected
    assert (method.last_state["moved_at"] >= 0).all()
    assert accuracy(probs, labels) == 1.0


def test_fewer_than_min_moved_stops_and_keeps_the_last_round_scores() -> None:
    """Kills: ignoring the reference's `< 5 selected → stop` rule (the task would run one more round)."""
    tasks, _ = make_tasks([[3, 3, 3, 3]])
    method = ILPC(balance="none", best_samples=2, k=3, denoising_iterations=10)
    probs = method.predict(tasks)
    assert method.last_state["moved_per_round"][0].tolist() == [8, 0]
    assert int((method.last_state["moved_at"] == -1).sum()) == 4
    torch.testing.assert_close(probs.sum(2), torch.ones(1, 12))


def test_uniform_balance_keeps_pseudo_labels_balanced() -> None:
    """Kills: Sinkhorn not applied under balance=uniform, or the remaining-count marginal not updated after a
    move (on these noisy tasks unbalanced propagation predicts 10..23 queries per class)."""
    tasks, _ = make_tasks([[15] * 5], spread=1.2, seed=4)
    method = ILPC(balance="uniform", denoising_iterations=20)
    method.predict(tasks)
    assert method.last_state["moved_per_round"][0, :4].tolist() == [15] * 4
    assert torch.bincount(method.last_state["pseudo_labels"][0], minlength=5).tolist() == [15] * 5
    plain = ILPC(balance="none", denoising_iterations=20)
    plain.predict(tasks)
    assert torch.bincount(plain.last_state["pseudo_labels"][0], minlength=5).tolist() != [15] * 5


# ------------------------------------------------------------------------------------------------ interface
def test_auto_balance_follows_the_protocol_and_only_the_oracle_gets_counts() -> None:
    """Kills: the uniform (balanced-task) prior used on Dirichlet tasks by default, or counts reaching a
    fair run."""
    assert build_method("ilpc", {}, shots=1, balanced=True).resolved_balance == "uniform"
    fair = build_method("ilpc", {}, shots=1, balanced=False)
    assert fair.resolved_balance == "none" and not fair.oracle_prior
    assert method_uses_class_prior("ilpc")
    oracle = build_method("ilpc", {}, shots=1, balanced=False, query_counts=torch.tensor([[3, 0, 2]]))
    assert oracle.oracle_prior
    with pytest.raises(ConfigError):
        build_method("ilpc", {"balance": "sometimes"}, shots=1, balanced=False)


def test_oracle_counts_set_the_balancing_marginal() -> None:
    """Kills: oracle counts ignored (on these noisy tasks the fair run predicts 10..23 per class instead)."""
    counts = [25, 0, 10, 25, 15]
    tasks, _ = make_tasks([counts], spread=1.2, seed=4)
    method = build_method("ilpc", {"denoising_iterations": 20}, shots=1, balanced=False,
                          query_counts=torch.tensor([counts]))
    probs = method.predict(tasks)
    assert torch.bincount(probs.argmax(2)[0], minlength=5).tolist() == counts
    fair = build_method("ilpc", {"denoising_iterations": 20}, shots=1, balanced=False).predict(tasks)
    assert torch.bincount(fair.argmax(2)[0], minlength=5).tolist() != counts


@pytest.mark.parametrize("balance", ["none", "uniform"])
def test_class_without_queries_gives_valid_probabilities(balance: str) -> None:
    """Kills: NaN from an empty class (0/0 in normalisation or Sinkhorn), rows not summing to 1."""
    tasks, labels = make_tasks([[20, 0, 10, 5, 5], [0, 0, 16, 14, 10]], shots=2)
    probs = ILPC(balance=balance, denoising_iterations=20).predict(tasks)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(2), torch.ones(2, 40))
    if balance == "none":
        assert accuracy(probs, labels) == 1.0


@pytest.mark.parametrize("shots", [1, 5])
def test_near_perfect_on_separated_data(shots: int) -> None:
    """Kills: any sign/indexing error in preprocessing, propagation or the output rows."""
    for balanced, counts in ((True, [[15] * 5, [15] * 5]), (False, [[15] * 5, [30, 5, 10, 20, 10]])):
        tasks, labels = make_tasks(counts, shots=shots, spread=0.3, seed=7)
        method = build_method("ilpc", {"denoising_iterations": 30}, shots=shots, balanced=balanced)
        assert accuracy(method.predict(tasks), labels) >= 0.97


def test_deterministic_and_chunk_independent() -> None:
    """Kills: a global RNG or cross-task coupling (batch-wide Sinkhorn stop, batch-wide loop exit)."""
    tasks, _ = make_tasks([[15] * 5, [40, 5, 10, 10, 10], [3, 30, 30, 7, 5]], spread=1.0, seed=8)
    method = ILPC(balance="uniform", denoising_iterations=10)
    whole = method.predict(tasks)
    torch.testing.assert_close(method.predict(tasks), whole, rtol=0, atol=0)
    chunked = ILPC(balance="uniform", denoising_iterations=10, memory_budget_mb=1e-3)
    assert chunked.num_chunks(tasks) == 3
    torch.testing.assert_close(chunked.predict(tasks), whole, rtol=1e-5, atol=1e-6)
    alone = ILPC(balance="uniform", denoising_iterations=10).predict(tasks.slice(2, 3))
    torch.testing.assert_close(alone, whole[2:3], rtol=1e-5, atol=1e-6)


def test_signed_power_keeps_the_sign_and_accepts_negative_features() -> None:
    """Kills: the non-negative-only power transform (would reject centred features) or a lost sign."""
    x = torch.tensor([-4.0, 0.0, 9.0])
    torch.testing.assert_close(signed_power(x, 0.5), torch.tensor([-(4 + 1e-6) ** 0.5, 1e-3, (9 + 1e-6) ** 0.5]))
    tasks, labels = make_tasks([[10, 10, 10]], spread=0.1)
    shifted = TaskBatch(tasks.support - 1.0, tasks.support_labels, tasks.query - 1.0, tasks.ways, tasks.task_seeds)
    assert accuracy(ILPC(denoising_iterations=20).predict(shifted), labels) >= 0.95


def test_the_task_seed_drives_the_classifier_bias() -> None:
    """Kills: one fixed or global seed for every task (the same task with another seed must be able to move
    other queries, as the reference's nn.Linear bias differs with torch.manual_seed)."""
    tasks, _ = make_tasks([[15] * 5], spread=1.5, seed=4, dim=8)
    moved = []
    for seed in (1, 3):
        method = ILPC(balance="none", denoising_iterations=20)
        method.predict(TaskBatch(tasks.support, tasks.support_labels, tasks.query, 5, torch.tensor([seed])))
        moved.append(method.last_state["moved_at"])
    assert not torch.equal(moved[0], moved[1])
