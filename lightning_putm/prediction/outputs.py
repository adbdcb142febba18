"""A predicted task written out: the per-image CSV, the per-class counts CSV (with 95% intervals) and the console
table."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from lightning_putm.atomic import atomic_write_csv
from lightning_putm.methods.calibration import soft_counts
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.prediction.images import PredictionImages
from lightning_putm.tasks import TaskBatch


def predict_task(method: FewShotMethod, support: torch.Tensor, support_labels: torch.Tensor, query: torch.Tensor,
                 ways: int, seed: int = 0) -> torch.Tensor:
    """Query probabilities ``[Q, N]`` of one task (support ``[S, d]`` with labels in ``0..N-1``, query ``[Q, d]``).

    Methods take support rows with any number per class: prototypes are one-hot-weighted class means
    (:func:`~lightning_putm.tasks.weighted_class_means`), so unequal shots need no special case.
    """
    tasks = TaskBatch(support.unsqueeze(0), support_labels.unsqueeze(0).long(), query.unsqueeze(0), int(ways),
                      torch.tensor([int(seed)], dtype=torch.long))
    return method.predict(tasks)[0].detach().float().cpu()


def write_csv_atomic(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    """A CSV file (``\\n`` line ends, UTF-8) written atomically: never half-written."""
    return atomic_write_csv(path, header, rows, lineterminator="\n")


def probability_columns(class_names: Sequence[str]) -> list[str]:
    return [f"prob_{name}" for name in class_names]


def write_predictions(path: Path, images: PredictionImages, probabilities: torch.Tensor,
                      predicted: torch.Tensor) -> Path:
    """``file, predicted_class, probability, prob_<class>…``: one row per query, in file order.

    ``predicted`` is the method's own decision (the argmax of its raw probabilities): calibration must never change
    a prediction, even where a large temperature rounds two probabilities to the same float.
    """
    best = probabilities.gather(1, predicted.long().view(-1, 1)).squeeze(1)
    rows = [[name, images.class_names[int(k)], f"{float(p):.6f}", *(f"{float(v):.6f}" for v in row)]
            for name, k, p, row in zip(images.query_names(), predicted, best, probabilities)]
    header = ["file", "predicted_class", "probability", *probability_columns(images.class_names)]
    return write_csv_atomic(path, header, rows)


COUNT_HEADER = ["class", "support_images", "estimated_queries", "estimated_low", "estimated_high", "predicted_queries"]


def count_rows(images: PredictionImages, probabilities: torch.Tensor, predicted: torch.Tensor) -> list[list[Any]]:
    """Per class: support images, estimated queries (probability sums) with their 95% interval, and queries
    predicted (argmax counts)."""
    counts = soft_counts(probabilities)
    argmax_counts = torch.bincount(predicted.long(), minlength=images.ways)
    return [[name, shots, f"{float(e):.3f}", f"{float(lo):.3f}", f"{float(hi):.3f}", int(p)]
            for name, shots, e, lo, hi, p in zip(images.class_names, images.shots(), counts.estimate, counts.low,
                                                   counts.high, argmax_counts)]


def write_counts(path: Path, images: PredictionImages, probabilities: torch.Tensor, predicted: torch.Tensor) -> Path:
    return write_csv_atomic(path, COUNT_HEADER, count_rows(images, probabilities, predicted))


def summary_table(images: PredictionImages, probabilities: torch.Tensor, predicted: torch.Tensor) -> str:
    """The counts as an aligned text table (for the console); the interval as one ``low–high`` column."""
    header = ["class", "support_images", "estimated_queries", "95% interval", "predicted_queries"]
    rows = [[str(r[0]), str(r[1]), r[2], f"{r[3]}–{r[4]}", str(r[5])]
            for r in count_rows(images, probabilities, predicted)]
    table = [header] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in table]
    return "\n".join(lines)
