"""BD-CSPN and LaplacianShot default to the realistic-imbalance benchmark's behaviour (Veilleux et al. 2021).

Each default is checked against a plain, loop-per-task reference written from the description in
docs/methods/*.md, and each test also checks that the data it uses tells the default apart from the
alternative (a cosine rule, shifted queries, a softmax over a class's members, support rows by true label, a
symmetric affinity, an energy with λ/2), so a wrong default fails. The ``variant`` / ``affinity`` / ``energy``
/ ``proto_rect`` options are checked to switch behaviour.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_peer_methods import make_tasks

from lightning_putm.errors import ConfigError
from lightning_putm.methods import build_method
from lightning_putm.methods.bdcspn import BDCSPN, rectify_prototypes_benchmark
from lightning_putm.methods.laplacianshot import LaplacianShot, knn_affinity
from lightning_putm.methods.preprocessing import cl2n
from lightning_putm.tasks import TaskBatch


def _single_task(support: list[list[float]], labels: list[int], query: list[list[float]], ways: int) -> TaskBatch:
    return TaskBatch(torch.tensor([support], dtype=torch.float64), torch.tensor([labels]),
                     torch.tensor([query], dtype=torch.float64), ways, torch.zeros(1, dtype=torch.long))


# ----------------------------------------------------------------------------------------- BD-CSPN reference
def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def bdcspn_reference(support, labels, query, ways, eps=10.0, *, support_by_prediction=True, softmax_over="classes",
                     predict="euclidean-unshifted"):
    """One task, written row by row. Defaults = the benchmark; the keywords give the alternatives."""
    s, q = support.double(), query.double()
    protos = torch.stack([s[labels == k].mean(0) for k in range(ways)])
    shifted = q + (s.mean(0) - q.mean(0))
    rows = torch.cat([s, shifted])
    sims = [[_cos(r, protos[k]) for k in range(ways)] for r in rows]
    predicted = [max(range(ways), key=lambda k: sim[k]) for sim in sims]
    if not support_by_prediction:
        predicted[: len(s)] = [int(y) for y in labels]
    rectified = []
    for k in range(ways):
        members = [i for i in range(len(rows)) if predicted[i] == k]
        if softmax_over == "classes":
            weights = [math.exp(eps * sims[i][k]) / sum(math.exp(eps * c) for c in sims[i]) for i in members]
            total = sum(w * rows[i] for w, i in zip(weights, members)) / len(members)
        else:  # softmax over the class's members, weights summing to one
            z = sum(math.exp(eps * sims[i][k]) for i in members)
            total = sum(math.exp(eps * sims[i][k]) / z * rows[i] for i in members)
        rectified.append(total)
    rectified = torch.stack(rectified)
    if predict == "euclidean-unshifted":
        decision = torch.cdist(q, rectified).argmin(1)
    elif predict == "euclidean-shifted":
        decision = torch.cdist(shifted, rectified).argmin(1)
    elif predict == "cosine-unshifted":
        decision = torch.stack([torch.tensor([_cos(x, p) for p in rectified]) for x in q]).argmax(1)
    else:  # cosine-shifted
        decision = torch.stack([torch.tensor([_cos(x, p) for p in rectified]) for x in shifted]).argmax(1)
    return rectified, decision


def test_bdcspn_hand_computed_rectification() -> None:
    # 2-way 1-shot in 2-d. Support (1,0), (0,1); queries (1,0), (0.6,0.8): shift ξ = (0.5,0.5) − (0.8,0.4) = (−0.3,0.1)
    tasks = _single_task([[1, 0], [0, 1]], [0, 1], [[1, 0], [0.6, 0.8]], ways=2)
    method = BDCSPN()
    probs = method.predict(tasks)
    q0, q1 = torch.tensor([0.7, 0.1], dtype=torch.float64), torch.tensor([0.3, 0.9], dtype=torch.float64)

    def weight(c_own: float, c_other: float) -> float:  # softmax over the 2 classes of 10·cos
        return 1 / (1 + math.exp(10 * (c_other - c_own)))

    # class 0 collects support row (1,0) (cos 1 vs 0) and shifted query 0 (cos .98995 vs .14142), averaged
    w_s0 = weight(1.0, 0.0)
    w_q0 = weight(0.7 / math.sqrt(0.5), 0.1 / math.sqrt(0.5))
    p0 = (w_s0 * torch.tensor([1.0, 0.0], dtype=torch.float64) + w_q0 * q0) / 2
    w_s1 = weight(1.0, 0.0)
    w_q1 = weight(0.9 / math.sqrt(0.9), 0.3 / math.sqrt(0.9))
    p1 = (w_s1 * torch.tensor([0.0, 1.0], dtype=torch.float64) + w_q1 * q1) / 2
    prototypes = method.last_state["prototypes"][0]
    torch.testing.assert_close(prototypes, torch.stack([p0, p1]), atol=1e-12, rtol=0)
    assert method.last_state["rows_per_class"].tolist() == [[2, 2]]
    # not renormalised: both prototypes are shorter than the unit rows they average
    assert (prototypes.norm(dim=1) < 0.99).all()
    assert probs.argmax(2).tolist() == [[0, 1]]


def test_bdcspn_default_matches_the_row_by_row_reference() -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55], [15] * 5], shots=2, spread=1.1, seed=21)
    tasks = TaskBatch(tasks.support.double(), tasks.support_labels, tasks.query.double(), tasks.ways, tasks.task_seeds)
    method = BDCSPN()
    probs = method.predict(tasks)
    for t in range(tasks.num_tasks):
        support, query = cl2n(tasks.support[t:t + 1], None)[0], cl2n(tasks.query[t:t + 1], None)[0]
        labels = tasks.support_labels[t]
        rectified, decision = bdcspn_reference(support, labels, query, tasks.ways)
        torch.testing.assert_close(method.last_state["prototypes"][t], rectified, atol=1e-10, rtol=0)
        assert torch.equal(probs[t].argmax(1), decision)


def _disagreeing_tasks(seed: int = 31):
    tasks, _ = make_tasks([[25, 3, 20, 15, 12], [4, 6, 5, 10, 50], [15] * 5, [40, 0, 10, 20, 5]], shots=5,
                          spread=1.6, seed=seed)
    return TaskBatch(tasks.support.double(), tasks.support_labels, tasks.query.double(), tasks.ways, tasks.task_seeds)


@pytest.mark.parametrize("alternative", [
    {"predict": "cosine-shifted"}, {"predict": "cosine-unshifted"}, {"predict": "euclidean-shifted"},
    {"softmax_over": "members"}, {"support_by_prediction": False},
])
def test_bdcspn_default_is_told_apart_from_each_alternative(alternative: dict) -> None:
    # noisy 5-shot tasks where each alternative rule changes some decision (or prototype): the default must
    # follow the benchmark's rule, not the alternative
    tasks = _disagreeing_tasks()
    method = BDCSPN()
    predicted = method.predict(tasks).argmax(2)
    differs = False
    for t in range(tasks.num_tasks):
        support, query = cl2n(tasks.support[t:t + 1], None)[0], cl2n(tasks.query[t:t + 1], None)[0]
        labels = tasks.support_labels[t]
        rectified, decision = bdcspn_reference(support, labels, query, tasks.ways)
        other, other_decision = bdcspn_reference(support, labels, query, tasks.ways, **alternative)
        assert torch.equal(predicted[t], decision)
        differs |= not torch.equal(decision, other_decision) or not torch.allclose(rectified, other, atol=1e-6)
    assert differs, f"the data does not separate the default from {alternative}"


def test_bdcspn_support_rows_are_pseudo_labelled() -> None:
    # class 0's second support row (0.2, 0.98) is more cosine-similar to class 1's prototype (0,1) than to its own
    # (0.6, 0.49): the benchmark counts it in class 1's rows, a true-label rule in class 0's
    tasks = _single_task([[1, 0], [0.2, 0.98], [0, 1], [0, 1]], [0, 0, 1, 1], [[0.9, 0.1], [0.1, 0.9]], ways=2)
    method = BDCSPN()
    method.predict(tasks)
    assert method.last_state["rows_per_class"].tolist() == [[2, 4]]  # class 0: (1,0) + 1 query; class 1: 3 + 1


def test_bdcspn_variant_paper_is_the_previous_method() -> None:
    tasks = _disagreeing_tasks(seed=32)
    paper = BDCSPN(variant="paper")
    predicted = paper.predict(tasks).argmax(2)
    benchmark = BDCSPN().predict(tasks).argmax(2)
    assert not torch.equal(predicted, benchmark)  # the option switches behaviour
    for t in range(tasks.num_tasks):
        support, query = cl2n(tasks.support[t:t + 1], None)[0], cl2n(tasks.query[t:t + 1], None)[0]
        labels = tasks.support_labels[t]
        rectified, decision = bdcspn_reference(support, labels, query, tasks.ways, support_by_prediction=False,
                                               softmax_over="members", predict="cosine-shifted")
        torch.testing.assert_close(paper.last_state["prototypes"][t], rectified, atol=1e-10, rtol=0)
        assert torch.equal(predicted[t], decision)
    with pytest.raises(ConfigError, match="variant"):
        BDCSPN(variant="original")


def test_bdcspn_class_without_rows_keeps_its_support_mean() -> None:
    # class 2's rows (1,0,0) and (0,1,0) each coincide with another class's prototype, and the queries too
    support = cl2n(torch.tensor([[[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0],
                                  [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]]), None)
    one_hot = torch.nn.functional.one_hot(torch.tensor([[0, 0, 1, 1, 2, 2]]), 3).float()
    query = cl2n(torch.tensor([[[1.0, 0.05, 0.0], [0.0, 1.0, 0.05]]]), None)
    prototypes, counts = rectify_prototypes_benchmark(support, one_hot, query, return_counts=True)
    assert counts[0, 2] == 0
    torch.testing.assert_close(prototypes[0, 2], support[0, 4:].mean(0))
    assert torch.isfinite(prototypes).all()


# ----------------------------------------------------------------------------------------- LaplacianShot
def laplacianshot_reference(unary: torch.Tensor, query: torch.Tensor, lmd: float, knn: int = 3, iterations: int = 20,
                            tol: float = 1e-6, energy_scale: float = 1.0) -> tuple[torch.Tensor, int]:
    """The benchmark's loop for one task: directed kNN W, Y = softmax(−a + λWY), stop on the energy."""
    q = query.shape[0]
    w = torch.zeros(q, q, dtype=torch.float64)
    for i in range(q):
        distances = [(float((query[i] - query[j]).norm()), j) for j in range(q) if j != i]
        for _, j in sorted(distances)[: knn - 1]:
            w[i, j] = 1.0
    y = torch.softmax(-unary, dim=1)
    old = math.inf
    for i in range(iterations):
        y = torch.softmax(-unary + lmd * w @ y, dim=1)
        energy = float((y * y.clamp_min(1e-20).log()).sum() + (unary * y).sum() - energy_scale * lmd * ((w @ y) * y).sum())
        if i > 1 and abs(energy - old) <= tol * abs(old):
            return y, i + 1
        old = energy
    return y, iterations


def test_knn_affinity_is_directed_by_default() -> None:
    x = torch.tensor([[[0.0], [1.0], [3.0], [10.0]]])
    directed = knn_affinity(x, knn=2)[0]  # each point links to its single nearest other point
    expected = torch.zeros(4, 4)
    for i, j in [(0, 1), (1, 0), (2, 1), (3, 2)]:
        expected[i, j] = 1.0
    torch.testing.assert_close(directed, expected)
    assert not torch.equal(directed, directed.T)
    torch.testing.assert_close(knn_affinity(x, knn=2, symmetric=True)[0], 0.5 * (expected + expected.T))
    assert torch.equal(knn_affinity(x, knn=3)[0].sum(1), torch.full((4,), 2.0))  # knn counts the point itself


@pytest.mark.parametrize("balanced, shots", [(False, 1), (False, 5), (True, 1), (True, 5)])
def test_laplacianshot_default_matches_the_benchmark_loop(balanced: bool, shots: int) -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55], [15] * 5], shots=shots, spread=1.3, seed=40 + shots)
    method = build_method("laplacianshot", {}, shots=shots, balanced=balanced)
    assert method.affinity == "directed" and method.energy == "benchmark" and method.proto_rect == balanced
    probs = method.predict(tasks)
    state = method.last_state
    assert not torch.equal(state["affinity"], state["affinity"].transpose(1, 2))
    support, query = cl2n(tasks.support, None), cl2n(tasks.query, None)
    if balanced:
        prototypes = rectify_prototypes_benchmark(support, tasks.one_hot_support(), query)
    else:
        prototypes = tasks.support_means(support)
    unary = torch.cdist(query.double(), prototypes.double()).pow(2)
    torch.testing.assert_close(state["unary"], unary, atol=1e-5, rtol=0)
    lmd = {(False, 1): 1.0, (False, 5): 0.7, (True, 1): 0.7, (True, 5): 0.3}[(balanced, shots)]
    assert method.lmd == lmd and method.iterations == 20 and method.tol == 1e-6 and method.knn == 3
    updates = (state["energy"].shape[0] - 1)
    for t in range(tasks.num_tasks):
        y, steps = laplacianshot_reference(state["unary"][t], query[t].double(), lmd)
        assert torch.equal(probs[t].argmax(1), y.argmax(1))
        torch.testing.assert_close(state["assignments"][t], y, atol=1e-8, rtol=0)
        assert steps <= updates


def test_laplacianshot_energy_weighs_the_pairwise_term_by_lambda() -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [15] * 5], spread=1.2, seed=50)
    for energy, scale in (("benchmark", 1.0), ("half", 0.5)):
        method = LaplacianShot(shots=1, balanced=False, lmd=0.8, energy=energy)
        method.predict(tasks)
        state = method.last_state
        y, unary, w = state["assignments"], state["unary"], state["affinity"]
        expected = (y * y.log()).sum((1, 2)) + (unary * y).sum((1, 2)) - scale * 0.8 * (w.bmm(y) * y).sum((1, 2))
        torch.testing.assert_close(state["energy"][-1], expected, atol=1e-9, rtol=0)
        other = (y * y.log()).sum((1, 2)) + (unary * y).sum((1, 2)) - (1.5 - scale) * 0.8 * (w.bmm(y) * y).sum((1, 2))
        assert ((state["energy"][-1] - other).abs() > 1e-3).all()


def test_laplacianshot_stopping_follows_the_chosen_energy() -> None:
    # the number of updates before the relative energy change drops below tol depends on the energy's λ weight
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55], [15] * 5, [1, 2, 3, 4, 65]], spread=1.5, seed=51)
    steps = {}
    for energy, scale in (("benchmark", 1.0), ("half", 0.5)):
        method = LaplacianShot(shots=1, balanced=False, energy=energy, tol=1e-4)
        method.predict(tasks)
        ours = method.last_state["energy"]
        unary, query = method.last_state["unary"], cl2n(tasks.query, None).double()
        steps[energy] = [laplacianshot_reference(unary[t], query[t], method.lmd, tol=1e-4, energy_scale=scale)[1]
                         for t in range(tasks.num_tasks)]
        assert ours.shape[0] - 1 == max(steps[energy])
    assert steps["benchmark"] != steps["half"]


def test_laplacianshot_options_switch_behaviour() -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55], [15] * 5], shots=5, spread=1.6, seed=52)
    default = build_method("laplacianshot", {}, shots=5, balanced=True)
    base = default.predict(tasks)
    for params in ({"affinity": "symmetric"}, {"proto_rect": False}):
        other = build_method("laplacianshot", params, shots=5, balanced=True)
        assert not torch.allclose(other.predict(tasks), base, atol=1e-4), params
    symmetric = build_method("laplacianshot", {"affinity": "symmetric"}, shots=5, balanced=True)
    symmetric.predict(tasks)
    w = symmetric.last_state["affinity"]
    assert torch.equal(w, w.transpose(1, 2))
    assert build_method("laplacianshot", {}, shots=1, balanced=False).proto_rect is False
    assert build_method("laplacianshot", {"proto_rect": True}, shots=1, balanced=False).proto_rect is True
    assert build_method("laplacianshot", {"proto_rect": False}, shots=1, balanced=True).proto_rect is False
    for bad in ({"affinity": "mutual"}, {"energy": "exact"}):
        with pytest.raises(ConfigError):
            build_method("laplacianshot", bad, shots=1, balanced=False)


def test_options_reach_the_methods_from_the_config() -> None:
    from lightning_putm.config import to_container
    from lightning_putm.evaluation import load_evaluate_config

    defaults = to_container(load_evaluate_config([]).method)
    assert build_method("bdcspn", defaults["bdcspn"], shots=1, balanced=False).variant == "benchmark"
    default_ls = build_method("laplacianshot", defaults["laplacianshot"], shots=5, balanced=True)
    assert (default_ls.affinity, default_ls.energy, default_ls.proto_rect) == ("directed", "benchmark", True)
    params = to_container(load_evaluate_config([
        "method.bdcspn.variant=paper", "method.laplacianshot.affinity=symmetric",
        "method.laplacianshot.energy=half", "method.laplacianshot.proto_rect=false"]).method)
    assert build_method("bdcspn", params["bdcspn"], shots=1, balanced=False).variant == "paper"
    method = build_method("laplacianshot", params["laplacianshot"], shots=5, balanced=True)
    assert (method.affinity, method.energy, method.proto_rect) == ("symmetric", "half", False)
