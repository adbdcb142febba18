"""Paired significance over shared tasks: the paired t-test and Holm's step-down correction.

Why a paired t-test (docs/tables.md): every method of a column solved the same tasks, so the per-task differences
remove the tasks' own difficulty, by far the largest source of spread; the t-test tests their mean, the number the
table prints, and with the usual 100–1000 tasks the mean difference is close to normal although each task's
accuracy is bounded and discrete. The t distribution's tail is scipy's (installed with scikit-learn).
"""

from __future__ import annotations

import math
from typing import Sequence


def paired_t_pvalue(first: Sequence[float], second: Sequence[float]) -> float:
    """Two-sided p-value of the paired t-test of ``mean(first − second) = 0`` over the same tasks (scipy's t CDF).

    Every difference zero gives 1 (a tie); a constant non-zero difference gives 0 (no spread: the gap is the same on
    every task); fewer than two tasks give 1 (nothing can be rejected)."""
    from scipy import stats

    if len(first) != len(second):
        raise ValueError(f"a paired test needs the same tasks, got {len(first)} and {len(second)}")
    diffs = [a - b for a, b in zip(first, second)]
    n = len(diffs)
    if n < 2:
        return 1.0
    mean = math.fsum(diffs) / n
    variance = math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)
    if variance == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    t = mean / math.sqrt(variance / n)
    return float(min(1.0, 2.0 * stats.t.sf(abs(t), n - 1)))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest (from 0) times ``m − i``, made
    non-decreasing and capped at 1; a hypothesis is rejected at level ``a`` when its adjusted p-value is ≤ ``a``."""
    m = len(pvalues)
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: pvalues[j])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted
