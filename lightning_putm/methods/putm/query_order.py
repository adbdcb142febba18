"""A canonical order of a task's queries, so that PUTM is exactly permutation-equivariant.

The QR basis (Gram-Schmidt over support then query rows) depends on the order in which queries are listed,
and the navigator is not rotation-invariant, so without a canonical order a task's predictions would change
when its queries are shuffled (the reference code github.com/RashLog/PUTM uses the order it is given).
Sorting the queries first, and un-sorting the predictions after, makes the result independent of the order.
"""

from __future__ import annotations

import torch

from lightning_putm.tasks import TaskBatch

ORDER_SEED = 0x5EED


def canonical_query_order(query: torch.Tensor) -> torch.Tensor:
    """Per-task permutation ``[T, Q]`` sorting queries by a fixed random projection of their features."""
    generator = torch.Generator().manual_seed(ORDER_SEED)
    direction = torch.randn(query.shape[2], generator=generator).to(query.device, query.dtype)
    return torch.sort(query @ direction, dim=1, stable=True).indices


def sort_queries(tasks: TaskBatch, order: torch.Tensor) -> TaskBatch:
    """The tasks with query ``order[t, i]`` listed as row ``i``."""
    query = tasks.query.gather(1, order.unsqueeze(2).expand_as(tasks.query))
    return TaskBatch(tasks.support, tasks.support_labels, query, tasks.ways, tasks.task_seeds)


def unsort_rows(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Per-query values ``[T, Q, ...]`` computed in ``order`` put back in the input order."""
    return torch.empty_like(values).scatter_(1, order.unsqueeze(2).expand_as(values), values)
