"""Typed records of evaluation results: one :class:`Summary` per (method, shot, K_eff, α), and the run's provenance.

Tables, CSV files, W&B and figures all read these records, so nothing re-parses strings it wrote itself;
:meth:`Summary.from_row` reads a row of a saved ``results.csv`` (strings) back with the same checks.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_putm.validators import alpha_label, parse_alpha, query_classes_label

#: Columns of ``results.csv``: the result, then the provenance that changes numbers (precision, device, versions).
SUMMARY_COLUMNS = ["method", "shots", "alpha", "accuracy", "ci95", "tasks", "seconds", "oracle_prior"]
#: The column of K_eff (PADDLE's classes present in the query set), after ``shots``, only in the files of a run that
#: sets ``query_classes`` (``all`` on its rows of the default protocol): a default run's files are as before.
QUERY_CLASSES_COLUMN = "query_classes"
PROVENANCE_COLUMNS = ["precision", "device", "torch", "lightning", "threads"]
REQUIRED_KEYS = ("method", "shots", "alpha", "accuracy", "ci95")


@dataclass(frozen=True)
class Provenance:
    """What besides the config changes the numbers: device, library versions and CPU threads."""

    device: str
    torch: str
    lightning: str
    threads: int

    @classmethod
    def of(cls, device: torch.device) -> Provenance:
        import pytorch_lightning as pl

        return cls(device_name(device), str(torch.__version__), str(pl.__version__), torch.get_num_threads())

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "torch": self.torch, "lightning": self.lightning, "threads": self.threads}


def device_name(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu (<processor model>, N cores)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{device.type} ({model}, {os.cpu_count()} cores)"


def summary_columns(summaries: Sequence[Summary], provenance: bool = False) -> list[str]:
    """The columns of ``results.csv`` (and W&B's table) for these summaries: :data:`QUERY_CLASSES_COLUMN` after
    ``shots`` when one of them has a K_eff, the provenance columns last when asked."""
    columns = list(SUMMARY_COLUMNS)
    if uses_query_classes(summaries):
        columns.insert(columns.index("shots") + 1, QUERY_CLASSES_COLUMN)
    return columns + (PROVENANCE_COLUMNS if provenance else [])


def uses_query_classes(records: Sequence[Any]) -> bool:
    """Whether any of these results (summaries, setting results) was drawn with K_eff classes in the query set."""
    return any(getattr(record, "query_classes", None) is not None for record in records)


@dataclass(frozen=True)
class Summary:
    """Mean accuracy and 95% CI (percent) of one method on one (shot, K_eff, α) bank."""

    method: str
    shots: int
    alpha: float | str | None  # None = balanced, "uniform" = PADDLE's uniform draw
    accuracy: float
    ci95: float
    tasks: int = 0
    seconds: float = 0.0
    oracle_prior: bool = False  # the method received the true query counts (unfair; labelled everywhere)
    precision: str = ""  # the precision the method actually ran in (PUTM's ``auto`` resolved)
    query_classes: int | None = None  # K_eff classes present in each query set; None = all (the default protocol)

    @property
    def alpha_label(self) -> str:
        return alpha_label(self.alpha)

    @property
    def query_classes_label(self) -> str:
        return query_classes_label(self.query_classes)

    @property
    def label(self) -> str:
        """The method as tables and figures name it: oracle-prior results are marked."""
        return f"{self.method} (oracle prior)" if self.oracle_prior else self.method

    def csv_row(self, provenance: Provenance | None = None, query_classes: bool = False) -> dict[str, Any]:
        """The row of ``results.csv`` (numbers rounded as the file stores them); ``query_classes`` (or a K_eff of its
        own) adds :data:`QUERY_CLASSES_COLUMN`."""
        row = {"method": self.method, "shots": self.shots}
        if query_classes or self.query_classes is not None:
            row[QUERY_CLASSES_COLUMN] = self.query_classes_label
        row |= {"alpha": self.alpha_label, "accuracy": round(self.accuracy, 4), "ci95": round(self.ci95, 4),
                "tasks": self.tasks, "seconds": round(self.seconds, 3),
                "oracle_prior": "true" if self.oracle_prior else "false"}
        if provenance is not None:
            row.update(precision=self.precision, **provenance.as_dict())
        return row

    @classmethod
    def from_row(cls, row: Any, index: int = 0) -> Summary:
        """A summary from a mapping with at least ``method, shots, alpha, accuracy, ci95`` (values may be text)."""
        if not isinstance(row, Mapping):
            raise ValueError(f"row {index}: expected a mapping, got {type(row).__name__}")
        missing = [key for key in REQUIRED_KEYS if key not in row]
        if missing:
            raise ValueError(f"row {index} is missing key(s) {', '.join(missing)}; "
                             f"required: {', '.join(REQUIRED_KEYS)}; got: {', '.join(map(str, row))}")
        method = str(row["method"]).strip()
        if not method:
            raise ValueError(f"row {index}: `method` is empty")
        ci95 = _parse_float(index, "ci95", row["ci95"])
        if ci95 < 0:
            raise ValueError(f"row {index}: `ci95` must be non-negative, got {row['ci95']!r}")
        return cls(method=method, shots=_parse_shots(index, row["shots"]), alpha=_parse_alpha(index, row["alpha"]),
                   accuracy=_parse_float(index, "accuracy", row["accuracy"]), ci95=ci95,
                   tasks=int(_parse_float(index, "tasks", row.get("tasks", 0))),
                   seconds=_parse_float(index, "seconds", row.get("seconds", 0.0)),
                   oracle_prior=str(row.get("oracle_prior", "false")).strip().lower() in ("true", "1", "yes"),
                   precision=str(row.get("precision", "")),
                   query_classes=_parse_query_classes(index, row.get(QUERY_CLASSES_COLUMN)))


def as_summaries(rows: Any) -> list[Summary]:
    """Summaries as they are, or parsed from rows (e.g. ``csv.DictReader`` over ``results.csv``)."""
    if rows is None or len(rows) == 0:
        raise ValueError("no result rows to plot: expected summary dicts with keys " + ", ".join(REQUIRED_KEYS))
    return [row if isinstance(row, Summary) else Summary.from_row(row, i) for i, row in enumerate(rows)]


def _parse_float(row_index: int, key: str, value: Any) -> float:
    try:
        number = float(str(value).strip())
    except ValueError:
        raise ValueError(f"row {row_index}: `{key}` must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"row {row_index}: `{key}` must be finite, got {value!r}")
    return number


def _parse_shots(row_index: int, value: Any) -> int:
    number = _parse_float(row_index, "shots", value)
    if not number.is_integer() or number < 1:
        raise ValueError(f"row {row_index}: `shots` must be a positive integer, got {value!r}")
    return int(number)


def _parse_alpha(row_index: int, value: Any) -> float | str | None:
    """``None`` for the balanced setting, ``uniform``, else a positive Dirichlet concentration."""
    return parse_alpha(value, f"row {row_index}: `alpha`", uniform=True)


def _parse_query_classes(row_index: int, value: Any) -> int | None:
    """K_eff of a row: ``None`` when the column is absent or says ``all`` (or is empty), else a positive integer."""
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", "all", "null", "none"):
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"row {row_index}: `{QUERY_CLASSES_COLUMN}` must be a positive integer or `all`, "
                         f"got {value!r}")
    return int(text)
