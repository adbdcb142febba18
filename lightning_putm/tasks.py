"""The tensor hand-off between the episode bank and the methods.

A :class:`TaskBatch` holds what a transductive method may see of ``T`` tasks: support features and labels
and the unlabelled query features. Query labels and true query counts are deliberately absent (the protocol:
a method must never see them); the evaluation keeps them aside for scoring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TaskBatch:
    """``T`` few-shot tasks of the same shape, stacked on one device.

    support: ``[T, N*K, d]``; support_labels: ``[T, N*K]`` in ``0..N-1``; query: ``[T, Q, d]``;
    task_seeds: ``[T]`` one integer per task, so stochastic methods (PUTM's navigator initialisation)
    give a task the same result whether it is solved alone or inside any batch.
    """

    support: torch.Tensor
    support_labels: torch.Tensor
    query: torch.Tensor
    ways: int
    task_seeds: torch.Tensor

    def __post_init__(self) -> None:
        t, s, d = self.support.shape
        if self.query.dim() != 3 or self.query.shape[0] != t or self.query.shape[2] != d:
            raise ValueError(f"query must be [T={t}, Q, d={d}], got {tuple(self.query.shape)}")
        if tuple(self.support_labels.shape) != (t, s):
            raise ValueError(f"support_labels must be [T={t}, S={s}], got {tuple(self.support_labels.shape)}")
        if tuple(self.task_seeds.shape) != (t,):
            raise ValueError(f"task_seeds must be [T={t}], got {tuple(self.task_seeds.shape)}")

    @property
    def num_tasks(self) -> int:
        return int(self.support.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.query.shape[1])

    @property
    def num_support(self) -> int:
        return int(self.support.shape[1])

    @property
    def dim(self) -> int:
        return int(self.support.shape[2])

    @property
    def device(self) -> torch.device:
        return self.support.device

    def slice(self, start: int, stop: int) -> "TaskBatch":
        return TaskBatch(
            self.support[start:stop],
            self.support_labels[start:stop],
            self.query[start:stop],
            self.ways,
            self.task_seeds[start:stop],
        )

    def to(self, device: torch.device | str) -> "TaskBatch":
        return TaskBatch(
            self.support.to(device),
            self.support_labels.to(device),
            self.query.to(device),
            self.ways,
            self.task_seeds,
        )

    def one_hot_support(self) -> torch.Tensor:
        """``[T, N*K, N]`` float one-hot of the support labels."""
        return torch.nn.functional.one_hot(self.support_labels, self.ways).to(self.support.dtype)

    def support_means(self, features: torch.Tensor | None = None) -> torch.Tensor:
        """Class means ``[T, N, d]`` of the support rows (of ``features`` if given, same row order)."""
        return weighted_class_means(self.support if features is None else features, self.one_hot_support())


def weighted_class_means(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_i w_ik x_i / Σ_i w_ik`` for rows ``[T, n, d]`` and weights ``[T, n, N]`` → ``[T, N, d]``.

    Computed as ``(Xᵀ W)ᵀ``: on CPU this product gives bit-identical results for a task whatever the
    batch size, whereas ``Wᵀ X`` takes a batch-dependent BLAS path, and iterative solvers amplify that.
    """
    totals = rows.transpose(1, 2).bmm(weights).transpose(1, 2)  # [T, N, d]
    return totals / weights.sum(1).unsqueeze(2).clamp_min(torch.finfo(rows.dtype).tiny)
