"""PUTM's ``basis`` option: the Cholesky factor of the Gram matrix as the per-task frame (sign-equivalent to QR)."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import make_clustered_features
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.errors import ConfigError, FeatureError
from lightning_putm.methods.putm import method as putm_module  # the PUTM class and the names it calls
from lightning_putm.methods.preprocessing import (cholesky_reduce, l2_normalise, position_invariant_pow, power_transform,
                                                  qr_reduce, reduce_basis, resolve_basis)
from lightning_putm.methods.putm import PUTM

FAST = dict(em_steps=4, inner_steps=5, cpu_workers=1)


def make_tasks(dim: int, queries: int = 40, tasks: int = 4, seed: int = 0):
    features = make_clustered_features(classes=10, per_class=60, dim=dim, spread=0.15, seed=seed)
    return sample_episode_bank(features.labels, 5, 1, queries, 2.0, tasks, seed).gather(features.features)


@pytest.mark.parametrize("tasks,rows,dim", [(4, 80, 640), (3, 20, 20), (2, 7, 9)])
def test_cholesky_coordinates_equal_qr_up_to_the_sign_of_each_coordinate(tasks, rows, dim):
    x = torch.rand(tasks, rows, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))
    qr = qr_reduce(x)
    coords, fallback = cholesky_reduce(x)
    assert coords.shape == qr.shape == (tasks, rows, min(rows, dim))
    assert not fallback.any()
    assert torch.allclose(coords @ coords.transpose(1, 2), x @ x.transpose(1, 2), atol=1e-9)  # inner products
    exact = "donot_use_mm_for_euclid_dist"
    assert torch.allclose(torch.cdist(coords, coords, compute_mode=exact), torch.cdist(qr, qr, compute_mode=exact),
                          atol=1e-9)  # pairwise distances
    assert torch.allclose(coords.abs(), qr.abs(), atol=1e-9)
    # one sign per coordinate (column), the same for every row: a reflection of QR's frame, not a new frame
    signs = torch.sign(qr.diagonal(dim1=1, dim2=2)).unsqueeze(1)
    assert torch.allclose(coords, qr * signs, atol=1e-9)
    assert (coords.diagonal(dim1=1, dim2=2) > 0).all()  # Cholesky's pivots are positive


def test_the_gram_matrix_and_factorisation_run_in_float64_and_return_the_input_dtype(monkeypatch):
    seen: list[torch.dtype] = []
    original = torch.linalg.cholesky_ex

    def spy(matrix, *args, **kwargs):
        seen.append(matrix.dtype)
        return original(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", spy)
    x = torch.rand(3, 10, 30, generator=torch.Generator().manual_seed(0))
    coords, _ = cholesky_reduce(x)
    assert seen == [torch.float64]
    assert coords.dtype == torch.float32
    assert torch.allclose(coords.abs(), qr_reduce(x).abs(), atol=1e-5)


def test_nearly_dependent_rows_stay_accurate_in_float32_input():
    """Rows 1e-4 apart: a float32 Gram matrix would lose the difference (1e-8 relative) entirely."""
    g = torch.Generator().manual_seed(0)
    base = torch.rand(1, 6, 50, dtype=torch.float64, generator=g)
    x64 = torch.cat([base, base[:, :1] + 1e-4 * torch.rand(1, 1, 50, dtype=torch.float64, generator=g)], dim=1)
    coords, fallback = cholesky_reduce(x64.float())
    assert not fallback.any()
    exact = qr_reduce(x64).abs()
    assert torch.allclose(coords.double().abs(), exact, atol=1e-6)


def test_a_rank_deficient_task_falls_back_to_qr_and_is_counted():
    x = torch.rand(3, 12, 40, generator=torch.Generator().manual_seed(1))
    x[1, 5] = x[1, 2]  # task 1 repeats a row: its Gram matrix is singular
    with pytest.warns(UserWarning, match=r"fell back to QR for 1 of 3 tasks"):
        coords, fallback = reduce_basis(x, "cholesky", "putm")
    assert fallback.tolist() == [False, True, False]
    assert torch.allclose(coords[1], qr_reduce(x[1:2])[0], atol=1e-6)  # the QR frame, signs included
    assert torch.isfinite(coords).all()
    assert torch.allclose(coords.abs(), qr_reduce(x).abs(), atol=1e-5)


def test_more_rows_than_dimensions_uses_qr_with_width_d():
    x = torch.rand(2, 30, 8, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match=r"2 of 2 tasks: n = 30 rows > d = 8"):
        coords, fallback = reduce_basis(x, "cholesky", "putm")
    assert coords.shape == (2, 30, 8)
    assert fallback.all()
    assert torch.equal(coords, qr_reduce(x))


def test_the_default_basis_is_qr_on_cpu_and_unchanged():
    """``basis=auto`` (the default) on CPU is the QR of the published numbers, bit for bit. Kills: auto resolved to
    cholesky off CUDA (CPU results would change)."""
    gathered = make_tasks(dim=64, tasks=2)
    putm = PUTM(shots=1, balanced=False, **FAST)
    assert putm.settings.basis == "auto"
    x = torch.cat([gathered.batch.support, gathered.batch.query], dim=1)
    expected = l2_normalise(qr_reduce(power_transform(x, 0.6)))
    assert torch.equal(putm.preprocess(gathered.batch), expected)


def test_cholesky_basis_gives_the_same_putm_predictions_on_small_tasks():
    gathered = make_tasks(dim=64, queries=40, tasks=4)  # 45 rows <= 64 dimensions: no fallback
    # fp32 products: under bf16 (precision=auto on a CPU with AVX512-BF16) a flipped sign rounds differently
    qr = PUTM(shots=1, balanced=False, precision="fp32", **FAST)
    cholesky = PUTM(shots=1, balanced=False, basis="cholesky", precision="fp32", **FAST)
    rows_qr, rows_cholesky = qr.preprocess(gathered.batch), cholesky.preprocess(gathered.batch)
    assert not torch.allclose(rows_qr, rows_cholesky, atol=1e-3)  # some coordinates really changed sign
    assert torch.allclose(rows_qr.abs(), rows_cholesky.abs(), atol=1e-5)
    a, b = qr.predict(gathered.batch), cholesky.predict(gathered.batch)
    assert torch.equal(a.argmax(2), b.argmax(2))
    # Adam turns the bases' last-bit differences into ±lr steps: measured (2026-11-28) 1.5e-4, 1.3% of the distance
    # from uniform, with MKL's reproducibility mode (1.8e-6 without it; a one-ulp change of the features alone
    # moves the QR basis's result by 6e-5); a wrong basis fails the rows' checks above
    assert (a - b).abs().max() <= 0.05 * (a - 1 / a.shape[2]).abs().max()


def test_auto_basis_is_cholesky_on_cuda_and_falls_back_to_qr_silently(monkeypatch):
    """``auto`` → ``cholesky`` on CUDA (one batched call instead of a QR launch per task), ``qr`` elsewhere; named
    bases stay. PUTM resolves it for the rows' device, and when ``auto``'s Cholesky falls back to QR (here n = 45
    rows > d = 16: every task) it says nothing, for the result is the QR the user would otherwise get; a
    ``basis=cholesky`` asked for by name still warns. Kills: auto resolved without the device, a fallback warning
    for a basis the user did not choose, the named basis's warning lost."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert (resolve_basis("auto", cuda), resolve_basis("auto", cpu)) == ("cholesky", "qr")
    assert resolve_basis("qr", cuda) == "qr" and resolve_basis("cholesky", cpu) == "cholesky"
    asked = []
    monkeypatch.setattr(putm_module, "resolve_basis",
                        lambda basis, device: asked.append(device) or resolve_basis(basis, cuda))  # as on a GPU
    gathered = make_tasks(dim=16, tasks=2)
    x = power_transform(torch.cat([gathered.batch.support, gathered.batch.query], dim=1), 0.6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = PUTM(shots=1, balanced=False, **FAST).preprocess(gathered.batch)
    assert asked == [torch.device("cpu")]
    assert torch.equal(rows, l2_normalise(qr_reduce(x)))
    with pytest.warns(UserWarning, match=r"basis=cholesky fell back to QR for 2 of 2 tasks"):
        PUTM(shots=1, balanced=False, basis="cholesky", **FAST).preprocess(gathered.batch)
    # the device asked is the rows' own (rows on the meta device here, stopped right after the question)
    monkeypatch.setattr(putm_module, "power_transform", lambda x, beta, name: x.to("meta"))
    monkeypatch.setattr(putm_module, "resolve_basis", lambda basis, device: asked.append(device) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        PUTM(shots=1, balanced=False, **FAST).preprocess(gathered.batch)
    assert asked[-1] == torch.device("meta")


def test_an_unknown_basis_is_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"putm.basis must be one of auto, qr, cholesky; got 'lu'"):
        PUTM(shots=1, balanced=False, basis="lu")
    with pytest.raises(ValueError, match="basis must be one of"):
        reduce_basis(torch.rand(1, 3, 4), "lu")


@pytest.mark.cuda
def test_cholesky_on_cuda_matches_qr_on_cpu():
    x = torch.rand(300, 80, 640, generator=torch.Generator().manual_seed(5)).pow(0.6)
    x[7, 3] = x[7, 1]  # one rank-deficient task: falls back on the GPU too
    coords, fallback = cholesky_reduce(x.to("cuda"))
    assert coords.device.type == "cuda" and fallback.tolist() == [i == 7 for i in range(300)]
    coords, reference = coords.cpu(), qr_reduce(x)
    full_rank = torch.arange(300) != 7
    assert torch.allclose(coords[full_rank].abs(), reference[full_rank].abs(), atol=1e-4)
    # past the rank, R is not unique (GPU and CPU Householder QR differ there); what PUTM uses, the distances
    # between a task's rows, is: the rows' Gram matrix equals x xᵀ on both devices
    gram = x[7].double() @ x[7].double().T
    assert torch.allclose(coords[7].double() @ coords[7].double().T, gram, rtol=1e-4, atol=1e-2)


def test_beta_one_is_no_transform_and_accepts_signed_features() -> None:
    """Kills: the sign check before the β = 1 shortcut (its own error message tells users to pass beta=1)."""
    x = torch.tensor([[[-0.5, 0.25], [1.0, -2.0]]])
    assert power_transform(x, 1.0) is x
    with pytest.raises(FeatureError, match="non-negative"):
        power_transform(x, 0.5)


@pytest.mark.parametrize("beta", [0.6, 0.3])
def test_the_power_transform_gives_each_element_the_same_bits_wherever_it_sits(beta):
    """A task's transformed features must not depend on its place in the batch, on how many elements precede it,
    or on how ATen splits a large tensor across threads: on CPU, ATen's SIMD power and the C library's (which it
    uses for the last elements of each range) differ in the last bit at β = 0.6, and in fp32 Adam turned that into
    a task alone and in a batch disagreeing by 1.8e-6 (measured on an AVX-512 and an AVX2 code path; a CPU whose
    ``precision=auto`` is fp32 failed tests/test_memory_backoff.py on it). Kills: a plain ``x.pow(beta)``."""
    torch.manual_seed(0)
    x = torch.rand(7, 33, 19)
    whole = power_transform(x, beta)
    for task in range(len(x)):
        assert torch.equal(power_transform(x[task:task + 1], beta), whole[task:task + 1])
    flat = whole.flatten()
    for skip in range(70):  # any number of elements before it, including fewer than a vector
        assert torch.equal(position_invariant_pow(x.flatten()[skip:] + 1e-6, beta), flat[skip:])
    large = torch.rand(300_000)  # above ATen's grain size: split across threads where there are several
    assert torch.equal(position_invariant_pow(large, beta)[123_456:123_500],
                       position_invariant_pow(large[123_456:123_500], beta))
    assert torch.allclose(whole, (x + 1e-6).pow(beta), rtol=1e-6, atol=0)  # still the power, to float rounding
