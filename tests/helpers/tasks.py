"""Synthetic few-shot tasks for method tests: one Gaussian cluster per class, any per-task query counts."""

from __future__ import annotations

import torch

from lightning_putm.tasks import TaskBatch


def clustered_tasks(counts: list[list[int]], shots: int = 1, dim: int = 32, spread: float = 0.3, scale: float = 2.0,
                    seed: int = 0, non_negative: bool = True, class_major: bool = False,
                    task_seeds: torch.Tensor | None = None) -> tuple[TaskBatch, torch.Tensor]:
    """``(tasks, query labels)``: ``counts[t][k]`` queries of class k in task t, centres uniform in ``[0, scale)``.

    Support rows are shot-major (``0 1 2 … 0 1 2``) or, with ``class_major``, class-major (``0 0 1 1 …``);
    ``non_negative`` clamps features at 0 (post-ReLU-like); ``task_seeds`` default to ``0 … T−1``.
    """
    g = torch.Generator().manual_seed(seed)
    ways = len(counts[0])
    support_labels = torch.arange(ways).repeat_interleave(shots) if class_major else torch.arange(ways).repeat(shots)
    supports, queries, labels = [], [], []
    for task_counts in counts:
        centres = torch.rand(ways, dim, generator=g) * scale
        q_labels = torch.cat([torch.full((c,), k) for k, c in enumerate(task_counts)])
        q_labels = q_labels[torch.randperm(len(q_labels), generator=g)]
        support = centres[support_labels] + spread * torch.randn(len(support_labels), dim, generator=g)
        query = centres[q_labels] + spread * torch.randn(len(q_labels), dim, generator=g)
        supports.append(support.clamp_min(0) if non_negative else support)
        queries.append(query.clamp_min(0) if non_negative else query)
        labels.append(q_labels)
    t = len(counts)
    seeds = torch.arange(t) if task_seeds is None else task_seeds
    batch = TaskBatch(torch.stack(supports), support_labels.expand(t, -1).clone(), torch.stack(queries), ways, seeds)
    return batch, torch.stack(labels)
