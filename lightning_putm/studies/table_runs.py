"""The run folders of a table (``python -m lightning_putm table``): read, checked and merged.

A run folder is what ``evaluate.py`` leaves: ``results.csv`` (mean, CI, tasks, seconds per setting),
``per_task.csv`` (each task's accuracy, classes, query counts and, with ``query_classes``, present classes: the
episode bank) and ``config.yaml`` (the feature source and the bank's seed, ways and queries). Each result's mean and
CI are recomputed from its per-task accuracies and must agree with ``results.csv``; runs are merged cell by cell,
where a cell is (source, shot, setting: K_eff and α), and two runs that share a cell must have evaluated it on the
same episode bank.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from lightning_putm.errors import DataError

#: Columns of ``results.csv``/``per_task.csv`` whose values name a setting (one block of the table), outer first.
#: ``query_classes`` (PADDLE's K_eff present classes) is read when a run has the column; an absent column or an
#: empty/``null``/``all`` value means every class is present.
SETTING_KEYS: tuple[str, ...] = ("query_classes", "alpha")
#: ``config.yaml`` keys that define an episode bank besides the source and the setting (compared between runs).
#: ``query_classes`` is not one: a run's config may list several (``[null, 5]``), and each row names its own in the
#: setting, so a run of ``query_classes=[null,5]`` and one of ``query_classes=5`` share their K_eff = 5 cells.
BANK_KEYS: tuple[str, ...] = ("seed", "ways", "queries")
#: Values of a setting key that mean "the default protocol" (the key is left out of the setting).
ABSENT = ("", "null", "none", "all")
#: Results and per-task files round to 4 and 6 decimals: a recomputed mean or CI further off (in points) is an error.
TOLERANCE = 2e-3


# --------------------------------------------------------------------------------------------- records
@dataclass(frozen=True, order=True)
class Setting:
    """The protocol of a block: ``(key, value)`` pairs of :data:`SETTING_KEYS` with a non-default value."""

    parts: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> Setting:
        parts = []
        for key in SETTING_KEYS:
            value = str(row.get(key) or "").strip()
            if value.lower() not in ABSENT:
                parts.append((key, value))
        return cls(tuple(parts))

    @property
    def label(self) -> str:
        """``Dirichlet α = 2``, ``balanced``, ``K_eff = 5, balanced``."""
        return ", ".join(SETTING_LABELS.get(key, lambda v, k=key: f"{k} = {v}")(value) for key, value in self.parts) \
            or "all settings"

    @property
    def code(self) -> str:
        """The machine-readable name a CSV gives it: ``alpha=2``, ``query_classes=5;alpha=balanced``."""
        return ";".join(f"{key}={value}" for key, value in self.parts)

    def sort_key(self) -> tuple:
        """Absent keys first, then numbers ascending, then words (``balanced`` after every α)."""
        given = dict(self.parts)
        key: list[tuple] = []
        for name in SETTING_KEYS:
            value = given.get(name)
            if value is None:
                key.append((0, 0.0, ""))
            else:
                try:
                    key.append((1, float(value), ""))
                except ValueError:
                    key.append((2, 0.0, value))
        return tuple(key)


SETTING_LABELS: dict[str, Callable[[str], str]] = {
    "alpha": lambda v: v if v in ("balanced", "uniform") else f"Dirichlet α = {v}",
    "query_classes": lambda v: f"K_eff = {v}",
}


@dataclass(frozen=True)
class RowKey:
    """A row of the table: a method, and whether it was given the true query counts (an unfair run, not ranked)."""

    method: str
    oracle_prior: bool = False

    @property
    def name(self) -> str:
        from lightning_putm.methods import method_display_name

        name = method_display_name(self.method)
        return f"{name} (oracle prior)" if self.oracle_prior else name


@dataclass(frozen=True)
class Column:
    source: str  # the label of what was evaluated (a checkpoint, a feature file, the demo)
    shots: int


@dataclass
class Result:
    """One method on one (source, shot, setting) episode bank of one run."""

    row: RowKey
    column: Column
    setting: Setting
    accuracy: float  # percent, as results.csv has it
    ci95: float
    tasks: int
    seconds: float
    per_task: tuple[float, ...]  # accuracies (fractions) in task order
    run: Path
    device: str = ""

    @property
    def seconds_per_1000(self) -> float:
        return 1000.0 * self.seconds / self.tasks if self.tasks else math.nan

    def describe(self) -> str:
        return f"{self.row.name} {self.column.shots}-shot {self.setting.code or 'setting'} on {self.column.source}"


@dataclass(frozen=True)
class Bank:
    """What makes two runs' tasks the same: the config's bank keys and every task's classes and query counts."""

    config: tuple[tuple[str, str], ...]
    tasks: tuple[tuple[str, str, str], ...]  # (class_ids, query_counts, present classes) per task, in task order


@dataclass
class Run:
    """A run folder read and checked: its source, its results and its banks."""

    folder: Path
    source: str  # identity of what was evaluated: two runs of one source label must share it (or be relabelled)
    label: str
    labelled: bool  # the label was given with --label
    results: list[Result] = field(default_factory=list)
    banks: dict[tuple[int, Setting], Bank] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- reading
def read_csv_rows(path: Path, required: Sequence[str], fix: str) -> list[dict[str, str]]:
    if not path.is_file():
        raise DataError(f"{path}: not found; {fix}")
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(f"{path}: missing column(s) {', '.join(missing)}; {fix}")
        return list(reader)


def read_config(folder: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    path = folder / "config.yaml"
    if not path.is_file():
        raise DataError(f"{path}: not found; give the output_dir of a finished evaluate.py run (it writes "
                        "results.csv, per_task.csv and config.yaml)")
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:  # a YAML syntax error or an unresolvable interpolation
        raise DataError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a mapping of keys to values")
    return config


def source_of(config: Mapping[str, Any]) -> tuple[str, str]:
    """``(identity, label)`` of what a run evaluated: ``checkpoint <path> on omniglot/test`` labelled
    ``omniglot conv4``, a timm model ``omniglot vit_small...``, a feature file by its stem, the demo as
    ``digits pixels``; a split other than test is named in the label."""
    data = config.get("data") if isinstance(config.get("data"), Mapping) else {}
    dataset = str(data.get("name", "data"))
    split = str(config.get("split") or "test")
    checkpoint = config.get("checkpoint")
    if checkpoint:
        text = str(checkpoint)
        model = text[len("timm:"):] if text.startswith("timm:") else str(data.get("backbone", "backbone"))
        return f"checkpoint {text} on {dataset}/{split}", f"{dataset} {model}" + ("" if split == "test" else f" ({split})")
    features = str(config.get("features") or "auto")
    if features in ("auto", "demo"):
        return "the built-in demo", "digits pixels"
    return f"features {features}", Path(features).stem


def _shots(path: Path, row: Mapping[str, str]) -> int:
    try:
        shots = int(str(row["shots"]).strip())
    except ValueError:
        raise DataError(f"{path}: shots {row['shots']!r} is not a whole number; the file is damaged") from None
    return shots


def _number(path: Path, row: Mapping[str, str], key: str) -> float:
    try:
        value = float(str(row[key]).strip())
    except (TypeError, ValueError):
        raise DataError(f"{path}: {key} {row.get(key)!r} is not a number; the file is damaged") from None
    if not math.isfinite(value):
        raise DataError(f"{path}: {key} {row[key]!r} is not finite; the file is damaged")
    return value


def _oracle(row: Mapping[str, str]) -> bool:
    return str(row.get("oracle_prior", "false")).strip().lower() in ("true", "1", "yes")


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and ``1.96·sd/√T`` (sample sd; 0 for one task), as :func:`lightning_putm.metrics.mean_and_ci95`."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(variance / n)


def read_run(folder: Path, label: str | None = None) -> Run:
    """A run folder's results with their per-task accuracies and banks, each recomputed mean and CI checked."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder; give the output_dir of a finished evaluate.py run")
    fix = "give the output_dir of a finished evaluate.py run"
    config = read_config(folder)
    source, derived = source_of(config)
    run = Run(folder, source, label or derived, label is not None)
    results_path, per_task_path = folder / "results.csv", folder / "per_task.csv"
    summaries = read_csv_rows(results_path, ["method", "shots", "alpha", "accuracy", "ci95"], fix)
    per_task_rows = read_csv_rows(
        per_task_path, ["method", "shots", "alpha", "task", "accuracy", "query_counts", "class_ids"],
        "the table needs per-task accuracies for its paired tests; re-run evaluate.py with the same output_dir "
        "(finished settings are read back, not recomputed)")
    tasks: dict[tuple[RowKey, int, Setting], dict[int, dict[str, str]]] = {}
    for row in per_task_rows:
        key = (RowKey(row["method"], _oracle(row)), _shots(per_task_path, row), Setting.of(row))
        index = int(_number(per_task_path, row, "task"))
        if index in tasks.setdefault(key, {}):
            raise DataError(f"{per_task_path}: task {index} of {row['method']} {key[1]}-shot {key[2].code} appears "
                            "twice; the file is damaged")
        tasks[key][index] = row
    bank_config = tuple((k, str(config.get(k))) for k in BANK_KEYS if config.get(k) is not None)
    for row in summaries:
        key = (RowKey(row["method"], _oracle(row)), _shots(results_path, row), Setting.of(row))
        result = Result(row=key[0], column=Column(run.label, key[1]), setting=key[2],
                        accuracy=_number(results_path, row, "accuracy"), ci95=_number(results_path, row, "ci95"),
                        tasks=0, seconds=_number(results_path, row, "seconds") if row.get("seconds") else 0.0,
                        per_task=(), run=folder, device=str(row.get("device") or ""))
        found = tasks.pop(key, None)
        if not found:
            raise DataError(f"{per_task_path}: no rows of {result.describe()} (results.csv has it); the files are "
                            "out of step: re-run evaluate.py with the same output_dir")
        if sorted(found) != list(range(len(found))):
            raise DataError(f"{per_task_path}: the tasks of {result.describe()} are not 0..{len(found) - 1}; the "
                            "file is damaged")
        ordered = [found[t] for t in range(len(found))]
        result.per_task = tuple(_number(per_task_path, r, "accuracy") for r in ordered)
        result.tasks = len(ordered)
        stated = int(_number(results_path, row, "tasks")) if row.get("tasks") else result.tasks
        mean, ci = mean_ci95(result.per_task)
        if stated != result.tasks or abs(100 * mean - result.accuracy) > TOLERANCE \
                or abs(100 * ci - result.ci95) > TOLERANCE:
            raise DataError(f"{folder}: results.csv gives {result.describe()} as {result.accuracy:.4f} ± "
                            f"{result.ci95:.4f} over {stated} tasks, per_task.csv {100 * mean:.4f} ± {100 * ci:.4f} "
                            f"over {result.tasks}; the files are out of step: re-run evaluate.py with the same "
                            "output_dir")
        bank = Bank(bank_config, tuple((r["class_ids"], r["query_counts"], _present(r)) for r in ordered))
        run.banks.setdefault((key[1], key[2]), bank)
        run.results.append(result)
    if tasks:
        (row, shots, setting), _ = next(iter(tasks.items()))
        raise DataError(f"{per_task_path}: {row.name} {shots}-shot {setting.code} has per-task rows but no line in "
                        "results.csv; the files are out of step: re-run evaluate.py with the same output_dir")
    if not run.results:
        raise DataError(f"{results_path}: no results; give the output_dir of a finished evaluate.py run")
    return run


def _present(row: Mapping[str, str]) -> str:
    """A task's classes present in its query set (``present_classes``, written with ``query_classes``); a file
    without the column is the default protocol, where every class of the task is present."""
    return row.get("present_classes") or row["class_ids"]


# --------------------------------------------------------------------------------------------- merging
def bank_difference(first: Bank, second: Bank) -> str | None:
    """How two banks differ, in words (``seed 0 vs 1``, ``200 vs 100 tasks``), or ``None`` when they are equal."""
    a, b = dict(first.config), dict(second.config)
    for key in BANK_KEYS:  # a key one config leaves unset (null) is judged by the tasks themselves below
        if key in a and key in b and a[key] != b[key]:
            return f"{key} {a[key]} vs {b[key]}"
    if len(first.tasks) != len(second.tasks):
        return f"{len(first.tasks)} vs {len(second.tasks)} tasks"
    for t, (mine, theirs) in enumerate(zip(first.tasks, second.tasks)):
        if mine[0] != theirs[0]:
            return f"task {t} has classes {mine[0]} vs {theirs[0]}"
        if mine[1] != theirs[1]:
            return f"task {t} has query counts {mine[1]} vs {theirs[1]}"
        if mine[2] != theirs[2]:
            return f"task {t} has present classes {mine[2]} vs {theirs[2]}"
    return None


@dataclass
class Table:
    """Merged results: columns in order, settings in order, and the result of each (setting, column, row)."""

    columns: list[Column]
    settings: list[Setting]
    rows: list[RowKey]
    results: dict[tuple[Setting, Column, RowKey], Result]
    notes: list[str] = field(default_factory=list)


def method_order(rows: Iterable[RowKey]) -> list[RowKey]:
    """The project's method order (unknown methods after, in name order), each oracle-prior row after its method."""
    from lightning_putm.methods import method_order as registered

    order = registered()

    def key(row: RowKey) -> tuple:
        known = row.method in order
        return (0 if known else 1, order.index(row.method) if known else 0, row.method, row.oracle_prior)

    return sorted(set(rows), key=key)


def merge(runs: Sequence[Run]) -> Table:
    """One table of ``runs``; raises :class:`DataError` on banks that differ for a shared cell, and on a result
    given twice with different numbers."""
    sources: dict[str, Run] = {}
    notes: list[str] = []
    for run in runs:
        first = sources.setdefault(run.label, run)
        if first.source != run.source:
            if not (first.labelled and run.labelled):
                raise DataError(f"runs {first.folder} and {run.folder} are both labelled {run.label!r} but evaluated "
                                f"different sources ({first.source} vs {run.source}); give each its own name with "
                                f"--label {run.folder}=NAME (the same name for both merges them)")
            notes.append(f"runs {first.folder} and {run.folder} evaluated different sources ({first.source} vs "
                         f"{run.source}) and are merged under {run.label!r} as --label asked")
    banks: dict[tuple[str, int, Setting], tuple[Run, Bank]] = {}
    results: dict[tuple[Setting, Column, RowKey], Result] = {}
    for run in runs:
        for (shots, setting), bank in run.banks.items():
            seen = banks.setdefault((run.label, shots, setting), (run, bank))
            difference = bank_difference(seen[1], bank)
            if difference is not None:
                raise DataError(f"runs {seen[0].folder} and {run.folder} evaluated {shots}-shot "
                                f"{setting.code or 'tasks'} on {run.label} on different episode banks: {difference}; "
                                "a table compares methods on the same tasks: re-run one of them with the other's "
                                "settings")
        for result in run.results:
            key = (result.setting, result.column, result.row)
            other = results.setdefault(key, result)
            if other is not result and (other.per_task != result.per_task or other.accuracy != result.accuracy):
                raise DataError(f"{result.describe()} appears in runs {other.run} and {run.folder} with different "
                                f"results ({other.accuracy:.2f} ± {other.ci95:.2f} vs {result.accuracy:.2f} ± "
                                f"{result.ci95:.2f}); give only one of them")
    order = {label: i for i, label in enumerate(dict.fromkeys(run.label for run in runs))}  # as given
    columns = sorted({Column(run.label, shots) for run in runs for shots, _ in run.banks},
                     key=lambda c: (order[c.source], c.shots))
    settings = sorted({key[0] for key in results}, key=Setting.sort_key)
    return Table(columns, settings, method_order(key[2] for key in results), results, notes)


def make_table(folders: Sequence[Path], labels: Mapping[Path, str] | None = None) -> Table:
    """Read and merge run folders (``labels``: resolved folder → column-group name)."""
    labels = labels or {}
    return merge([read_run(folder, labels.get(Path(folder).resolve())) for folder in folders])
