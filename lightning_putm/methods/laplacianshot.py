"""LaplacianShot (Ziko, Dolz, Granger & Ben Ayed, "Laplacian Regularized Few-Shot Learning", ICML 2020),
batched over tasks.

Features are CL2N-normalised (plain L2N without a base-class mean). Class prototypes ``m_k`` are the
support means (or BD-CSPN's rectified prototypes with ``proto_rect=true``). Soft assignments
``Y [Q, N]`` of the queries minimise

    E(Y) = Σ_j y_j·log y_j + Σ_j y_j·a_j − (λ/2)·Σ_{i,j} w_ij y_iᵀ y_j,      a_jk = ‖x_j − m_k‖²,

where ``W`` is the kNN affinity among the queries. Bound updates ``Y ← softmax(−a + λ·W·Y)`` minimise a
tight upper bound of E in closed form, starting from ``Y = softmax(−a)``, until E stops changing
(relative change ≤ ``tol`` after the third update, as in the reference code) or ``iterations`` is reached.

Choices, documented:

* ``knn`` counts the query itself, as in the reference code (scikit-learn's neighbours of a point include
  the point): each query links to its ``knn − 1`` nearest other queries, ``A_ij = 1``. The Laplacian term of
  the paper only sees the symmetric part of A, so ``W = (A + Aᵀ)/2``; the reference multiplies by A itself.
  With the symmetric W each update minimises the bound ``E(Y_i) + ⟨∇E_pair(Y_i), Y − Y_i⟩`` exactly, and
  ``E(Y_i) − E(Y_{i+1}) = Σ_j KL(y_j^i ‖ y_j^{i+1}) + (λ/2)·tr(ΔᵀWΔ)``: the energy cannot increase when W is
  PSD, and Pinsker's inequality extends that to ``λ·|λ_min(W)| ≤ 2``. A kNN affinity has zero diagonal, so
  it is never PSD (``λ_min`` is about −2.5 for knn = 3), but the KL term is far larger than this worst case
  unless assignments are near uniform; the energy is tracked (``last_state["energy"]``) and tests check it
  never rises at the default λ.
* The bound updates and the energy run in float64 (tiny ``[Q, N]`` and ``[Q, Q]`` tensors), so the
  relative stopping test at 1e-6 is not swamped by float32 rounding; probabilities return in the input dtype.
* λ (``lmd``) by setting, from the realistic benchmark's tuned values for WRN-28-10 miniImageNet features:
  Dirichlet 1.0 at 1 shot / 0.7 otherwise; balanced 0.7 / 0.3.
* Converged tasks are frozen, so a task's result does not depend on the other tasks of its batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.bdcspn import rectify_prototypes
from lightning_putm.methods.preprocessing import cl2n, squared_distances
from lightning_putm.tasks import TaskBatch


def knn_affinity(x: torch.Tensor, knn: int) -> torch.Tensor:
    """Symmetric kNN affinity ``[T, Q, Q]``: ``(A + Aᵀ)/2`` with ``A_ij = 1`` for the ``knn − 1`` nearest others."""
    t, q, _ = x.shape
    k = max(0, min(knn - 1, q - 1))
    affinity = torch.zeros(t, q, q, device=x.device, dtype=x.dtype)
    if k == 0:
        return affinity
    distances = torch.cdist(x, x)
    distances.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    neighbours = distances.topk(k, dim=2, largest=False).indices
    affinity.scatter_(2, neighbours, 1.0)
    return 0.5 * (affinity + affinity.transpose(1, 2))


def laplacian_energy(y: torch.Tensor, unary: torch.Tensor, affinity: torch.Tensor, lmd: float) -> torch.Tensor:
    """Per-task energy ``Σ y log y + Σ y·a − (λ/2) Σ_ij w_ij y_iᵀy_j``."""
    entropy = (y * y.clamp_min(1e-20).log()).sum((1, 2))
    pairwise = (affinity.bmm(y) * y).sum((1, 2))
    return entropy + (unary * y).sum((1, 2)) - 0.5 * lmd * pairwise


class LaplacianShot(FewShotMethod):
    name = "laplacianshot"
    uses_base_mean = True

    def __init__(
        self,
        shots: int,
        balanced: bool,
        base_mean: torch.Tensor | None = None,
        knn: int = 3,
        lmd: float | None = None,
        lmd_dirichlet: Sequence[float] = (1.0, 0.7),
        lmd_balanced: Sequence[float] = (0.7, 0.3),
        iterations: int = 20,
        tol: float = 1e-6,
        proto_rect: bool = False,
        rect_temperature: float = 10.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if lmd is None:
            table = lmd_balanced if balanced else lmd_dirichlet
            if len(table) != 2:
                raise ConfigError("laplacianshot.lmd_dirichlet / lmd_balanced must be [1-shot value, more-shot value]")
            lmd = table[0] if shots == 1 else table[1]
        if float(lmd) < 0 or int(knn) < 1 or int(iterations) < 0 or tol < 0:
            raise ConfigError("laplacianshot: lmd and tol must be >= 0, knn >= 1, iterations >= 0")
        self.base_mean = base_mean
        self.knn = int(knn)
        self.lmd = float(lmd)
        self.iterations = int(iterations)
        self.tol = float(tol)
        self.proto_rect = bool(proto_rect)
        self.rect_temperature = float(rect_temperature)
        self.last_state: dict[str, torch.Tensor] = {}

    def bytes_per_task(self, tasks: TaskBatch) -> int:
        n, q = tasks.num_support + tasks.num_queries, tasks.num_queries
        return 4 * (3 * n * tasks.dim + 4 * q * q + q * tasks.ways * (tasks.dim + 16))

    def prototypes(self, tasks: TaskBatch, support: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        if not self.proto_rect:
            return tasks.support_means(support)
        shifted = query + (support.mean(1, keepdim=True) - query.mean(1, keepdim=True))
        return rectify_prototypes(support, tasks.one_hot_support(), shifted, self.rect_temperature)

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        support = cl2n(tasks.support, self.base_mean, self.name)
        query = cl2n(tasks.query, self.base_mean, self.name)
        unary = squared_distances(query, self.prototypes(tasks, support, query)).double()  # [T, Q, N]
        affinity = knn_affinity(query, self.knn).double()
        y = torch.softmax(-unary, dim=2)
        energy = laplacian_energy(y, unary, affinity, self.lmd)
        energies = [energy]
        active = torch.ones(tasks.num_tasks, dtype=torch.bool, device=y.device)
        for i in range(self.iterations):
            updated = torch.softmax(-unary + self.lmd * affinity.bmm(y), dim=2)
            y = torch.where(active.view(-1, 1, 1), updated, y)
            new_energy = torch.where(active, laplacian_energy(y, unary, affinity, self.lmd), energy)
            if i > 1:
                active = active & ((new_energy - energy).abs() > self.tol * energy.abs())
            energy = new_energy
            energies.append(energy)
            if not bool(active.any()):
                break
        self.last_state = {"energy": torch.stack(energies), "affinity": affinity, "unary": unary, "assignments": y}
        return y.to(tasks.query.dtype)
