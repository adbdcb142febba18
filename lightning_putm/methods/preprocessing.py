"""Feature transforms shared by transductive methods (PUTM §3.1, PT-MAP, SimpleShot, BD-CSPN, LaplacianShot).

* Power transform ``(x + 1e-6)^β`` (Hu et al., PT-MAP 2021): Gaussianises post-ReLU features. It needs
  non-negative input; a negative value is almost always a sign of already-centred features, so it is
  refused with a clear error rather than producing NaN.
* Per-task QR reduction: the rows of a task span at most ``n`` dimensions, so the reduced R factor of
  ``Xᵀ`` gives coordinates ``[n, min(d, n)]`` with identical pairwise distances and inner products and a
  much smaller width. PUTM's navigator is not rotation-invariant, so this frame is part of the algorithm.
* CL2N (Wang et al., SimpleShot 2019): subtract the base-class feature mean, then L2-normalise. Without a
  base-class mean only the L2 step is applied (SimpleShot's "L2N").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_putm.errors import FeatureError

POWER_EPS = 1e-6


def power_transform(x: torch.Tensor, beta: float, method: str = "method") -> torch.Tensor:
    """``(x + 1e-6)^β`` for non-negative ``x``; raises :class:`FeatureError` on negative input."""
    minimum = float(x.min()) if x.numel() else 0.0
    if minimum < 0:
        raise FeatureError(
            f"{method}: the power transform (beta={beta}) needs non-negative features (post-ReLU backbone "
            f"outputs), but the smallest value is {minimum:.4g}. Pass un-centred features, or disable the "
            "transform for this method (beta=1 keeps features as they are)"
        )
    if beta == 1.0:
        return x
    return (x + POWER_EPS).pow(beta)


def qr_reduce(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[T, n, d]`` → coordinates ``[T, n, min(d, n)]`` in each task's own orthonormal basis.

    Only the R factor of ``Xᵀ`` is computed (``mode="r"``): LAPACK's Householder factorisation (geqrf) gives
    the same R, bit for bit, as ``mode="reduced"``, which then also forms Q (several times slower).
    """
    r = torch.linalg.qr(x.transpose(1, 2), mode="r").R  # [T, min(d, n), n]
    return r.transpose(1, 2)


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
