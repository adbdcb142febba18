"""α-AM (Lazarou et al., WACV 2024): each test names the mutant of lightning_putm/methods/alpha_am.py it kills.

Optional: ``LIGHTNING_PUTM_AM_REFERENCE=/path/to/AM`` (a checkout of github.com/MichalisLazarou/AM, the folder
holding ``src/``) also runs the authors' ``ALPHA_AM`` on tiny tasks and compares predictions.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.tasks import clustered_tasks
from lightning_putm.errors import ConfigError
from lightning_putm.methods import build_method, method_display_name, method_uses_class_prior
from lightning_putm.methods.alpha_am import AlphaAM, AlphaAMSettings, integer_power, tsallis
from lightning_putm.tasks import TaskBatch

REFERENCE_ENV = "LIGHTNING_PUTM_AM_REFERENCE"


#: Tiny tasks: one torch thread (conftest's ``single_thread``) avoids two threads spinning on a shared machine.
pytestmark = pytest.mark.usefixtures("single_thread")


def tasks_of(counts: list[list[int]], shots: int = 1, dim: int = 12, seed: int = 0) -> tuple[TaskBatch, torch.Tensor]:
    return clustered_tasks(counts, shots, dim, spread=0.3, seed=seed)


def fast(shots: int = 1, **options) -> AlphaAM:
    return AlphaAM(shots=shots, **{"iterations": 25, **options})


# ------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("shots, expected", [(1, (0.8, 20, 2.0)), (5, (0.9, 10, 5.0)), (10, (0.9, 10, 5.0)),
                                             (3, (0.8, 20, 1.0))])
def test_defaults_by_shots_are_the_reference_choices(shots: int, expected: tuple) -> None:
    """Kills: a swapped 1-shot/5-shot value, `shots == 5` instead of `>= 5`, or a wrong 2-4-shot fallback
    (ALPHA_AM.run_adaptation + get_alpha_values; the yaml's alpha 0.8, K 20, alpha_values 1.0 otherwise)."""
    s = AlphaAM(shots=shots).settings
    assert (s.alpha, s.k, s.entropy_alpha) == expected
    assert (s.temperature, s.lr, s.iterations, s.loss_weights, s.phi, s.plc, s.integer_powers) == (
        15.0, 1e-4, 1000, (1.0, 1.0, 1.0), "mus+G+Wb", True, False)


def test_explicit_values_win_and_shots_are_needed_otherwise() -> None:
    """Kills: resolve overwriting user values, or silently picking a value without knowing the shots."""
    s = AlphaAM(shots=1, alpha=0.5, k=3, entropy_alpha=4.0).settings
    assert (s.alpha, s.k, s.entropy_alpha) == (0.5, 3, 4.0)
    with pytest.raises(ConfigError, match="shots"):
        AlphaAM()
    with pytest.raises(ConfigError, match="alpha_am.alpha"):
        build_method("alpha_am", {"alpha": 1.0}, shots=1, balanced=False)  # I - W can be singular
    with pytest.raises(ConfigError, match="alpha_am.phi"):
        build_method("alpha_am", {"phi": "G"}, shots=1, balanced=False)


# ------------------------------------------------------------------------------------------- pieces
def test_tsallis_entropy_hand_values() -> None:
    """Kills: a wrong α-entropy formula, or α = 1 dividing by zero instead of Shannon's limit."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    assert torch.allclose(tsallis(p, 2.0), torch.tensor([0.5, 1 - (0.04 + 0.09 + 0.25)]))
    fifth = torch.tensor([(1 - 2 * 0.5 ** 5) / 4, (1 - (0.2 ** 5 + 0.3 ** 5 + 0.5 ** 5)) / 4])
    assert torch.allclose(tsallis(p, 5.0), fifth)
    shannon = torch.tensor([math.log(2), -(0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5))])
    assert torch.allclose(tsallis(p, 1.0), shannon)
    assert torch.isfinite(tsallis(p, 1.0)).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 13])
def test_integer_power_and_its_gradient_are_pow_s(n: int) -> None:
    """Kills: a repeated squaring that drops or repeats a factor (e.g. the odd bit of n), or a backward with the
    wrong exponent or without the factor n."""
    x = torch.rand(64, 5, generator=torch.Generator().manual_seed(n), dtype=torch.float64) + 0.2
    assert torch.allclose(integer_power(x, n), x.pow(n), rtol=1e-14, atol=0)
    if n < 2:
        return
    p = x.clone().requires_grad_(True)
    tsallis(p, float(n), integer_powers=True).sum().backward()
    assert torch.allclose(p.grad, -n * x.pow(n - 1) / (n - 1), rtol=1e-14, atol=0)


def test_integer_powers_give_each_row_the_same_bits_in_any_batch() -> None:
    """Kills: `integer_powers` ignored (torch.pow: on the CPU its vectorized body and scalar tail can round an
    entry differently, so a row's gradient depends on how many rows share the tensor)."""
    p = torch.softmax(torch.randn(64, 5, generator=torch.Generator().manual_seed(0)), dim=1)

    def grads(rows: torch.Tensor) -> torch.Tensor:
        rows = rows.clone().requires_grad_(True)
        tsallis(rows, 5.0, 1e-12, integer_powers=True).sum().backward()
        return rows.grad

    batched = grads(p)
    alone = torch.cat([grads(p[i:i + 1]) for i in range(len(p))])
    assert torch.equal(batched, alone)
    assert torch.allclose(tsallis(p, 5.0, integer_powers=True), tsallis(p, 5.0), rtol=1e-6, atol=0)


def test_graph_hand_computed() -> None:
    """Kills: squared instead of plain distances, a std that is biased or taken per row, a centroid row that keeps
    neighbours, a missing symmetrisation, W_b applied after the normalisation, or the wrong normalisation.

    One centroid at 0 and three points at 0.5, 2, 4 on a line, k = 1, G = 1, W_b = 0.5."""
    method = AlphaAM(shots=1, k=1)
    x = torch.tensor([0.0, 0.5, 2.0, 4.0])
    nodes = x.view(1, 4, 1)
    kernel = torch.ones(1, 4, 4)
    edge = torch.full((1, 4, 4), 0.5)
    got = method.graph(nodes, kernel, edge, centroids=1, k=1)[0].numpy()

    d = np.abs(x.numpy()[:, None] - x.numpy()[None, :])
    a = np.exp(-d / d.std(ddof=1))
    np.fill_diagonal(a, 0.0)
    a[0] = 0.0  # the centroid's own row
    knn = np.zeros_like(a)
    for i in range(1, 4):  # each point keeps its single nearest other node
        j = int(np.argmax(a[i]))
        knn[i, j] = a[i, j]
    w = 0.5 * (knn + knn.T) * 0.5
    deg = w.sum(1)
    expected = w / np.sqrt(deg + 1e-12)[:, None] / np.sqrt(deg + 1e-12)[None, :]
    assert np.allclose(got, expected, atol=1e-6)
    # 0.5's nearest node is the centroid, 4's is 2; the centroid only receives edges
    assert got[1, 0] > 0 and got[3, 2] > 0 and got[0, 3] == 0


def test_iterations_zero_is_label_propagation_from_the_support_means() -> None:
    """Kills: labels injected on support rows instead of the centroid nodes only, a missing temperature, or the
    propagator's columns taken from the wrong block. Recomputed here with numpy's inverse on the same graph."""
    tasks, _ = tasks_of([[3, 2, 4]], shots=2)
    method = AlphaAM(shots=2, iterations=0, plc=False)
    probs = method.predict(tasks)
    support, query = method.preprocess(tasks)
    means = tasks.support_means(support)
    nodes = torch.cat([means, support, query], 1)
    n, ways = nodes.shape[1], tasks.ways
    w = method.graph(nodes, torch.ones(1, n, n), torch.full((1, n, n), method.alpha), ways, method.k)[0].double()
    y = np.zeros((n, ways))
    y[:ways] = np.eye(ways)
    scores = 15.0 * np.linalg.inv(np.eye(n) - method.alpha * w.numpy()) @ y
    expected = torch.softmax(torch.from_numpy(scores[ways + tasks.num_support:]), 1)
    assert torch.allclose(probs[0].double(), expected, atol=1e-5)


def test_objective_hand_computed() -> None:
    """Kills: a sign error between the terms (the marginal entropy is maximised, the conditional one minimised),
    the entropies of the wrong rows, or the Shannon CE replaced by an α one."""
    method = AlphaAM(shots=1, entropy_alpha=2.0, loss_weights=(1.0, 0.7, 0.3))
    scores = torch.tensor([[[2.0, 0.0], [0.0, 1.0],  # centroid rows: ignored
                            [1.0, 0.0], [0.0, 0.0],  # support rows, labels 0 and 1
                            [3.0, 1.0], [0.0, 2.0], [1.0, 1.0]]])  # queries
    one_hot = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    got = float(method.objective(scores, one_hot))
    sm = lambda v: np.exp(v) / np.exp(v).sum()  # noqa: E731
    ce = -(np.log(sm(np.array([1.0, 0.0]))[0] + 1e-12) + np.log(sm(np.array([0.0, 0.0]))[1] + 1e-12)) / 2
    p = np.stack([sm(np.array(r)) for r in ([3.0, 1.0], [0.0, 2.0], [1.0, 1.0])])
    marginal = 1 - (p.mean(0) ** 2).sum()
    conditional = (1 - ((p + 1e-12) ** 2).sum(1)).mean()
    assert got == pytest.approx(ce - 0.7 * marginal + 0.3 * conditional, abs=1e-6)


def test_plc_preprocessing_and_its_switch() -> None:
    """Kills: a missing power, centring or second L2 step, or `plc=false` still centring."""
    tasks, _ = tasks_of([[2, 2]], shots=1)
    x = torch.cat([tasks.support, tasks.query], 1).double()
    y = (x + 1e-6).sqrt()
    y = y / y.norm(dim=2, keepdim=True)
    y = y - y.mean(1, keepdim=True)
    y = y / y.norm(dim=2, keepdim=True)
    s, q = AlphaAM(shots=1).preprocess(tasks)
    assert torch.allclose(torch.cat([s, q], 1).double(), y, atol=1e-6)
    s, q = AlphaAM(shots=1, plc=False).preprocess(tasks)
    assert torch.allclose(torch.cat([s, q], 1).double(), x / x.norm(dim=2, keepdim=True), atol=1e-6)


# ------------------------------------------------------------------------------------------- whole method
@pytest.mark.parametrize("counts, shots", [([[2, 3, 0]], 2), ([[1, 1, 1, 1, 1, 1, 1]], 1), ([[10, 1]] * 2, 3)])
def test_any_ways_shots_queries(counts: list[list[int]], shots: int) -> None:
    """Kills: hard-coded 5 ways/75 queries, k not capped below the node count (3-way 2-shot 5 queries: n = 14 nodes,
    k = 20 would fail in topk), or a class without queries breaking the marginal entropy."""
    tasks, _ = tasks_of(counts, shots=shots)
    probs = fast(shots).predict(tasks)
    assert probs.shape == (len(counts), sum(counts[0]), len(counts[0]))
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(2), torch.ones(probs.shape[:2]), atol=1e-5)


def test_batched_equals_one_task_at_a_time_and_chunking() -> None:
    """Kills: parameters, the std or the kNN shared across tasks, or a loss averaged over tasks (Adam would still
    be independent, but a mean rescales each task's gradient by 1/T — Adam undoes that, so also check chunking)."""
    tasks, _ = tasks_of([[3, 4, 2], [5, 1, 3], [2, 2, 5]], shots=2, seed=3)
    together = fast(2).predict(tasks)
    alone = torch.cat([fast(2).predict(tasks.slice(i, i + 1)) for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5)
    assert torch.equal(together.argmax(2), alone.argmax(2))
    chunked = AlphaAM(shots=2, iterations=25, memory_budget_mb=1e-3).predict(tasks)
    assert torch.allclose(together, chunked, atol=1e-5)


def test_the_objective_gives_each_task_the_same_gradient_bits_alone_and_in_a_batch() -> None:
    """Kills: `integer_powers` ignored, or not reaching the marginal or the conditional entropy (at 5 shots, entropy
    order 5, torch.pow's CPU kernel gave 8 of these 64 tasks other gradient bits in a batch than alone; over 1000
    Adam steps that moved predictions with the chunk size, docs/methods/alpha_am.md)."""
    method = AlphaAM(shots=5, integer_powers=True)
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 5 + 25 + 75, 5, generator=generator) * 3
    one_hot = torch.nn.functional.one_hot(torch.arange(25) % 5, 5).float().expand(64, 25, 5)

    def gradient(rows: slice) -> torch.Tensor:
        leaf = scores[rows].clone().requires_grad_(True)
        method.objective(leaf, one_hot[rows]).sum().backward()
        return leaf.grad

    assert torch.equal(gradient(slice(None)), torch.cat([gradient(slice(i, i + 1)) for i in range(64)]))


def test_the_default_objective_takes_torch_pow_as_the_reference_does() -> None:
    """Kills: the integer powers used whatever `integer_powers` says (the default must be the reference's
    torch.pow, bit for bit, value and gradient: 1000 Adam steps turn last-bit differences into other
    predictions)."""
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(64, 5 + 25 + 75, 5, generator=generator) * 3
    one_hot = torch.nn.functional.one_hot(torch.arange(25) % 5, 5).float().expand(64, 25, 5)

    def reference(leaf: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(leaf[:, 30:], dim=2)
        marginal = (1.0 - probs.mean(1).pow(5.0).sum(-1)) / 4.0
        conditional = ((1.0 - (probs + 1e-12).pow(5.0).sum(-1)) / 4.0).mean(1)
        ce = -(one_hot * torch.log(torch.softmax(leaf[:, 5:30], dim=2) + 1e-12)).sum(2).mean(1)
        return ce - (marginal - conditional)

    ours, theirs = scores.clone().requires_grad_(True), scores.clone().requires_grad_(True)
    value = AlphaAM(shots=5).objective(ours, one_hot)
    expected = reference(theirs)
    value.sum().backward()
    expected.sum().backward()
    assert torch.equal(value, expected)
    assert torch.equal(ours.grad, theirs.grad)


def test_queries_are_permutation_equivariant() -> None:
    """Kills: anything that treats queries by position (e.g. the query block sliced from the wrong offset, or the
    centroids' labels placed on the first query rows)."""
    tasks, _ = tasks_of([[4, 3, 2]], shots=1, seed=5)
    perm = torch.randperm(tasks.num_queries, generator=torch.Generator().manual_seed(0))
    shuffled = TaskBatch(tasks.support, tasks.support_labels, tasks.query[:, perm], tasks.ways, tasks.task_seeds)
    base = fast(1).predict(tasks)
    moved = fast(1).predict(shuffled)
    assert torch.allclose(base[:, perm], moved, atol=1e-4)


def test_adaptation_changes_what_phi_says_and_only_that() -> None:
    """Kills: `phi` ignored (G or W_b never learnt, or learnt when excluded), or no optimisation at all."""
    tasks, _ = tasks_of([[3, 3, 3]], shots=1)
    full = fast(1)
    full.predict(tasks)
    assert not torch.allclose(full.last_state["kernel"], torch.ones_like(full.last_state["kernel"]))
    assert not torch.allclose(full.last_state["edge_weights"], torch.full_like(full.last_state["edge_weights"], 0.8))
    only_mus = fast(1, phi="mus")
    only_mus.predict(tasks)
    assert torch.equal(only_mus.last_state["kernel"], torch.ones_like(only_mus.last_state["kernel"]))
    assert torch.equal(only_mus.last_state["edge_weights"], torch.full_like(only_mus.last_state["edge_weights"], 0.8))
    assert not torch.allclose(only_mus.last_state["centroids"], tasks.support_means(only_mus.preprocess(tasks)[0]))


def test_output_is_the_last_forward_before_the_last_step() -> None:
    """Kills: returning scores recomputed after the final Adam step (the reference returns the scores of its last
    iteration, computed before that iteration's update): n iterations must give the (n−1)-step parameters' scores."""
    tasks, _ = tasks_of([[3, 2, 4]], shots=1, seed=2)
    five = AlphaAM(shots=1, iterations=5)
    probs = five.predict(tasks)
    four = AlphaAM(shots=1, iterations=4)
    four.predict(tasks)
    support, query = four.preprocess(tasks)
    s = four.last_state
    again = four.scores(s["centroids"], support, query, s["kernel"], s["edge_weights"])
    assert torch.allclose(probs[0], torch.softmax(again[0, tasks.ways + tasks.num_support:], 1), atol=1e-6)
    assert not torch.allclose(probs, AlphaAM(shots=1, iterations=4).predict(tasks), atol=1e-7)


def test_adaptation_helps_on_clustered_tasks() -> None:
    """Kills: a loss whose sign or terms drive the predictions away from the structure (accuracy would drop below
    the plain propagation's)."""
    tasks, labels = tasks_of([[6, 1, 3], [2, 5, 3], [4, 4, 2], [1, 2, 7]], shots=1, seed=11)
    before = (AlphaAM(shots=1, iterations=0).predict(tasks).argmax(2) == labels).double().mean()
    after = (AlphaAM(shots=1, iterations=300).predict(tasks).argmax(2) == labels).double().mean()
    assert after >= before and after > 0.9


def test_oracle_free_never_receives_counts() -> None:
    """Kills: α-AM declared as a class-prior method (it would receive the true counts under oracle_prior)."""
    assert not AlphaAM.uses_class_prior and not method_uses_class_prior("alpha_am")
    assert method_display_name("alpha_am") == "α-AM"
    tasks, _ = tasks_of([[3, 1, 2]], shots=1)
    counts = torch.tensor([[3, 1, 2]])
    with pytest.raises(ValueError, match="class prior"):
        AlphaAM(shots=1, query_counts=counts)
    built = build_method("alpha_am", {"iterations": 10}, shots=1, balanced=False, query_counts=counts)
    assert not built.oracle_prior
    assert torch.equal(built.predict(tasks), build_method("alpha_am", {"iterations": 10}, shots=1,
                                                          balanced=False).predict(tasks))


def test_balanced_protocol_uses_the_same_settings() -> None:
    """Kills: a by-protocol switch the reference does not have (its balanced and Dirichlet yamls are identical)."""
    assert (build_method("alpha_am", {}, shots=1, balanced=True).settings
            == build_method("alpha_am", {}, shots=1, balanced=False).settings == AlphaAMSettings().resolve(
                shots=1, balanced=None))


# ------------------------------------------------------------------------------------------- reference
class IdentityBackbone:
    """The reference's backbone slot: the tasks already hold features."""

    def eval(self) -> None:
        return None

    def __call__(self, x: torch.Tensor, feature: bool = True) -> tuple[torch.Tensor, None]:
        return x, None


def reference_checkout() -> Path | None:
    value = os.environ.get(REFERENCE_ENV)
    return Path(value).expanduser() if value else None


@pytest.mark.skipif(reference_checkout() is None,
                    reason=f"set {REFERENCE_ENV} to a checkout of github.com/MichalisLazarou/AM to compare with it")
def test_matches_the_authors_code_on_tiny_tasks(monkeypatch, tmp_path: Path) -> None:
    """Kills: any departure from ALPHA_AM's computation (graph, propagation, loss, Adam, output) on 5-way tasks."""
    from lightning_putm.studies.reference import import_from_checkout

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self, raising=False)
    try:
        module = import_from_checkout(str(reference_checkout()), "src.methods.AM", flag=REFERENCE_ENV)
    except SystemExit as exc:  # e.g. another checkout's `src` already imported in this process
        pytest.skip(str(exc))
    logging.disable(logging.CRITICAL)
    try:
        for shots in (1, 5):
            tasks, _ = tasks_of([[10, 2, 5, 0, 3], [4, 4, 4, 4, 4]], shots=shots, dim=20, seed=shots)
            method = AlphaAM(shots=shots, iterations=60)
            ours = method.predict(tasks).argmax(2)
            args = types.SimpleNamespace(phi="mus+G+Wb", temp=15, K=20, alpha=0.8, loss_weights=[1.0, 1.0, 1.0],
                                         iter=60, lr_lp=1e-4, PLC=True, entropies=["Shannon", "Alpha", "Alpha"],
                                         alpha_values=[1.0, 1.0, 1.0], use_tuned_alpha_values=True)
            reference = module.ALPHA_AM(IdentityBackbone(), torch.device("cpu"), str(tmp_path / "ref.log"), args)
            kept: list[torch.Tensor] = []
            record = reference.record_info  # the code records accuracies only: also keep the final scores Z
            reference.record_info = lambda z, y_q: (kept.append(z.detach()), record(z, y_q))
            task = {"x_s": tasks.support.clone(), "x_q": tasks.query.clone(), "y_s": tasks.support_labels.unsqueeze(2),
                    "y_q": torch.zeros(tasks.num_tasks, tasks.num_queries, 1), "train_mean": torch.zeros(tasks.dim)}
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                reference.run_task(task, shots)  # its own PLC preprocessing, then run_adaptation
            z = kept[-1]  # the reference's output: the last iteration's query scores, L2-normalised over classes
            assert torch.equal(ours, z.argmax(2)), f"{shots}-shot: {(ours != z.argmax(2)).sum()} predictions differ"
            scores = torch.nn.functional.normalize(method.last_state["query_scores"], dim=2)
            assert torch.allclose(scores, z, atol=1e-5)
    finally:
        logging.disable(logging.NOTSET)
