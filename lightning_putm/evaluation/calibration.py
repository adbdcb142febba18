"""Fitting each method's probability temperature on labelled tasks from validation classes.

The calibration itself (temperature scaling, ECE, soft counts) is tensor math in
:mod:`lightning_putm.methods.calibration`; this module draws the labelled tasks from a feature set, runs a method
on them and fits the temperature, for ``evaluate.py predict`` and ``benchmarks/calibration.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from lightning_putm.data.episodes import TaskTensors, sample_episode_bank
from lightning_putm.errors import DataError
from lightning_putm.features.files import FeatureSet
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.calibration import (at_search_bound, expected_calibration_error, fit_temperature,
                                                scale_probabilities)
from lightning_putm.tasks import TaskBatch

#: Dirichlet concentration of the calibration tasks: the imbalanced protocol's default, since a user's query
#: proportions are unknown.
CALIBRATION_ALPHA = 2.0
#: Tasks solved per call of the method while fitting (a batch: much cheaper per task than one at a time).
CALIBRATION_CHUNK = 25


@dataclass(frozen=True)
class Calibration:
    """A fitted temperature and what it was fitted on (for the console and the cache)."""

    temperature: float
    tasks: int
    queries: int
    accuracy: float  # on the calibration tasks, %
    ece_before: float
    ece_after: float
    #: False when the fit ran to an end of its range (:func:`~lightning_putm.methods.calibration.at_search_bound`):
    #: the temperature is then no calibration, and the probabilities are better left as the method gives them.
    fitted: bool = True

    def describe(self) -> str:
        return (f"temperature {self.temperature:.4g} fitted on {self.tasks} validation tasks of {self.queries} "
                f"queries (accuracy {self.accuracy:.1f}%, ECE {self.ece_before:.3f} → {self.ece_after:.3f})")


def draw_calibration_tasks(feature_set: FeatureSet, ways: int, shots: int, queries: int, tasks: int, seed: int,
                           alpha: float = CALIBRATION_ALPHA) -> tuple[TaskTensors, int]:
    """Labelled tasks from ``feature_set`` shaped like the user's: ``ways`` classes, ``shots`` each, up to
    ``queries`` queries. Validation classes may hold fewer images than the user's query set needs, so the query
    count halves until tasks can be drawn (a class needs ``shots`` images plus its share of the queries)."""
    sizes = torch.bincount(feature_set.labels, minlength=len(feature_set.class_names))
    largest = int(sizes.max()) if sizes.numel() else 0
    count = max(1, min(queries, ways * max(1, largest - shots) // 2))
    while True:
        try:
            bank = sample_episode_bank(feature_set.labels, ways, shots, count, alpha, tasks, seed)
            return bank.gather(feature_set.features), count
        except DataError:
            if count <= ways:
                raise
            count = max(ways, count // 2)


def predict_in_chunks(method: FewShotMethod, batch: TaskBatch, chunk: int = CALIBRATION_CHUNK,
                      progress: bool = False, description: str = "calibration tasks",
                      log: Callable[[str], None] | None = None) -> torch.Tensor:
    """``method.predict`` over ``batch`` in chunks of ``chunk`` tasks, with a progress bar on a terminal. With
    ``progress`` and ``log``: after the first of several chunks, one line with the time all will take (at the
    first's pace), and where no bar is drawn a progress line every so often
    (:class:`~lightning_putm.evaluation.progress.ProgressLines`).

    Every task is solved on its own (the method interface's contract), so chunking never changes a result.
    """
    from lightning_putm.evaluation.progress import ProgressLines, format_duration, on_terminal  # (imports Lightning)

    said = progress and log is not None
    lines = ProgressLines(description, batch.num_tasks, log, unit="tasks") if said and not on_terminal() else None
    parts = []
    started = time.perf_counter()
    with tqdm(total=batch.num_tasks, desc=description, unit="task", disable=None if progress else True,
              leave=False) as bar:
        for start in range(0, batch.num_tasks, chunk):
            part = batch.slice(start, min(start + chunk, batch.num_tasks))
            parts.append(method.predict(part).detach().double().cpu())
            bar.update(part.num_tasks)
            if said and start == 0 and part.num_tasks < batch.num_tasks:
                took = time.perf_counter() - started
                log(f"{description}: the first {part.num_tasks} of {batch.num_tasks} in {format_duration(took)}: "
                    f"about {format_duration(took * batch.num_tasks / part.num_tasks)} in all")
            if lines is not None:
                lines.update(part.num_tasks)
    if lines is not None:
        lines.close()
    return torch.cat(parts)


def fit_calibration(method: FewShotMethod, feature_set: FeatureSet, ways: int, shots: int, queries: int,
                    tasks: int, seed: int, device: torch.device | str = "cpu", progress: bool = False,
                    log: Callable[[str], None] | None = None) -> Calibration:
    """Run ``method`` on ``tasks`` labelled validation tasks and fit its temperature on their queries (``progress``:
    a bar on a terminal, lines through ``log`` elsewhere)."""
    drawn, count = draw_calibration_tasks(feature_set, ways, shots, queries, tasks, seed)
    probabilities = predict_in_chunks(method, drawn.batch.to(device), progress=progress, log=log)
    labels = drawn.query_labels.cpu()
    temperature = fit_temperature(probabilities, labels)
    accuracy = 100.0 * float((probabilities.argmax(-1) == labels).double().mean())
    return Calibration(temperature, tasks, count, accuracy, expected_calibration_error(probabilities, labels),
                       expected_calibration_error(scale_probabilities(probabilities, temperature), labels),
                       fitted=not at_search_bound(temperature))
