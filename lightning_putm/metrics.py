"""Accuracy metrics of few-shot evaluation: per-task accuracy, mean and 95% CI."""

from __future__ import annotations

import math

import torch


def task_accuracy(probabilities: torch.Tensor, query_labels: torch.Tensor) -> torch.Tensor:
    """Fraction of correctly classified queries per task: ``[T, Q, N]``, ``[T, Q]`` → ``[T]``."""
    return (probabilities.argmax(dim=2) == query_labels).double().mean(dim=1)


def mean_and_ci95(accuracies: torch.Tensor) -> tuple[float, float]:
    """Mean and 95% confidence half-width ``1.96·std/√T`` (0 for a single task)."""
    values = accuracies.double().flatten()
    if values.numel() == 0:
        raise ValueError("no task accuracies to summarise")
    mean = float(values.mean())
    if values.numel() < 2:
        return mean, 0.0
    return mean, float(1.96 * values.std(unbiased=True) / math.sqrt(values.numel()))
