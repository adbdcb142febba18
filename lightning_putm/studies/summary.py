"""One summary of a study (a sweep run by :mod:`lightning_putm.jobs.study`): a table and a figure, with intervals.

At 10 tasks per setting a ±5–9 point zig-zag between sweep points is noise, so every number of the summary comes
with its 95% confidence interval and next to SimpleShot (nearest class mean, the baseline every transductive
method has to beat), whenever the runs evaluated it:

``summary.csv``
    one row per finished point: its swept values, the metric, ``<metric>_ci95``, how that CI was obtained,
    SimpleShot's value of the same metric with its CI, the tasks per setting, every setting's accuracy ± CI and
    the run folder;
``summary.md``
    the same table with a column per other method that ran (its value of the same metric, or its mean accuracy
    when the metric is a margin), sorted by the metric (best first) when only hyper-parameters are swept, in the
    sweep's order when a test condition is (:data:`TEST_CONDITIONS`: α, shots, ...), with notes on how the CIs
    are combined and on the baseline (or a note that SimpleShot was not evaluated and how to add it);
``summary.pdf``/``summary.png``
    the metric against each swept parameter (axes named in words: "Dirichlet α") with 95% CI error bars,
    every other method that ran, SimpleShot as a dashed line with its CI band, the best run starred (the best
    hyper-parameters by their mean over the swept test conditions; nothing when only test conditions are swept:
    there is no best α); the legend lists exactly what is drawn.

How the 95% CI of a point's metric is obtained (half-widths in accuracy points, as in ``results.csv``):

* one setting (``fewshot/<m>/<k>shot/alpha_<a>/acc``): that setting's CI, ``1.96·sd/√T`` over its T tasks;
* the mean over the run's settings (``fewshot/<m>/acc``): from the run's ``per_task.csv``, the per-task mean over
  the settings, then ``1.96·sd/√T`` of those T means. Every setting's episode bank is drawn from the same seed,
  so the settings' tasks are paired by index and correlated; averaging per task first accounts for that. Without
  ``per_task.csv`` (or with unequal task counts) it falls back to the mean of the settings' CIs, an upper bound
  whatever the correlation (``sd(ΣX/n) ≤ Σsd(X)/n``);
* a worst margin (``fewshot/<m>/worst_gain_over_<o>``): the paired per-task difference of the two methods at the
  setting where the margin is smallest (the CI of that setting's margin; choosing the minimum is not accounted
  for); without ``per_task.csv``, the sum of the two methods' CIs there (again an upper bound).

In the figure, a swept value shared by several points (other parameters swept too) shows the mean of their metrics
with the mean of their CIs: an upper bound, since the points share their tasks (same seed) and are correlated.
"""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence


#: The baseline drawn next to every study's metric when the runs evaluated it.
BASELINE = "simpleshot"
BASELINE_NAME = "SimpleShot"
#: ``summary.csv`` columns of SimpleShot's value of the study's metric and its CI.
BASELINE_COLUMN = f"{BASELINE}_baseline"
Z95 = 1.96
#: Swept keys that set the test conditions, in words: a study over them measures, it does not choose (no "best α").
TEST_CONDITIONS = {"alphas": "Dirichlet α", "shots": "shots per class", "ways": "ways (classes per task)",
                   "queries": "queries per task", "tasks": "tasks per setting", "seed": "seed of the tasks",
                   "split": "split"}


def is_test_condition(key: str) -> bool:
    return key in TEST_CONDITIONS


def parameter_label(key: str) -> str:
    """A swept key in words, for axes and notes: ``Dirichlet α``, ``PUTM rho`` (``method.putm.rho``)."""
    if key in TEST_CONDITIONS:
        return TEST_CONDITIONS[key]
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "method":
        from lightning_putm.methods import method_display_name

        return f"{method_display_name(parts[1])} {parts[2]}"
    return key


@dataclass(frozen=True)
class Interval:
    """A point's value of a metric with its 95% CI half-width (``None``: the run's records cannot give one)."""

    value: float
    ci95: float | None
    how: str  # how the CI was obtained, in words (a CSV column and the summary's note)
    tasks: int | None = None  # tasks per setting behind it
    setting: str = ""  # for a worst margin: the setting it was taken at

    @property
    def described(self) -> str:
        """``how`` with the setting, as the CSV records it."""
        return f"{self.how} ({self.setting})" if self.setting else self.how


@dataclass
class StudyRow:
    """One finished point of a study."""

    point: dict[str, Any]
    metric: float
    key: str
    output_dir: str = ""
    settings: list[dict[str, Any]] = field(default_factory=list)  # {method, shots, alpha, accuracy, ci95}
    interval: Interval | None = None  # the metric with its 95% CI (see the module docstring)
    baseline: Interval | None = None  # SimpleShot's value of the same metric at this point, with its CI
    #: every method the run evaluated: its value of the same metric (its mean accuracy for a margin), with its CI
    methods: dict[str, Interval] = field(default_factory=dict)

    @property
    def ci95(self) -> float | None:
        return None if self.interval is None else self.interval.ci95


# --------------------------------------------------------------------------------------------- intervals


def read_per_task(output_dir: str | os.PathLike[str]) -> dict[tuple[str, str, str], list[float]] | None:
    """Per-task accuracies (percent) of a run's ``per_task.csv`` by ``(method, shots, alpha)``, in task order;
    ``None`` when the file is missing or lacks the columns."""
    path = Path(output_dir) / "per_task.csv" if output_dir else None
    if path is None or not path.is_file():
        return None
    accuracies: dict[tuple[str, str, str], list[tuple[int, float]]] = defaultdict(list)
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                key = (row["method"], str(row["shots"]), row["alpha"])
                accuracies[key].append((int(row["task"]), 100.0 * float(row["accuracy"])))
            except (KeyError, TypeError, ValueError):
                return None
    return {key: [value for _, value in sorted(values)] for key, values in accuracies.items()}


def mean_ci95(values: Sequence[float]) -> float:
    """``1.96·sd/√T`` (sample sd; 0 for one value), the CI every evaluation reports."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return Z95 * math.sqrt(variance) / math.sqrt(len(values))


def metric_interval(settings: Sequence[Mapping[str, Any]], per_task: Mapping[tuple[str, str, str], list[float]] | None,
                    method: str | None = None, shots: str | None = None, alpha: str | None = None,
                    gainer: str | None = None, other: str | None = None) -> Interval | None:
    """A run's value of a study metric with its 95% CI, from the run's per-setting records and ``per_task.csv``.

    The keyword arguments are the named groups of the study's metric pattern: ``method`` (with ``shots`` and
    ``alpha`` for one setting) for an accuracy, ``gainer`` and ``other`` for a worst margin. ``None`` when the
    run has no setting of that method.
    """
    if gainer:
        return _gain_interval(settings, per_task, gainer, str(other))
    chosen = [s for s in settings if s["method"] == method
              and (shots is None or (str(s["shots"]) == str(shots) and str(s["alpha"]) == str(alpha)))]
    if not chosen:
        return None
    value = sum(float(s["accuracy"]) for s in chosen) / len(chosen)
    lists = [(per_task or {}).get(_key(s)) for s in chosen]
    sizes = {len(v) for v in lists if v is not None}
    tasks = sizes.pop() if len(sizes) == 1 and all(v is not None for v in lists) else None
    if len(chosen) == 1:
        return Interval(value, float(chosen[0]["ci95"]), "the setting's CI over its tasks", tasks)
    if tasks is not None and tasks >= 2:
        means = [sum(v[t] for v in lists) / len(lists) for t in range(tasks)]  # type: ignore[index]
        return Interval(value, mean_ci95(means),
                        f"per-task mean over the {len(chosen)} settings (tasks paired by index)", tasks)
    return Interval(value, sum(float(s["ci95"]) for s in chosen) / len(chosen),
                    f"mean of the {len(chosen)} settings' CIs (upper bound; per_task.csv missing or unequal)", tasks)


def _gain_interval(settings: Sequence[Mapping[str, Any]], per_task: Mapping[tuple[str, str, str], list[float]] | None,
                   gainer: str, other: str) -> Interval | None:
    if gainer == other:
        return Interval(0.0, 0.0, f"{gainer} against itself")
    mine = {(str(s["shots"]), str(s["alpha"])): s for s in settings if s["method"] == gainer}
    theirs = {(str(s["shots"]), str(s["alpha"])): s for s in settings if s["method"] == other}
    shared = [k for k in mine if k in theirs]
    if not shared:
        return None
    worst = min(shared, key=lambda k: float(mine[k]["accuracy"]) - float(theirs[k]["accuracy"]))
    a, b = mine[worst], theirs[worst]
    value = float(a["accuracy"]) - float(b["accuracy"])
    where = f"{worst[0]}-shot alpha={worst[1]}"
    first, second = (per_task or {}).get(_key(a)), (per_task or {}).get(_key(b))
    if first is not None and second is not None and len(first) == len(second) >= 2:
        differences = [x - y for x, y in zip(first, second)]
        return Interval(value, mean_ci95(differences), "paired per-task difference at the worst setting",
                        len(first), where)
    return Interval(value, float(a["ci95"]) + float(b["ci95"]),
                    "sum of the two CIs at the worst setting (upper bound; no per_task.csv)", setting=where)


def baseline_parts(parts: Mapping[str, str | None]) -> dict[str, str | None] | None:
    """The metric parts of SimpleShot's value of the same metric, or ``None`` when the metric is SimpleShot's own
    accuracy or a margin over SimpleShot (whose baseline is 0 by definition: see :func:`margin_over_baseline`)."""
    if parts.get("gainer"):
        if parts["gainer"] == BASELINE or parts.get("other") == BASELINE:
            return None
        return {**parts, "gainer": BASELINE}
    if parts.get("method") == BASELINE:
        return None
    return {**parts, "method": BASELINE}


def margin_over_baseline(parts: Mapping[str, str | None]) -> bool:
    """The metric is a margin over SimpleShot: 0 is SimpleShot's level."""
    return bool(parts.get("gainer")) and parts.get("other") == BASELINE


def with_intervals(row: StudyRow, parts: Mapping[str, str | None]) -> StudyRow:
    """``row`` with its metric's 95% CI and SimpleShot's value of the same metric (when the run evaluated it),
    read from its settings and its ``per_task.csv``. ``parts``: the named groups of the study's metric pattern."""
    per_task = read_per_task(row.output_dir)
    arguments = {k: parts.get(k) for k in ("method", "shots", "alpha", "gainer", "other")}
    interval = metric_interval(row.settings, per_task, **arguments)
    baseline = None
    other = baseline_parts(arguments)
    if other is not None and any(s["method"] == BASELINE for s in row.settings):
        baseline = metric_interval(row.settings, per_task, **other)
    methods = {}
    for name in dict.fromkeys(str(s["method"]) for s in row.settings):
        found = metric_interval(row.settings, per_task, name, arguments["shots"], arguments["alpha"])
        if found is not None:
            methods[name] = found
    return replace(row, interval=interval, baseline=baseline, methods=methods)


def other_methods(rows: Sequence[StudyRow], parts: Mapping[str, str | None] | None) -> list[str]:
    """The methods the runs evaluated besides the metric's own and SimpleShot (when it is the baseline), in order
    of appearance; for a margin, every method (their accuracies)."""
    names = list(dict.fromkeys(m for r in rows for m in r.methods))
    if parts is None or parts.get("gainer"):
        return names
    return [m for m in names if m != parts.get("method") and m != BASELINE]


def conditions_swept(swept: Sequence[str]) -> list[str]:
    return [k for k in swept if is_test_condition(k)]


def best_setting(rows: Sequence[StudyRow], goal: str, swept: Sequence[str]) -> tuple[dict[str, str], float] | None:
    """The best swept hyper-parameters with their metric: the best run when only hyper-parameters are swept; with
    test conditions swept too, the hyper-parameters whose mean over the conditions is best (among those run at
    every condition); ``None`` when no hyper-parameter is swept (there is no best test condition)."""
    chosen = [k for k in swept if not is_test_condition(k)]
    if not chosen or not rows:
        return None
    groups: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for r in rows:
        groups[tuple(cell_text(r.point.get(k)) for k in chosen)].append(r.metric)
    complete = max(len(v) for v in groups.values())
    means = {k: sum(v) / len(v) for k, v in groups.items() if len(v) == complete}
    best = (max if goal == "maximize" else min)(means, key=lambda k: means[k])
    return dict(zip(chosen, best)), means[best]


# --------------------------------------------------------------------------------------------- tables


def ci_column(metric: str) -> str:
    return f"{metric}_ci95"


def summary_rows(rows: Sequence[StudyRow], metric: str) -> list[dict[str, Any]]:
    """CSV rows: swept values, the metric with its 95% CI and how it was obtained, SimpleShot's value of the same
    metric with its CI (blank when not evaluated), tasks per setting, every ``<method>/<k>shot/alpha_<a>``
    accuracy ± CI, then the run folder."""
    out = []
    for row in rows:
        record: dict[str, Any] = {**{k: cell_text(v) for k, v in row.point.items()}, metric: f"{row.metric:.4f}"}
        interval, base = row.interval, row.baseline
        record[ci_column(metric)] = _number(interval.ci95 if interval else None)
        record["ci95_method"] = interval.described if interval else "no per-setting records"
        record[BASELINE_COLUMN] = _number(base.value if base else None)
        record[f"{BASELINE_COLUMN}_ci95"] = _number(base.ci95 if base else None)
        record["tasks"] = cell_text(interval.tasks if interval and interval.tasks else _tasks(row))
        for s in row.settings:
            record[f"{s['method']}/{s['shots']}shot/alpha_{s['alpha']}"] = f"{s['accuracy']:.2f} ± {s['ci95']:.2f}"
        record["output_dir"] = row.output_dir
        out.append(record)
    return out


def markdown_table(rows: Sequence[StudyRow], metric: str, goal: str, swept: Sequence[str],
                   parts: Mapping[str, str | None] | None = None) -> str:
    """The finished points as a markdown table: metric ± 95% CI, SimpleShot's when evaluated, then every other
    method that ran (:func:`other_methods`). Best first when only hyper-parameters are swept; in the given order
    (the sweep's) when a test condition is, since sorting α or shots by accuracy hides the trend."""
    ordered = list(rows) if conditions_swept(swept) else \
        sorted(rows, key=lambda r: r.metric, reverse=goal == "maximize")
    with_baseline = any(r.baseline is not None for r in rows)
    others = other_methods(rows, parts)
    from lightning_putm.methods import method_display_name

    what = " accuracy" if parts is not None and parts.get("gainer") else ""
    header = [*swept, f"{metric} (± 95% CI)"] + ([f"{BASELINE_NAME} (± 95% CI)"] if with_baseline else []) + [
        f"{method_display_name(m)}{what} (± 95% CI)" for m in others]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in ordered:
        cells = [*(cell_text(row.point.get(k)) for k in swept), _plus_minus(row.metric, row.ci95)]
        if with_baseline:
            cells.append(_plus_minus(row.baseline.value, row.baseline.ci95) if row.baseline else "not evaluated")
        cells += [_plus_minus(row.methods[m].value, row.methods[m].ci95) if m in row.methods else "not evaluated"
                  for m in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_notes(rows: Sequence[StudyRow], parts: Mapping[str, str | None] | None, swept: Sequence[str] = (),
                  goal: str = "maximize") -> list[str]:
    """The summary's notes: the order and the best setting, tasks per setting, how the CIs were obtained, the
    baseline (or why there is none)."""
    notes = []
    conditions = conditions_swept(swept)
    if conditions:
        words = " and ".join(parameter_label(k) for k in conditions)
        best = best_setting(rows, goal, swept)
        kind = "is a test condition" if len(conditions) == 1 else "are test conditions"
        notes.append(f"Rows in the sweep's order: {words} {kind}, measured rather than chosen, so no run is marked best"
                     + (f"; the best {', '.join(f'{parameter_label(k)} = {v}' for k, v in best[0].items())} "
                        f"({best[1]:.2f}, mean over the {words} swept)" if best else "") + ".")
    tasks = sorted({t for t in (row_tasks(r) for r in rows) if t})
    if tasks:
        notes.append(f"{range_text(tasks)} tasks per (method, shot, α) setting; differences smaller than the CIs "
                     "are not resolved at this number of tasks.")
    hows = sorted({r.interval.how for r in rows if r.interval is not None})
    if hows:
        notes.append("CI (95%, in points) of each point's metric: " + "; ".join(hows) + ".")
    if any(r.interval is None or r.interval.ci95 is None for r in rows):
        notes.append("Some runs have no per-setting records, so their metric has no CI.")
    if len(swept) > 1:
        notes.append("In the figure a value shared by several points shows the mean of their metrics and the mean "
                     "of their CIs (an upper bound: the points share their tasks).")
    if parts is not None and margin_over_baseline(parts):
        notes.append(f"The metric is already the margin over {BASELINE_NAME}: 0 is {BASELINE_NAME}'s level "
                     "(the dashed line in the figure).")
    elif parts is not None and baseline_parts(parts) is None:
        notes.append(f"The metric is {BASELINE_NAME}'s own, so no separate baseline is drawn.")
    elif any(r.baseline is not None for r in rows):
        missing = sum(r.baseline is None for r in rows)
        notes.append(f"{BASELINE_NAME}: the same metric for {BASELINE} in the same runs (same tasks)"
                     + (f"; {missing} run(s) did not evaluate it" if missing else "") + ".")
    else:
        notes.append(f"{BASELINE_NAME} was not evaluated in these runs, so no baseline is shown: add {BASELINE} to "
                     f"the sweep's `methods` (e.g. `methods=[putm,{BASELINE}]`) to compare with nearest class mean.")
    return notes


def _key(setting: Mapping[str, Any]) -> tuple[str, str, str]:
    return str(setting["method"]), str(setting["shots"]), str(setting["alpha"])


def mean_or_none(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def mean_ci_or_none(values: Sequence[float | None]) -> float | None:
    """The mean of the points' CIs (an upper bound for the CI of their mean); ``None`` if one is unknown."""
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


def row_tasks(row: StudyRow) -> int | None:
    return row.interval.tasks if row.interval is not None and row.interval.tasks else _tasks(row)


def _tasks(row: StudyRow) -> int | None:
    """Tasks per setting when the run's records carry them (``tasks`` of its settings, all equal)."""
    counts = {int(s["tasks"]) for s in row.settings if s.get("tasks")}
    return counts.pop() if len(counts) == 1 else None


def range_text(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"


def _plus_minus(value: float, ci: float | None) -> str:
    return f"{value:.2f}" if ci is None else f"{value:.2f} ± {ci:.2f}"


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def cell_text(value: Any) -> str:
    return "" if value is None else str(value)
