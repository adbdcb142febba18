"""Plain tensors in, a :class:`~lightning_putm.tasks.TaskBatch` out: what ``method(support, support_labels, query)``
checks before it solves anything (:meth:`~lightning_putm.methods.base.FewShotMethod.__call__`).

One task is ``support [S, d]``, ``support_labels [S]``, ``query [Q, d]``; a batch of ``T`` tasks adds a leading
``T`` to each. Features are float32 (as evaluate.py's feature files; PUTM computes in float32 only); labels are
integers ``0..N-1`` with every class in every task's support, so that column ``k`` of the output is label ``k``
(no silent remapping that would reorder the columns). ``N`` is the largest label plus one. Each task gets one integer seed (PUTM draws its navigator from it); the default is the task's index in the
call, so the same call gives the same result, and evaluate.py's results are reproduced by passing its bank's seeds.

Every mistake is one line naming the argument and what it must be, raised before any work: a
:class:`~lightning_putm.errors.FeatureError` for the feature tensors, a :class:`~lightning_putm.errors.DataError` for
the labels, a :class:`~lightning_putm.errors.ConfigError` for ``task_seeds``.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_putm.errors import ConfigError, DataError, FeatureError
from lightning_putm.tasks import TaskBatch

#: The dtype the methods compute in (evaluate.py's feature files hold float32).
FEATURE_DTYPE = torch.float32


def _shape(tensor: torch.Tensor | torch.Size) -> str:
    """``[4, 15, 32]``: a shape as the messages print it."""
    shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor
    return "[" + ", ".join(str(size) for size in shape) + "]"


def _features(name: str, value: Any, one: str, many: str) -> torch.Tensor:
    """``value`` checked as a float32 feature tensor of rank 2 (one task) or 3 (a batch)."""
    if not isinstance(value, torch.Tensor):
        raise FeatureError(f"{name} must be a torch.Tensor of features {one} (one task) or {many} (a batch of tasks), "
                           f"got {type(value).__name__}; convert with torch.as_tensor({name}, dtype=torch.float32)")
    if value.dim() not in (2, 3):
        raise FeatureError(f"{name} must be {one} (one task) or {many} (a batch of tasks), got shape {_shape(value)}")
    if value.dtype != FEATURE_DTYPE:
        raise FeatureError(f"{name} must hold float32 features, got {value.dtype}; convert with {name}.float()")
    return value


def _labels(value: Any, support: torch.Tensor) -> torch.Tensor:
    """``support_labels`` checked: integers shaped like ``support`` without its feature axis, on its device."""
    expected = _shape(support.shape[:-1])
    if not isinstance(value, torch.Tensor):
        raise DataError(f"support_labels must be a torch.Tensor of integer labels {expected}, got "
                        f"{type(value).__name__}; convert with torch.as_tensor(support_labels)")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise DataError(f"support_labels must hold integer class labels 0..N-1, got {value.dtype}; convert with "
                        "support_labels.long()")
    if tuple(value.shape) != tuple(support.shape[:-1]):
        raise DataError(f"support_labels must be {expected} (one label per support row), got shape {_shape(value)}")
    if value.device != support.device:
        raise DataError(f"support_labels is on {value.device} but support is on {support.device}; put the tensors on "
                        "one device")
    return value.long()


def _check_classes(labels: torch.Tensor) -> int:
    """``N``: the labels are ``0..N-1`` (``N >= 2``) with every class in every task's support."""
    low, high = int(labels.min()), int(labels.max())
    if low < 0:
        raise DataError(f"support_labels must be class labels 0..N-1, got {low}; map your classes to 0..N-1 (e.g. "
                        "torch.unique(labels, return_inverse=True)[1])")
    ways = high + 1
    if ways < 2:
        raise DataError("support_labels hold a single class (0); a few-shot task needs at least 2 classes")
    counts = torch.nn.functional.one_hot(labels, ways).sum(1)  # [T, N]
    missing = (counts == 0).nonzero()
    if len(missing):
        task, label = (int(v) for v in missing[0])
        where = f"task {task}'s support" if labels.shape[0] > 1 else "the support"
        raise DataError(f"support_labels must use every class 0..{ways - 1} (N = largest label + 1 = {ways}), but "
                        f"{where} has no row of class {label}; map your classes to 0..N-1 (e.g. "
                        "torch.unique(labels, return_inverse=True)[1])")
    return ways


def _seeds(value: Any, tasks: int, single: bool) -> torch.Tensor:
    """``[T]`` int64 seeds on the CPU; ``None`` = the task indices ``0..T-1``."""
    if value is None:
        return torch.arange(tasks, dtype=torch.int64)
    wanted = "an integer or a [1] tensor (one task)" if single else f"[T={tasks}] integers (one per task)"
    if isinstance(value, bool):
        raise ConfigError(f"task_seeds must be {wanted}, got {value!r}")
    try:
        seeds = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"task_seeds must be {wanted}, got {type(value).__name__}") from None
    if seeds.dtype == torch.bool or seeds.is_floating_point() or seeds.is_complex():
        raise ConfigError(f"task_seeds must be {wanted}, got {seeds.dtype} values")
    seeds = seeds.reshape(1) if single and seeds.dim() == 0 else seeds
    if tuple(seeds.shape) != (tasks,):
        raise ConfigError(f"task_seeds must be {wanted}, got shape {_shape(seeds)}")
    return seeds.to("cpu", torch.int64)


def tasks_from_tensors(support: Any, support_labels: Any, query: Any,
                       task_seeds: Any = None) -> tuple[TaskBatch, bool]:
    """The checked :class:`TaskBatch` of plain tensors, and whether they were one task (rank-2 features, so the
    caller returns ``[Q, N]`` rather than ``[1, Q, N]``)."""
    support = _features("support", support, "[S, d]", "[T, S, d]")
    single = support.dim() == 2
    one, many = "[Q, d]", "[T, Q, d]"
    query = _features("query", query, one, many)
    d = support.shape[-1]
    if query.dim() != support.dim():
        raise FeatureError(f"query must be {one if single else many} like support {_shape(support)} (one task and a "
                           f"batch cannot be mixed), got shape {_shape(query)}")
    if query.shape[-1] != d or (not single and query.shape[0] != support.shape[0]):
        expected = f"[Q, d={d}]" if single else f"[T={support.shape[0]}, Q, d={d}]"
        raise FeatureError(f"query must be {expected} to match support {_shape(support)}, got shape {_shape(query)}")
    if query.device != support.device:
        raise FeatureError(f"query is on {query.device} but support is on {support.device}; put the tensors on one "
                           "device (the methods compute on the inputs' device)")
    if support.shape[-2] == 0 or query.shape[-2] == 0 or d == 0 or (not single and support.shape[0] == 0):
        raise FeatureError(f"support {_shape(support)} and query {_shape(query)} must not be empty")
    labels = _labels(support_labels, support)
    if single:
        support, labels, query = support.unsqueeze(0), labels.unsqueeze(0), query.unsqueeze(0)
    ways = _check_classes(labels)
    seeds = _seeds(task_seeds, support.shape[0], single)
    return TaskBatch(support, labels, query, ways, seeds), single


def support_shots(tasks: TaskBatch) -> tuple[int, int]:
    """The fewest and the most support rows of a class over all tasks (equal: ``K`` shots everywhere)."""
    counts = tasks.one_hot_support().sum(1)
    return int(counts.min()), int(counts.max())


__all__ = ["FEATURE_DTYPE", "support_shots", "tasks_from_tensors"]
