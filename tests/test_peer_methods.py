"""Peer methods (docs/methods/): ProtoNet, SimpleShot (CL2N), PT-MAP, TIM-GD, α-TIM, BD-CSPN, LaplacianShot.

Every test checks a property that a wrong implementation would break: valid probabilities for odd shapes
and empty classes, near-perfect accuracy on well-separated data, PT-MAP's transport marginals, TIM's
decreasing objective, α-TIM → TIM as α → 1, BD-CSPN's N prototypes with an empty class, LaplacianShot's
non-increasing energy (symmetric option), and identical results alone or inside a batch. BD-CSPN's and
LaplacianShot's benchmark defaults are checked in test_peer_fidelity.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tasks import clustered_tasks
from lightning_putm.errors import ConfigError, FeatureError
from lightning_putm.features.files import FeatureSet, save_features
from lightning_putm.methods import available_methods, build_method
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.bdcspn import BDCSPN, cosine
from lightning_putm.methods.laplacianshot import LaplacianShot, knn_affinity, laplacian_energy
from lightning_putm.methods.preprocessing import cl2n
from lightning_putm.methods.ptmap import PTMAP, sinkhorn
from lightning_putm.methods.simpleshot import SimpleShot
from lightning_putm.methods.tim import AlphaTIM, TIMGD, shannon_entropy, tsallis_entropy
from lightning_putm.tasks import TaskBatch

PEERS = ["protonet", "simpleshot", "ptmap", "tim", "alpha_tim", "bdcspn", "laplacianshot", "bavardage", "ilpc", "alpha_am", "unem"]
#: fewer Adam steps where the property does not need the paper's 1000 (keeps the suite fast on CPU)
FAST = {"tim": {"iterations": 150}, "alpha_tim": {"iterations": 150}, "alpha_am": {"iterations": 100}}


def make_tasks(counts: list[list[int]], shots: int = 1, dim: int = 32, spread: float = 0.3, scale: float = 2.0,
               seed: int = 0) -> tuple[TaskBatch, torch.Tensor]:
    """Tasks with one non-negative Gaussian cluster per class; ``counts[t][k]`` queries of class k in task t."""
    return clustered_tasks(counts, shots, dim, spread, scale, seed)


def build(name: str, shots: int = 1, balanced: bool = False, **params) -> FewShotMethod:
    return build_method(name, {**FAST.get(name, {}), **params}, shots=shots, balanced=balanced)


def test_every_peer_is_registered_with_a_config() -> None:
    from lightning_putm.config import group_options

    assert set(PEERS) <= set(available_methods())
    assert set(PEERS) <= set(group_options("method"))


# ----------------------------------------------------------------------------------------- probabilities
SHAPES = [
    pytest.param([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55]], 1, 32, id="5way-1shot-empty-class"),
    pytest.param([[4, 3, 3], [0, 9, 1]], 2, 48, id="3way-2shot-Q10"),
    pytest.param([[1, 2, 0, 3, 4, 5, 8]], 5, 8, id="7way-5shot-d<n"),
]


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("counts, shots, dim", SHAPES)
def test_valid_probabilities(name: str, counts: list[list[int]], shots: int, dim: int) -> None:
    tasks, _ = make_tasks(counts, shots=shots, dim=dim, spread=1.0)
    probs = build(name, shots=shots).predict(tasks)
    t, q, n = tasks.num_tasks, tasks.num_queries, tasks.ways
    assert probs.shape == (t, q, n)
    assert probs.dtype == tasks.query.dtype and probs.device == tasks.query.device
    assert torch.isfinite(probs).all()
    assert (probs >= 0).all()
    torch.testing.assert_close(probs.sum(2), torch.ones(t, q), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("shots", [1, 5])
def test_near_perfect_accuracy_on_separated_data(name: str, shots: int) -> None:
    tasks, labels = make_tasks([[15] * 5] * 4, shots=shots, spread=0.15, seed=shots)
    probs = build_method(name, {}, shots=shots, balanced=True).predict(tasks)  # published defaults
    accuracy = (probs.argmax(2) == labels).double().mean().item()
    assert accuracy >= 0.99, f"{name} {shots}-shot: {accuracy:.3f}"


@pytest.mark.parametrize("name", PEERS)
def test_same_predictions_alone_or_in_a_batch(name: str) -> None:
    tasks, _ = make_tasks([[20, 0, 30, 15, 10], [15] * 5, [1, 2, 3, 4, 65], [10, 10, 25, 0, 30]], spread=0.9,
                          seed=3)
    method = build(name)
    together = method.predict(tasks)
    alone = torch.cat([method.predict(tasks.slice(i, i + 1)) for i in range(tasks.num_tasks)])
    assert torch.equal(together.argmax(2), alone.argmax(2))
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    # chunked by a tiny memory budget: same again
    chunked = build(name, memory_budget_mb=1e-3)
    assert chunked.chunk_size(tasks) == 1
    torch.testing.assert_close(chunked.predict(tasks), together, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["putm", *PEERS])
def test_no_tasks_give_no_probabilities(name: str) -> None:
    """Kills: an empty batch (the shard of a distributed rank when there are more ranks than tasks) failing in
    the input check (``min()`` of an empty tensor) or in ``torch.cat([])``; that rank then never reached the
    all-gather the other ranks wait in."""
    tasks, _ = make_tasks([[15] * 5, [15] * 5])
    empty = tasks.slice(2, 2)
    out = build(name).predict(empty)
    assert out.shape == (0, tasks.num_queries, tasks.ways) and out.dtype == tasks.query.dtype
    if name == "putm":  # several CPU workers: the same
        assert build(name, cpu_workers=2).predict(empty).shape == (0, tasks.num_queries, tasks.ways)


def test_methods_do_not_mutate_their_input() -> None:
    tasks, _ = make_tasks([[15] * 5] * 2)
    before = (tasks.support.clone(), tasks.query.clone())
    for name in PEERS:
        build(name).predict(tasks)
    assert torch.equal(tasks.support, before[0]) and torch.equal(tasks.query, before[1])


# ----------------------------------------------------------------------------------------- SimpleShot / CL2N
def test_cl2n_subtracts_the_base_mean_then_normalises() -> None:
    x = torch.tensor([[[3.0, 4.0], [1.0, 1.0]]])
    mean = torch.tensor([1.0, 1.0])
    out = cl2n(x, mean)
    torch.testing.assert_close(out[0, 0], torch.tensor([2.0, 3.0]) / math.sqrt(13))
    torch.testing.assert_close(cl2n(x, None)[0, 0], torch.tensor([0.6, 0.8]))
    with pytest.raises(FeatureError, match="same backbone"):
        cl2n(x, torch.zeros(3))


def test_simpleshot_base_mean_changes_the_decision() -> None:
    # Two classes along directions that only become distinguishable once the shared offset is removed.
    offset = torch.tensor([10.0, 10.0, 0.0])
    support = torch.stack([offset + torch.tensor([1.0, 0, 0]), offset + torch.tensor([0, 1.0, 0])]).unsqueeze(0)
    query = (offset + torch.tensor([0.9, 0.0, 0.0])).view(1, 1, 3)
    tasks = TaskBatch(support, torch.tensor([[0, 1]]), query, 2, torch.tensor([0]))
    with_mean = SimpleShot(base_mean=offset).predict(tasks)
    assert with_mean.argmax(2).item() == 0 and with_mean[0, 0, 0] > 0.99
    without = SimpleShot().predict(tasks)  # L2N fallback: the offset dominates, the decision is far less sure
    assert without[0, 0, 0] < with_mean[0, 0, 0] - 0.2


# ----------------------------------------------------------------------------------------- PT-MAP
def test_sinkhorn_plan_has_the_required_marginals() -> None:
    g = torch.Generator().manual_seed(0)
    cost = torch.rand(3, 12, 4, generator=g) * 2
    rows = torch.ones(3, 12)
    columns = torch.tensor([[3.0, 3.0, 3.0, 3.0], [6.0, 0.0, 5.0, 1.0], [12.0, 0.0, 0.0, 0.0]])
    plan = sinkhorn(cost, rows, columns, lam=10.0)
    torch.testing.assert_close(plan.sum(2), rows, atol=1e-5, rtol=0)
    torch.testing.assert_close(plan.sum(1), columns, atol=1e-5, rtol=0)
    assert (plan[1, :, 1] == 0).all()
    # the plan follows the cost: with uniform columns each row puts most mass on cheap classes
    uniform = plan[0]
    assert (uniform * cost[0]).sum() < (cost[0].mean(1, keepdim=True) * uniform.sum(1, keepdim=True)).sum()


def test_ptmap_transport_rows_sum_to_one_and_columns_to_q_over_n() -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [5, 5, 5, 5, 55]], spread=0.5)
    method = PTMAP()
    probs = method.predict(tasks)
    plan = method.last_state["transport"]
    # columns are scaled last (exact); rows are within what the reference stopping rule leaves
    torch.testing.assert_close(plan.sum(1), torch.full((2, 5), 15.0), atol=1e-4, rtol=0)
    torch.testing.assert_close(plan.sum(2), torch.ones(2, 75), atol=1e-3, rtol=0)
    assert plan[0, :, 1].sum() > 14.9  # uniform marginal: the empty class 1 still receives Q/N = 15
    torch.testing.assert_close(probs, plan / plan.sum(2, keepdim=True))


def test_ptmap_rejects_negative_features() -> None:
    tasks, _ = make_tasks([[15] * 5])
    tasks.query[0, 0, 0] = -1.0
    with pytest.raises(FeatureError, match="non-negative"):
        PTMAP().predict(tasks)


# ----------------------------------------------------------------------------------------- TIM / α-TIM
@pytest.mark.parametrize("cls", [TIMGD, AlphaTIM])
def test_tim_objective_decreases_over_iterations(cls) -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [15] * 5, [1, 2, 3, 4, 65]], spread=1.0, seed=4)
    method = cls(iterations=200) if cls is TIMGD else cls(shots=1, iterations=200)
    method.predict(tasks)
    history = torch.cat([method.last_state["objective"], method.last_state["final_objective"].unsqueeze(0)])
    steps = history[1:] - history[:-1]
    assert (steps <= 1e-6).all(), f"objective rose by up to {steps.max().item():.3g}"
    assert (history[-1] < history[0] - 1e-3).all()


def test_tsallis_entropy_tends_to_shannon() -> None:
    p = torch.softmax(torch.randn(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64), dim=1)
    torch.testing.assert_close(tsallis_entropy(p, 1.0 + 1e-6), shannon_entropy(p), atol=1e-5, rtol=0)
    torch.testing.assert_close(tsallis_entropy(p, 2.0), 1 - p.pow(2).sum(1))


def test_alpha_tim_approaches_tim_as_alpha_tends_to_one() -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [15] * 5], spread=1.0, seed=5)
    weights = [1.0, 1.0, 1.0]
    tim = TIMGD(loss_weights=weights, iterations=150, lr=1e-3).predict(tasks)
    gaps = []
    for alpha in (3.0, 1.5, 1.1, 1.01, 1.001):
        probs = AlphaTIM(shots=1, alpha=alpha, loss_weights=weights, iterations=150, lr=1e-3).predict(tasks)
        gaps.append((probs - tim).abs().max().item())
    assert all(a > b for a, b in zip(gaps, gaps[1:])), gaps
    assert gaps[0] > 0.1 and gaps[-1] < 2e-3, gaps
    exact = AlphaTIM(shots=1, alpha=1.0, loss_weights=weights, iterations=150, lr=1e-3).predict(tasks)
    torch.testing.assert_close(exact, tim)


def test_alpha_tim_alpha_by_shot_unless_set() -> None:
    assert AlphaTIM(shots=1).alpha == 2.0
    assert AlphaTIM(shots=5).alpha == 7.0 and AlphaTIM(shots=10).alpha == 7.0
    assert AlphaTIM(shots=5, alpha=3.5).alpha == 3.5
    with pytest.raises(ConfigError):
        AlphaTIM(shots=1, alpha=0.0)


def test_tim_loss_weights_by_setting_unless_set() -> None:
    assert TIMGD(balanced=True).loss_weights == (0.1, 1.0, 0.1)
    assert TIMGD(balanced=False).loss_weights == (1.0, 1.0, 1.0)
    assert TIMGD(balanced=True, loss_weights=[2, 1, 0]).loss_weights == (2.0, 1.0, 0.0)


# ----------------------------------------------------------------------------------------- BD-CSPN
@pytest.mark.parametrize("variant", ["benchmark", "paper"])
def test_bdcspn_keeps_n_prototypes_when_a_class_gets_no_query(variant: str) -> None:
    # class 4 has no query and its support sits far from every query, so nothing is predicted into it
    tasks, labels = make_tasks([[20, 20, 20, 15, 0], [40, 0, 20, 15, 0]], spread=0.2, seed=6)
    tasks.support[:, 4] = 0.0
    tasks.support[:, 4, :3] = 50.0
    method = BDCSPN(variant=variant)
    probs = method.predict(tasks)
    prototypes = method.last_state["prototypes"]
    assert prototypes.shape == (2, 5, tasks.dim) and torch.isfinite(prototypes).all()
    assert not (probs.argmax(2) == 4).any()
    # the empty class keeps the direction of its own (normalised) support row: the row itself in the paper
    # variant, the row times its softmax-over-classes weight in the benchmark variant
    support = cl2n(tasks.support, None)
    if variant == "paper":
        torch.testing.assert_close(prototypes[:, 4], support[:, 4])
    else:
        assert method.last_state["rows_per_class"][:, 4].tolist() == [1, 1]
        torch.testing.assert_close(cosine(prototypes[:, 4:], support[:, 4:])[:, 0, 0], torch.ones(2))
    # and classes with queries were rectified by them (prototypes moved off the support rows)
    similarity = cosine(prototypes, support).diagonal(dim1=1, dim2=2)
    has_queries = torch.tensor([[True, True, True, True, False], [True, False, True, True, False]])
    assert (similarity[has_queries] < 0.999).all() and (similarity[~has_queries] > 0.99999).all()
    assert (probs.argmax(2) == labels).double().mean() > 0.95


@pytest.mark.parametrize("variant", ["benchmark", "paper"])
def test_bdcspn_top_z_limits_the_queries_per_class(variant: str) -> None:
    tasks, _ = make_tasks([[15] * 5], spread=0.5, seed=7)
    zero = BDCSPN(variant=variant, top_z=0)
    zero.predict(tasks)
    support = cl2n(tasks.support, None)
    if variant == "paper":
        torch.testing.assert_close(zero.last_state["prototypes"], support)  # 1-shot, no query added
    else:  # only the support rows, each weighted by its softmax over classes
        assert zero.last_state["rows_per_class"].tolist() == [[1] * 5]
        torch.testing.assert_close(cosine(zero.last_state["prototypes"], support).diagonal(dim1=1, dim2=2),
                                   torch.ones(1, 5))
    full = BDCSPN(variant=variant, top_z=None)
    full.predict(tasks)
    assert not torch.allclose(full.last_state["prototypes"], zero.last_state["prototypes"])
    if variant == "benchmark":
        two = BDCSPN(variant=variant, top_z=2)
        two.predict(tasks)
        assert (two.last_state["rows_per_class"] <= 3).all()  # its support row + at most 2 queries
        assert (full.last_state["rows_per_class"] > 3).any()


# ----------------------------------------------------------------------------------------- LaplacianShot
@pytest.mark.parametrize("lmd, knn", [(1.0, 3), (0.7, 5)])
def test_laplacianshot_energy_does_not_increase(lmd: float, knn: int) -> None:
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [15] * 5, [1, 2, 3, 4, 65], [10, 10, 25, 0, 30]],
                          spread=1.2, seed=8)
    # the bound-optimisation guarantee belongs to the symmetric affinity with the λ/2 energy (not the default)
    method = LaplacianShot(shots=1, balanced=False, lmd=lmd, knn=knn, iterations=30, tol=0.0, affinity="symmetric",
                           energy="half")
    method.predict(tasks)
    energy = method.last_state["energy"]  # [updates + 1, T], float64
    assert energy.shape == (31, 4)
    rises = energy[1:] - energy[:-1]
    assert (rises <= 1e-10 * energy[:-1].abs() + 1e-12).all(), rises.max()
    assert (energy[-1] < energy[0] - 1e-3).all()


def test_laplacianshot_stops_when_the_energy_stops_changing() -> None:
    tasks, _ = make_tasks([[15] * 5, [30, 0, 20, 15, 10]], spread=0.8, seed=9)
    method = LaplacianShot(shots=1, balanced=True, iterations=50)
    method.predict(tasks)
    energy = method.last_state["energy"]
    assert energy.shape[0] < 51  # converged before the cap
    last = energy[-1]
    assert ((energy[-1] - energy[-2]).abs() <= 1e-6 * energy[-2].abs()).all()
    assert torch.isfinite(last).all()


def test_laplacianshot_fixed_point_is_a_stationary_point_of_its_energy() -> None:
    # the update and the energy must belong together: at a fixed point Y = softmax(-a + lmd W Y) the energy's
    # gradient is constant across classes in every row (zero on the simplex's tangent space). This holds for the
    # symmetric affinity with the λ/2 energy, the non-default options
    tasks, _ = make_tasks([[30, 0, 20, 15, 10], [15] * 5], spread=1.2, seed=10)
    method = LaplacianShot(shots=1, balanced=False, lmd=0.7, iterations=300, tol=0.0, affinity="symmetric",
                           energy="half")
    method.predict(tasks)
    state = method.last_state
    y = state["assignments"].clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(laplacian_energy(y, state["unary"], state["affinity"], 0.7, 0.5).sum(), y)
    tangent = gradient - gradient.mean(2, keepdim=True)
    assert tangent.abs().max() < 1e-6


def test_knn_affinity_symmetric_option_with_k_minus_one_neighbours() -> None:
    x = torch.tensor([[[0.0], [1.0], [3.0], [10.0]]])
    a = knn_affinity(x, knn=2, symmetric=True)  # each point links to its single nearest other point
    expected = torch.zeros(4, 4)
    for i, j in [(0, 1), (1, 0), (2, 1), (3, 2)]:
        expected[i, j] += 0.5
        expected[j, i] += 0.5
    torch.testing.assert_close(a[0], expected)
    assert torch.equal(knn_affinity(x, knn=1), torch.zeros(1, 4, 4))


def test_laplacianshot_lambda_by_setting_unless_set() -> None:
    assert LaplacianShot(shots=1, balanced=False).lmd == 1.0
    assert LaplacianShot(shots=5, balanced=False).lmd == 0.7
    assert LaplacianShot(shots=1, balanced=True).lmd == 0.7
    assert LaplacianShot(shots=5, balanced=True).lmd == 0.3
    assert LaplacianShot(shots=5, balanced=True, lmd=0.9).lmd == 0.9


# ----------------------------------------------------------------------------------------- config
def test_every_hyper_parameter_is_overridable_and_unknown_keys_fail() -> None:
    from lightning_putm.config import to_container
    from lightning_putm.evaluation import load_evaluate_config

    cfg = load_evaluate_config(["method.laplacianshot.lmd=0.4", "method.alpha_tim.alpha=3",
                                "method.ptmap.lam=5", "method.tim.iterations=7", "method.bdcspn.top_z=4"])
    params = to_container(cfg.method)
    for name in PEERS:  # every yaml key is a constructor keyword
        build_method(name, params[name], shots=1, balanced=False)
    assert build_method("laplacianshot", params["laplacianshot"], shots=1, balanced=False).lmd == 0.4
    assert build_method("alpha_tim", params["alpha_tim"], shots=1, balanced=False).alpha == 3.0
    assert build_method("tim", params["tim"], shots=1, balanced=False).iterations == 7
    with pytest.raises(ConfigError, match="unknown config key"):
        load_evaluate_config(["method.ptmap.no_such_key=1"])


def test_base_features_notice_once_and_mean_used(tmp_path, monkeypatch) -> None:
    from lightning_putm.evaluation import runner as evaluation
    from lightning_putm.evaluation import evaluate_features, load_evaluate_config, settings_from_config

    g = torch.Generator().manual_seed(0)
    labels = torch.arange(6).repeat_interleave(30)
    features = (torch.rand(6, 16, generator=g)[labels] * 3 + 0.3 * torch.randn(180, 16, generator=g)).clamp_min(0)
    feature_set = FeatureSet(features, labels, [str(c) for c in range(6)])
    common = ["methods=[simpleshot,bdcspn,laplacianshot,protonet]", "shots=[1,5]", "alphas=[2,balanced]",
              "tasks=3", "progress=false", "device=cpu", "queries=20"]
    lines: list[str] = []
    settings = settings_from_config(load_evaluate_config(common))
    evaluate_features(feature_set, settings, lines.append)
    notices = [line for line in lines if line.startswith("notice:")]
    assert len(notices) == 1 and "simpleshot, bdcspn, laplacianshot" in notices[0] and "L2N" in notices[0]

    base_rows = torch.arange(64, dtype=torch.float32).view(4, 16)
    path = save_features(FeatureSet(base_rows, torch.zeros(4, dtype=torch.long), ["base"]), tmp_path / "base.pt")
    seen: dict[str, torch.Tensor | None] = {}
    real_build = evaluation.build_method

    def spy(name, params=None, **context):
        method = real_build(name, params, **context)
        seen[name] = getattr(method, "base_mean", None)
        return method

    monkeypatch.setattr(evaluation, "build_method", spy)
    lines.clear()
    settings = settings_from_config(load_evaluate_config([*common, f"base_features={path}"]))
    evaluate_features(feature_set, settings, lines.append)
    assert not any(line.startswith("notice:") for line in lines)
    for name in ("simpleshot", "bdcspn", "laplacianshot"):  # the mean over the file's rows reached CL2N
        torch.testing.assert_close(seen[name], base_rows.mean(0))
    assert seen["protonet"] is None

    wrong = save_features(FeatureSet(torch.ones(2, 5), torch.zeros(2, dtype=torch.long), ["b"]), tmp_path / "w.pt")
    settings = settings_from_config(load_evaluate_config([*common, f"base_features={wrong}"]))
    with pytest.raises(FeatureError, match="d=5"):
        evaluate_features(feature_set, settings, lambda _: None)


@pytest.mark.parametrize("methods,covariance", [("[simpleshot]", False), ("[simpleshot,bavardage]", True)])
def test_a_run_reads_its_base_features_file_once(tmp_path, monkeypatch, methods, covariance) -> None:
    """``evaluate.py`` checks ``base_features`` before its run folder exists and its methods use the statistics
    later: the file is read once (a 98 MB file of miniImageNet's base classes takes 0.3-1 s), with BAVARDAGE's
    scatter computed at the check. Each caller gets its own copy, and a file rewritten in between is read again.
    Kills: no cache (two reads), a check that computes no scatter when a method needs it (a second read), a cache
    that hands out the same tensors (a caller's in-place change would reach the next run) or that ignores a
    rewritten file."""
    from lightning_putm.evaluation import load_evaluate_config, settings_from_config, sources

    reads: list[str] = []
    real = sources.load_features
    monkeypatch.setattr(sources, "load_features", lambda path, **kw: reads.append(str(path)) or real(path, **kw))
    rows = torch.arange(64, dtype=torch.float32).view(4, 16)
    path = save_features(FeatureSet(rows, torch.tensor([0, 0, 1, 1]), ["a", "b"]), tmp_path / "base.pt")
    settings = settings_from_config(load_evaluate_config([f"methods={methods}", f"base_features={path}"]))
    sources.check_base_features(settings, 16)
    first = sources.load_base_statistics(settings, 16, lambda _: None)
    assert len(reads) == 1
    torch.testing.assert_close(first.mean, rows.mean(0))
    assert (first.covariance is not None) == covariance
    first.mean.zero_()  # a caller's in-place change
    again = sources.load_base_statistics(settings, 16, lambda _: None)
    torch.testing.assert_close(again.mean, rows.mean(0))
    assert len(reads) == 1
    save_features(FeatureSet(rows + 1, torch.tensor([0, 0, 1, 1]), ["a", "b"]), path)  # rewritten
    torch.testing.assert_close(sources.load_base_statistics(settings, 16, lambda _: None).mean, rows.mean(0) + 1)
    assert len(reads) == 2
