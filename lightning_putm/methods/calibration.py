"""Probabilities a user can trust: one temperature per method, fitted on tasks from validation classes.

Transductive solvers are sure of themselves. PUTM's navigator, for one, gives its wrong predictions
probabilities of 0.9999 and more, because its EM loop sharpens the query assignments at every step. Temperature
scaling (Guo et al., "On calibration of modern neural networks", ICML 2017) fixes that with one number per method
and backbone: ``p ↦ softmax(log p / T)``. It keeps every query's predicted class (a monotone map of each row) and
is fitted by minimising the negative log-likelihood on labelled tasks drawn from classes that are not in the
task at hand (the validation split). Methods only return probabilities, so it works the same for all of them.

The expected number of queries of a class is the sum of its calibrated probabilities. Each query is a
Bernoulli draw with its own probability, so that sum has variance ``Σ p (1 − p)``, and
``Σ p ± 1.96·√(Σ p (1 − p))`` is a 95% interval for the count (the normal approximation to the
Poisson-binomial).

Tensor math only, like the methods themselves; drawing the validation tasks and fitting on them is
:mod:`lightning_putm.evaluation.calibration`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Probabilities below this count as this before the logarithm: several methods return exact zeros, and no
#: user reads anything into a probability of 1e-30 rather than 1e-12.
PROBABILITY_FLOOR = 1e-12
#: Bins of the expected calibration error and of the reliability diagram (equal widths over [0, 1]).
ECE_BINS = 15
#: Temperatures searched: ``log T`` in [−LOG_T_RANGE, LOG_T_RANGE] (T from about 1e-3 to 3e3).
LOG_T_RANGE = 8.0


def _log_probabilities(probabilities: torch.Tensor) -> torch.Tensor:
    return probabilities.double().clamp_min(PROBABILITY_FLOOR).log()


def scale_probabilities(probabilities: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(log p / T)`` over the last dimension, in the input's dtype (T = 1 returns ``p`` renormalised)."""
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    return torch.softmax(_log_probabilities(probabilities) / temperature, dim=-1).to(probabilities.dtype)


def negative_log_likelihood(probabilities: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean NLL of the true classes after scaling by ``temperature`` (``[..., N]`` and ``[...]``)."""
    logits = _log_probabilities(probabilities).reshape(-1, probabilities.shape[-1]) / temperature
    return float(torch.nn.functional.cross_entropy(logits, labels.reshape(-1).long().to(logits.device)))


def fit_temperature(probabilities: torch.Tensor, labels: torch.Tensor, iterations: int = 80) -> float:
    """The temperature that minimises the NLL of ``labels`` under ``probabilities`` (``[..., N]``, ``[...]``).

    The NLL is convex in 1/T (a log-sum-exp of logits linear in 1/T, minus a linear term), hence unimodal in
    ``log T``: a golden-section search over ``log T`` finds the minimum without a learning rate to tune.
    """
    if labels.numel() == 0:
        raise ValueError("no labelled queries to fit a temperature on")
    logits = _log_probabilities(probabilities).reshape(-1, probabilities.shape[-1])
    targets = labels.reshape(-1).long().to(logits.device)

    def loss(log_t: float) -> float:
        return float(torch.nn.functional.cross_entropy(logits * math.exp(-log_t), targets))

    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    low, high = -LOG_T_RANGE, LOG_T_RANGE
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    loss_a, loss_b = loss(a), loss(b)
    for _ in range(iterations):
        if loss_a <= loss_b:
            high, b, loss_b = b, a, loss_a
            a = high - ratio * (high - low)
            loss_a = loss(a)
        else:
            low, a, loss_a = a, b, loss_b
            b = low + ratio * (high - low)
            loss_b = loss(b)
    return math.exp((low + high) / 2.0)


def at_search_bound(temperature: float) -> bool:
    """Whether :func:`fit_temperature` ended at an end of its range: the NLL then has no minimum inside it, as when
    every labelled query is predicted correctly (sharper is always better: T → 0) or every one wrongly (T → ∞).
    Such tasks cannot say how sure the method should be."""
    return abs(math.log(temperature)) > LOG_T_RANGE - 1e-3


@dataclass(frozen=True)
class ReliabilityBin:
    """Queries whose top probability lies in ``(lower, upper]``: how many, their mean confidence and accuracy."""

    lower: float
    upper: float
    count: int
    confidence: float
    accuracy: float


def reliability_bins(probabilities: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> list[ReliabilityBin]:
    """The reliability diagram's bins: top probability against the fraction correct (empty bins included)."""
    confidence, predicted = probabilities.reshape(-1, probabilities.shape[-1]).double().max(dim=1)
    correct = (predicted == labels.reshape(-1).to(predicted.device)).double()
    edges = torch.linspace(0.0, 1.0, bins + 1, dtype=torch.float64)
    index = torch.bucketize(confidence.cpu(), edges[1:-1], right=False)  # (edges[i], edges[i+1]] → i
    result = []
    for i in range(bins):
        chosen = index == i
        count = int(chosen.sum())
        result.append(ReliabilityBin(float(edges[i]), float(edges[i + 1]), count,
                                     float(confidence.cpu()[chosen].mean()) if count else float("nan"),
                                     float(correct.cpu()[chosen].mean()) if count else float("nan")))
    return result


def expected_calibration_error(probabilities: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> float:
    """ECE (Naeini et al. 2015): the count-weighted mean gap between confidence and accuracy over the bins."""
    table = reliability_bins(probabilities, labels, bins)
    total = sum(b.count for b in table)
    return sum(b.count / total * abs(b.confidence - b.accuracy) for b in table if b.count)


@dataclass(frozen=True)
class SoftCounts:
    """Expected queries per class ``[N]`` (sum of probabilities) and the 95% interval's bounds, clipped to [0, Q]."""

    estimate: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor


def soft_counts(probabilities: torch.Tensor) -> SoftCounts:
    """Class counts of one task's ``[Q, N]`` probabilities: ``Σ p ± 1.96·√(Σ p (1 − p))`` per class."""
    p = probabilities.double()
    estimate = p.sum(dim=-2)
    half_width = 1.96 * (p * (1.0 - p)).sum(dim=-2).clamp_min(0.0).sqrt()
    queries = float(p.shape[-2])
    return SoftCounts(estimate, (estimate - half_width).clamp(0.0, queries),
                      (estimate + half_width).clamp(0.0, queries))
