"""BAVARDAGE (Hu, Pateux & Gripon, AISTATS 2023): each step against its closed form on hand-made cases.

Each test names the wrong implementation (mutant) it kills.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.tasks import clustered_tasks
from lightning_putm.methods import build_method
from lightning_putm.methods.bavardage import (
    BAVARDAGE,
    adaptive_projection,
    base_within_class_scatter,
    clamp_support,
    dirichlet_posterior,
    expected_log_likelihood,
    expected_log_weights,
    mean_posterior,
    soft_kmeans,
    task_whitening,
)
from lightning_putm.tasks import TaskBatch

torch.set_default_dtype(torch.float32)


def make_tasks(counts: list[list[int]], shots: int = 1, dim: int = 16, spread: float = 0.1,
               seed: int = 0) -> tuple[TaskBatch, torch.Tensor]:
    """One Gaussian cluster per class; ``counts[t][k]`` queries of class k in task t (support class-major)."""
    return clustered_tasks(counts, shots, dim, spread, seed=seed, non_negative=False, class_major=True)


# ----------------------------------------------------------------------------------------- preprocessing
def test_base_scatter_is_the_frobenius_normalised_mean_times_the_mean_norm() -> None:
    # rows are already unit-norm and the base mean is 0, so CL2N keeps them. Class 0: scatter diag(2, 0),
    # norm 2; class 1: diag(0, 4), norm 4 -> (diag(1, 0) + diag(0, 1))/2 * 3 = 1.5 I.
    # Kills: dividing by the class size, a plain sum/mean of the scatters, skipping CL2N or the class means.
    rows = torch.tensor([[1.0, 0], [-1, 0], [0, 1], [0, 1], [0, -1], [0, -1]])
    labels = torch.tensor([0, 0, 1, 1, 1, 1])
    scatter = base_within_class_scatter(rows * 3, labels, torch.zeros(2))
    torch.testing.assert_close(scatter, 1.5 * torch.eye(2, dtype=torch.float64))


def test_rows_are_centred_on_the_base_mean_else_on_the_task_mean() -> None:
    # The task basis keeps inner products, so the Gram matrix of the preprocessed rows must be that of
    # L2(x − base mean), of L2(x − task mean) without a base mean, or of L2(x) with task_centring=false.
    # Kills: the base mean ignored, the task-centring fallback missing, centring on the support only.
    tasks, _ = make_tasks([[4, 3, 2]], shots=2, dim=5, spread=0.5)
    x = torch.cat([tasks.support, tasks.query], 1).double()[0]
    base = torch.full((5,), 0.7)
    for method, centre in [(BAVARDAGE(base_mean=base), base.double()), (BAVARDAGE(), x.mean(0)),
                           (BAVARDAGE(task_centring=False), torch.zeros(5, dtype=torch.float64))]:
        coords, _ = method.preprocess(tasks)
        rows = torch.nn.functional.normalize(x - centre, dim=1)
        torch.testing.assert_close(coords[0] @ coords[0].T, rows @ rows.T)


def test_whitening_matches_the_inverse_of_the_projected_precision() -> None:
    # A 2-d subspace U of R^3 that is NOT an eigen-subspace of the base covariance: the whitened distances
    # must be those of x -> Σ_U^{-1/2} x with Σ_U = (Uᵀ Σ⁻¹ U)⁻¹ (the paper's code), and the scale capped.
    # Kills: Uᵀ Σ U instead of (Uᵀ Σ⁻¹ U)⁻¹, scaling by λ^{+1/2}, a missing cap, ignoring U.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 3, generator=g, dtype=torch.float64)
    cov = a @ a.T + 0.1 * torch.eye(3, dtype=torch.float64)
    basis = torch.linalg.qr(torch.randn(3, 2, generator=g, dtype=torch.float64)).Q.unsqueeze(0)  # [1, 3, 2]
    coords = torch.randn(1, 6, 2, generator=g, dtype=torch.float64)
    sigma_u = torch.linalg.inv(basis[0].T @ torch.linalg.inv(cov) @ basis[0])
    e, v = torch.linalg.eigh(sigma_u)
    for clip in (100.0, float(e.pow(-0.5).mean())):
        expected = (coords[0] @ v) * e.pow(-0.5).clamp(max=clip)
        whitened, scale = task_whitening(coords, basis, torch.linalg.inv(cov), clip)
        torch.testing.assert_close(torch.cdist(whitened[0], whitened[0]), torch.cdist(expected, expected))
        torch.testing.assert_close(scale[0].sort().values, e.pow(-0.5).clamp(max=clip).sort().values)
    # without base statistics Σ = I: every coordinate is scaled by min(1, clip)
    plain, scale = task_whitening(coords, basis, None, 0.5)
    torch.testing.assert_close(plain, coords * 0.5)


# ----------------------------------------------------------------------------------------- soft k-means
def test_soft_kmeans_first_step_is_a_softmax_of_distances_to_the_support_means() -> None:
    # Kills: a wrong sign or missing temperature, support rows not forced to their labels.
    x = torch.tensor([[[0.0, 0], [2, 0], [0.5, 0], [1.5, 0]]], dtype=torch.float64)
    one_hot = torch.eye(2, dtype=torch.float64).unsqueeze(0)
    resp = soft_kmeans(x, one_hot, temperature=3.0, iterations=1)
    d2 = torch.tensor([[0.25, 2.25], [2.25, 0.25]], dtype=torch.float64)
    torch.testing.assert_close(resp[0, 2:], torch.softmax(-3.0 * d2, dim=1))
    torch.testing.assert_close(resp[0, :2], one_hot[0])


def test_soft_kmeans_converges_on_separated_clusters() -> None:
    # Two clusters at 0 and 4 (spread 0.5); the supports at -1 and 2 put the first decision boundary (0.5)
    # inside cluster 0, so the support means alone misassign part of it. The k-means iterations must move the
    # centres to the cluster means and fix every query. Kills: centres never updated (stuck on the supports),
    # queries left out of the centre update, support rows not clamped.
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(2).repeat_interleave(40)
    query = torch.stack([4.0 * labels + 0.5 * torch.randn(80, generator=g), torch.zeros(80)], 1).double()
    support = torch.tensor([[-1.0, 0], [2, 0]], dtype=torch.float64)
    x = torch.cat([support, query]).unsqueeze(0)
    one_hot = torch.eye(2, dtype=torch.float64).unsqueeze(0)
    one_step = soft_kmeans(x, one_hot, temperature=2.0, iterations=1)
    assert (one_step[0, 2:].argmax(1) == labels).double().mean() < 0.95  # the supports alone do not suffice
    resp = soft_kmeans(x, one_hot, temperature=2.0, iterations=10)
    assert (resp[0, 2:].argmax(1) == labels).all()
    torch.testing.assert_close(resp[0, :2], one_hot[0])
    centres = (resp[0].T @ x[0, :, 0]) / resp[0].sum(0)
    truth = torch.stack([torch.cat([support[k:k + 1, 0], query[labels == k, 0]]).mean() for k in range(2)])
    torch.testing.assert_close(centres, truth, atol=0.02, rtol=0)


# ----------------------------------------------------------------------------------------- adaptive projection
def test_projection_keeps_the_subspace_where_the_classes_differ() -> None:
    # 3 classes (30 rows each) whose means differ only in coordinates 0 and 1 of R^6 (a large shared offset and
    # large per-class zero-mean noise elsewhere):
    # the ADR basis must span exactly e0, e1. Kills: projecting on the centroids (includes the offset), on
    # leading principal directions of the data (the noise), or a transposed QR.
    g = torch.Generator().manual_seed(0)
    means = torch.zeros(3, 6, dtype=torch.float64)
    means[:, :2] = torch.tensor([[0.0, 0], [1, 0], [0, 1]])
    means[:, 2:] = 5.0
    labels = torch.arange(3).repeat_interleave(30)
    noise = torch.randn(90, 6, generator=g, dtype=torch.float64) * torch.tensor([0, 0, 3, 3, 3, 3.0])
    noise = noise - noise.view(3, 30, 6).mean(1).repeat_interleave(30, 0)  # exactly zero-mean per class
    y = (means[labels] + noise).unsqueeze(0)
    resp = torch.nn.functional.one_hot(labels).double().unsqueeze(0)
    q = adaptive_projection(y, resp, beta0=10.0)
    assert q.shape == (1, 6, 2)
    target = torch.zeros(6, 6, dtype=torch.float64)
    target[0, 0] = target[1, 1] = 1
    torch.testing.assert_close(q[0] @ q[0].T, target, atol=1e-10, rtol=0)


def test_projection_uses_the_shrunk_centroids() -> None:
    # Class 0: one row (1, 0); class 1: three rows (0, 1). Shrunk centroids c_k = Σ r y / (n_k + β₀):
    # c0 = (1/11, 0), c1 = (0, 3/13); the 1-d basis is ± their normalised difference, not that of the plain
    # means (-1, 1)/√2. Kills: plain means, β₀ added to the wrong side.
    y = torch.tensor([[[1.0, 0], [0, 1], [0, 1], [0, 1]]], dtype=torch.float64)
    resp = torch.tensor([[[1.0, 0], [0, 1], [0, 1], [0, 1]]], dtype=torch.float64)
    q = adaptive_projection(y, resp, beta0=10.0)[0, :, 0]
    expected = torch.tensor([-1 / 11, 3 / 13], dtype=torch.float64)
    torch.testing.assert_close(q.abs(), (expected / expected.norm()).abs())


# ----------------------------------------------------------------------------------------- variational updates
def test_dirichlet_posterior_and_expected_log_weights() -> None:
    # α_k = α₀ + Σ_j r_jk; E[ln π_k] = ψ(α_k) − ψ(Σα): ψ(2) − ψ(3) = −1/2, ψ(1) − ψ(3) = −3/2.
    # Kills: counts over the wrong axis, a missing prior, E[ln π] = ln(α_k/Σα).
    query_resp = torch.tensor([[[0.5, 0.0], [0.5, 0.0]]], dtype=torch.float64)
    alpha = dirichlet_posterior(query_resp, prior=1.0)
    torch.testing.assert_close(alpha, torch.tensor([[2.0, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(expected_log_weights(alpha), torch.tensor([[-0.5, -1.5]], dtype=torch.float64))


def test_mean_posterior_and_expected_log_likelihood() -> None:
    # β_k = β₀ + N_k; m_k = Σ r z / β_k (prior mean 0): β = (4, 3), m0 = (4, 0)/4, m1 = (0, 2)/3.
    # E[ln N(z; μ, σ²I)] at z = (1, 0), m0 = (1, 0): −0 − ln 2π − 2/(2·4); at m1: −(1 + 4/9)/(2σ²) − ln 2π − 2/6.
    # Kills: β_k without β₀, means not shrunk, a missing −D/(2β_k) (the posterior variance of the mean).
    z = torch.tensor([[[1.0, 0], [3, 0], [0, 2]]], dtype=torch.float64)
    resp = torch.tensor([[[1.0, 0], [1, 0], [0, 1]]], dtype=torch.float64)
    beta, means = mean_posterior(z, resp, beta0=2.0)
    torch.testing.assert_close(beta, torch.tensor([[4.0, 3.0]], dtype=torch.float64))
    torch.testing.assert_close(means, torch.tensor([[[1.0, 0], [0, 2 / 3]]], dtype=torch.float64))
    ell = expected_log_likelihood(z[:, :1], means, beta, sigma2=0.5)
    expected = torch.tensor([[[-math.log(2 * math.pi) - 0.25,
                               -(1 + 4 / 9) / 1.0 - math.log(2 * math.pi) - 1 / 3]]], dtype=torch.float64)
    torch.testing.assert_close(ell, expected)


def test_one_vb_step_wires_the_closed_forms_together() -> None:
    # solve with one VB iteration = soft k-means, then Dirichlet counts of the QUERY responsibilities,
    # ADR, mean posterior, E-step softmax. Kills: support rows counted in α (α would be larger by K), E-step
    # before the M-step, a missing class-weight term.
    tasks, _ = make_tasks([[10, 3, 2]], shots=2, spread=0.6)
    method = BAVARDAGE(vb_iterations=1, dirichlet_prior=0.7, vb_temperature=5.0)
    probs = method.solve(tasks).double()
    state = method.last_state
    torch.testing.assert_close(state["dirichlet"], 0.7 + state["init"].sum(1))
    coords, y = method.preprocess(tasks)
    one_hot = tasks.one_hot_support().double()
    resp = soft_kmeans(coords, one_hot, 10.0, 5)
    z = y @ adaptive_projection(y, resp, 10.0)
    beta, means = mean_posterior(z, resp, 10.0)
    logits = expected_log_weights(0.7 + resp[:, 6:].sum(1)).unsqueeze(1) + expected_log_likelihood(z, means, beta, 0.2)
    torch.testing.assert_close(probs, clamp_support(torch.softmax(logits, 2), one_hot)[:, 6:], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------- whole method
def test_near_perfect_on_separated_data_with_an_empty_class() -> None:
    # Centred as a base mean would (the cluster centres are uniform in [0, 2]^d, so the "base mean" is 1).
    # Kills: classes with no query breaking the Dirichlet/means (NaN), a wrong sign anywhere in the E-step.
    tasks, labels = make_tasks([[30, 0, 20, 15, 10], [5, 10, 20, 25, 15], [15] * 5], shots=1, spread=0.1)
    probs = BAVARDAGE(base_mean=torch.ones(tasks.dim)).predict(tasks)
    assert torch.isfinite(probs).all()
    assert (probs.argmax(2) == labels).double().mean() >= 0.99


def test_deterministic_and_independent_of_the_batch() -> None:
    # Kills: any statistic pooled over the tasks of a batch, randomness without a task seed.
    tasks, _ = make_tasks([[20, 0, 30, 15, 10], [15] * 5, [1, 2, 3, 4, 65]], spread=0.9, seed=3)
    method = BAVARDAGE()
    together = method.predict(tasks)
    torch.testing.assert_close(method.predict(tasks), together, atol=0, rtol=0)
    alone = torch.cat([method.predict(tasks.slice(i, i + 1)) for i in range(tasks.num_tasks)])
    torch.testing.assert_close(alone, together, atol=1e-6, rtol=0)
    chunked = BAVARDAGE(memory_budget_mb=1e-3)
    assert chunked.chunk_size(tasks) == 1
    torch.testing.assert_close(chunked.predict(tasks), together, atol=1e-6, rtol=0)


def test_the_protocol_prior_is_never_the_silent_default() -> None:
    # Kills: α₀ = 2 (the benchmark's sampling α) as default, the protocol α or true counts used unlabelled.
    counts = torch.tensor([[40, 5, 10, 0, 20]])
    assert build_method("bavardage", {}, shots=1, balanced=False).prior == 1.0
    assert not build_method("bavardage", {}, shots=1, balanced=False).oracle_prior
    leaky = build_method("bavardage", {"oracle_dirichlet_alpha": 2.0}, shots=1, balanced=False)
    assert leaky.oracle_prior and leaky.prior == 2.0
    assert build_method("bavardage", {}, shots=1, balanced=False, query_counts=counts).oracle_prior


def test_oracle_counts_become_the_class_weights_and_balanced_weights_are_uniform() -> None:
    # Under the oracle the true proportions fix the class weights: an empty class gets (almost) nothing.
    # Balanced tasks keep uniform weights (no Dirichlet update). Kills: counts ignored, balanced flag ignored.
    tasks, _ = make_tasks([[40, 5, 10, 0, 20]], spread=0.8, seed=5)
    oracle = BAVARDAGE(query_counts=torch.tensor([[40, 5, 10, 0, 20]]))
    probs = oracle.predict(tasks)
    assert probs[0, :, 3].max() < 1e-6
    assert "dirichlet" not in oracle.last_state
    balanced = BAVARDAGE(balanced=True)
    balanced.predict(tasks)
    assert "dirichlet" not in balanced.last_state


def test_base_statistics_change_the_whitening() -> None:
    # Kills: the base covariance accepted but not used.
    tasks, _ = make_tasks([[10] * 3], spread=0.5)
    cov = torch.diag(torch.tensor([4.0] + [0.01] * 15))
    with_cov = BAVARDAGE(base_covariance=cov, clip=100.0)
    with_cov.predict(tasks)
    scale = with_cov.last_state["scale"]
    assert scale.max() > 5 and scale.min() < 1
    plain = BAVARDAGE(clip=100.0)
    plain.predict(tasks)
    torch.testing.assert_close(plain.last_state["scale"], torch.ones_like(scale))


@pytest.mark.parametrize("bad", [{"vb_temperature": 0}, {"clip": -1}, {"oracle_dirichlet_alpha": 0},
                                 {"km_iterations": 0}, {"dirichlet_prior": 0}])
def test_bad_hyper_parameters_fail(bad: dict) -> None:
    from lightning_putm.errors import ConfigError

    with pytest.raises(ConfigError):
        build_method("bavardage", bad, shots=1, balanced=False)


def test_bavardage_page_counts_its_compared_rows_and_says_the_evaluation_whitens() -> None:
    """Kills a stale page: the fidelity paragraph's row count must be the table's rows that have a reference, and
    the page must not say the evaluation skips the base scatter (it passes it: evaluation/sources.py)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "methods" / "bavardage.md").read_text()
    table = page[page.index("setting                          prior"):]
    table = table[: table.index("```")]
    rows = [line for line in table.splitlines()[1:] if line.strip()]
    compared = [line for line in rows if "nan%" not in line]
    claimed = re.search(r"identical \(100\.0%\) in all (\d+) compared rows", page)
    assert claimed is not None and int(claimed.group(1)) == len(compared) == 12
    assert "does not compute it yet" not in page and "Evaluation change needed" not in page
