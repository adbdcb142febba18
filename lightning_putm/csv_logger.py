"""The CSV logger of ``logger=csv``: Lightning's, except that a resumed run appends to its ``metrics.csv``.

Apart from :mod:`lightning_putm.loggers` so that the logger choice, which every job's settings check, imports no
Lightning (start-up, ``--help`` and config errors stay fast); :func:`~lightning_putm.loggers.build_logger` imports
this module when it builds a CSV logger.
"""

from __future__ import annotations

import csv

from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued, not deleted (a resumed run)."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.metrics_keys = next(csv.reader(handle), [])


class ResumableCSVLogger(CSVLogger):
    """A CSV logger whose fixed ``version`` folder a resumed run appends to (one log folder per run and stage)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment
