"""Feature transforms shared by transductive methods (PUTM §3.1, PT-MAP, SimpleShot, BD-CSPN, LaplacianShot).

* Power transform ``(x + 1e-6)^β`` (Hu et al., PT-MAP 2021): Gaussianises post-ReLU features. It needs
  non-negative input; a negative value is almost always a sign of already-centred features, so it is
  refused with a clear error rather than producing NaN.
* Per-task QR reduction: the rows of a task span at most ``n`` dimensions, so the reduced R factor of
  ``Xᵀ`` gives coordinates ``[n, min(d, n)]`` with identical pairwise distances and inner products and a
  much smaller width. PUTM's navigator is not rotation-invariant, so this frame is part of the algorithm.
  The same frame, up to the sign of each coordinate, is the Cholesky factor ``L`` of the task's small
  ``n × n`` Gram matrix ``XXᵀ = RᵀR`` (:func:`cholesky_reduce`): one batched factorisation instead of one
  Householder QR per task on CUDA. PUTM only sees coordinates through ``(μ_k − x_j)²``, class means and
  L2 norms, all unchanged by flipping a coordinate's sign.
* CL2N (Wang et al., SimpleShot 2019): subtract the base-class feature mean, then L2-normalise. Without a
  base-class mean only the L2 step is applied (SimpleShot's "L2N").
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from lightning_putm.errors import FeatureError

POWER_EPS = 1e-6


def check_power_transform_input(x: torch.Tensor, beta: float, method: str = "method") -> None:
    """The :class:`FeatureError` :func:`power_transform` raises for ``x``: negative features with ``β ≠ 1``."""
    if beta == 1.0:
        return
    minimum = float(x.min()) if x.numel() else 0.0
    if minimum < 0:
        raise FeatureError(
            f"{method}: the power transform (beta={beta}) needs non-negative features (post-ReLU backbone "
            f"outputs), but the smallest value is {minimum:.4g}. Pass un-centred features, or disable the "
            f"transform for this method (method.{method}.beta=1 keeps features as they are)"
        )


def power_transform(x: torch.Tensor, beta: float, method: str = "method") -> torch.Tensor:
    """``(x + 1e-6)^β`` for non-negative ``x``; raises :class:`FeatureError` on negative input. ``β = 1`` is no
    transform: features of any sign pass unchanged (signed backbones, e.g. ViT pre-logits, need it)."""
    check_power_transform_input(x, beta, method)
    if beta == 1.0:
        return x
    return position_invariant_pow(x + POWER_EPS, beta)


#: Elements per call of :func:`position_invariant_pow`: a multiple of every CPU vector width times its unrolling
#: (no element left to the scalar tail) and below ATen's grain size for splitting work across threads (32,768).
POW_BLOCK = 16384
POW_ALIGN = 64


def position_invariant_pow(x: torch.Tensor, exponent: float) -> torch.Tensor:
    """``x ** exponent`` with each element's bits independent of where it sits in ``x`` (on the CPU).

    ATen computes a power of a float tensor with SIMD code (SLEEF, within 1 ulp) except for the last elements of
    each thread's range, which take the C library's ``pow``; the two differ in the last bit for most exponents
    (β = 0.6, PUTM's default, among them). So a task's transformed features depended on its position in the
    batch and on the number of threads, and in fp32 Adam turned that into different navigators (a task alone
    and in a batch disagreed by 1.8e-6 in probability). Here every element goes through the SIMD code: the
    flattened tensor is padded to a multiple of :data:`POW_ALIGN` and raised in blocks of :data:`POW_BLOCK`,
    one thread each. On a GPU every element already takes the same path."""
    if x.device.type != "cpu":
        return x.pow(exponent)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = F.pad(flat, (0, (-n) % POW_ALIGN), value=1.0)
    out = torch.empty_like(padded)
    for start in range(0, padded.numel(), POW_BLOCK):
        torch.pow(padded[start:start + POW_BLOCK], exponent, out=out[start:start + POW_BLOCK])
    return out[:n].view(x.shape)


def qr_reduce(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[T, n, d]`` → coordinates ``[T, n, min(d, n)]`` in each task's own orthonormal basis.

    Only the R factor of ``Xᵀ`` is computed (``mode="r"``): LAPACK's Householder factorisation (geqrf) gives
    the same R, bit for bit, as ``mode="reduced"``, which then also forms Q (several times slower).
    """
    r = torch.linalg.qr(x.transpose(1, 2), mode="r").R  # [T, min(d, n), n]
    return r.transpose(1, 2)


#: Bases :func:`reduce_basis` knows: ``qr`` (Householder, the default) and ``cholesky`` (batched, see module doc).
BASES = ("qr", "cholesky")
#: A task whose Cholesky pivot ``L_ii`` falls below this fraction of its largest row norm is treated as
#: rank-deficient and reduced by QR instead. Above it the float64 factor's error (≈ 1e-16·‖x‖²/L_ii) stays
#: below float32 rounding of the coordinates (≈ 6e-8·‖x‖), so the result is as accurate as an fp32 QR.
CHOLESKY_MIN_PIVOT = 1e-6


def cholesky_reduce(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[T, n, d]`` → (coordinates ``[T, n, min(d, n)]``, ``[T]`` bool: task fell back to QR).

    Coordinates are the lower Cholesky factor ``L`` of ``XXᵀ`` (float64 Gram matrix and factorisation, cast
    back to ``x.dtype``): ``L = Rᵀ·diag(±1)`` for Householder's ``R`` of ``Xᵀ``, so pairwise distances, inner
    products and ``|coordinates|`` equal :func:`qr_reduce`'s. Tasks whose Gram matrix is not (numerically)
    positive definite, i.e. repeated or dependent rows, are reduced by :func:`qr_reduce`; with ``n > d``
    every task is rank-deficient and the whole batch uses QR.
    """
    tasks, n, d = x.shape
    if n > d or tasks == 0:
        return qr_reduce(x), torch.ones(tasks, dtype=torch.bool, device=x.device)
    rows = x.to(torch.float64)
    gram = rows @ rows.transpose(1, 2)  # [T, n, n]
    factor, info = torch.linalg.cholesky_ex(gram)
    pivots = factor.diagonal(dim1=1, dim2=2).amin(dim=1)
    scale = gram.diagonal(dim1=1, dim2=2).amax(dim=1).sqrt()
    fallback = (info != 0) | ~(pivots > CHOLESKY_MIN_PIVOT * scale)  # NaN pivots fall back too
    coords = factor.to(x.dtype)
    if bool(fallback.any()):
        index = fallback.nonzero().squeeze(1)
        coords[index] = qr_reduce(x[index])
    return coords, fallback


def resolve_basis(basis: str, device: torch.device) -> str:
    """``auto`` → ``cholesky`` on CUDA, ``qr`` elsewhere; others unchanged. On CUDA the Householder QR of a task
    with more than 256 feature dimensions is one factorisation launch per task (0.28 s per 1000 tasks on an H100,
    a quarter of what the fused PUTM kernel takes to solve them), the Cholesky factor one batched call; both give
    the same frame up to the sign of each coordinate. On CPU the QR is the faster one, and the published numbers'."""
    if basis != "auto":
        return basis
    return "cholesky" if device.type == "cuda" else "qr"


def reduce_basis(x: torch.Tensor, basis: str = "qr", method: str = "method",
                 warn: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each task's rows in its own orthonormal basis by ``basis`` (``qr`` | ``cholesky``); returns the
    coordinates and a ``[T]`` bool of tasks that fell back from Cholesky to QR (all False for ``qr``).
    Warns once per call when some tasks fell back (``warn``: a basis the user asked for by name; a basis chosen
    for them, whose fallback gives exactly the QR they would otherwise get, falls back silently)."""
    if basis == "qr":
        return qr_reduce(x), torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if basis != "cholesky":
        raise ValueError(f"{method}: basis must be one of {', '.join(BASES)}; got {basis!r}")
    coords, fallback = cholesky_reduce(x)
    count = int(fallback.sum())
    if count and warn:
        n, d = x.shape[1], x.shape[2]
        why = (f"n = {n} rows > d = {d} dimensions" if n > d
               else "repeated or linearly dependent rows (Gram matrix not positive definite)")
        warnings.warn(f"{method}: basis=cholesky fell back to QR for {count} of {x.shape[0]} tasks: {why}",
                      stacklevel=2)
    return coords, fallback


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1)


def cl2n(x: torch.Tensor, base_mean: torch.Tensor | None, method: str = "method") -> torch.Tensor:
    """CL2N: ``(x − base_mean) / ‖x − base_mean‖``; plain L2N when ``base_mean`` is ``None``."""
    if base_mean is not None:
        if base_mean.dim() != 1 or base_mean.shape[0] != x.shape[-1]:
            raise FeatureError(
                f"{method}: the base-class mean has shape {tuple(base_mean.shape)} but the task features have "
                f"d={x.shape[-1]}; the base_features file must come from the same backbone as the features"
            )
        x = x - base_mean.to(x.device, x.dtype)
    return l2_normalise(x)


def squared_distances(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """``‖x_j − c_k‖²``: ``[T, Q, d] × [T, N, d] → [T, Q, N]``."""
    return torch.cdist(x, centres).pow(2)
