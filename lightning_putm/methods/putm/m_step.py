"""The M-step: new prototypes from the navigators, with inertia (paper §3, Algorithm 1).

The estimate μ̂_k is the mean of the support rows of class ``k`` (one-hot weights) and of all query rows
weighted by the navigator's mass on class ``k``; the prototype moves a fraction ``a`` (the inertia) towards
it, ``μ ← μ + a(μ̂ − μ)``, as in the reference code (github.com/RashLog/PUTM).
"""

from __future__ import annotations

import torch

from lightning_putm.tasks import weighted_class_means


def query_weights(forward: torch.Tensor, backward: torch.Tensor, prototype_update: str, rho: float) -> torch.Tensor:
    """Query weights ``[T, Q, N]`` of the M-step: π_f (``forward``, the reference code), π_b (``backward``),
    or the ρ-mixture ``ρ·π_f + (1−ρ)·π_b`` (``mixed``)."""
    if prototype_update == "forward":
        return forward
    if prototype_update == "backward":
        return backward
    return rho * forward + (1 - rho) * backward


def m_step(rows: torch.Tensor, support_one_hot: torch.Tensor, query_weights: torch.Tensor,
           prototypes: torch.Tensor, inertia: float) -> torch.Tensor:
    """``μ ← μ + a(μ̂ − μ)`` with μ̂ the weighted mean of support (one-hot) and query rows."""
    estimate = weighted_class_means(rows, torch.cat([support_one_hot, query_weights], dim=1))
    return prototypes + inertia * (estimate - prototypes)


def settled(before: torch.Tensor, after: torch.Tensor, tol: float | None) -> torch.Tensor | None:
    """Per-task ``max |Δμ| <= tol`` (``None`` when early stopping is off, ``tol`` of ``None``)."""
    if tol is None:
        return None
    return (after - before).abs().amax(dim=(1, 2)) <= tol
