"""Run a W&B sweep file (``conf/sweep/*.yaml``) as a study: resumable, offline or online, on one or many processes.

``wandb sweep`` + ``wandb agent`` need a W&B server. This job runs the same files without one, with Optuna
(Akiba et al., KDD 2019) doing the bookkeeping. Why Optuna rather than a scheduler of our own:

* its relational storage (an SQLite file by default; a PostgreSQL URL for several machines) records atomically
  which runs are finished, so a killed study loses at most the run in flight, and restarting skips the rest;
* its heartbeats mark a run whose process died as failed, so another process (or the restart) takes it over;
* its samplers cover the sweep files' ``method: random`` and ``method: bayes`` (TPE) beyond grids.

Every run is one ``evaluate.py`` run with the point's arguments (formatted by W&B's own agent formatter), in its
own folder ``<study dir>/runs/<point>/``, so the run in flight resumes from its finished settings too
(:mod:`lightning_putm.evaluation.store`). With ``logger: wandb`` every run is logged to W&B (offline files when
there is no login), grouped under the study's name. At the end the study writes one summary: ``summary.csv``,
``summary.md`` and a figure of the metric against each swept parameter.

    python -m lightning_putm study conf/sweep/putm_sensitivity.yaml checkpoint=/path/to/best.ckpt
    python -m lightning_putm study conf/sweep/alpha_shots.yaml --storage postgresql://user@host/db   # many machines
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import shlex
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from lightning_putm.config import split_override
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
from lightning_putm.evaluation.progress import Eta, format_duration
from lightning_putm.evaluation.report import worst_gain
from lightning_putm.evaluation.study_summary import StudyRow, with_intervals, write_study_summary
from lightning_putm.loggers import WANDB_LINE
from lightning_putm.runs import slug
from lightning_putm.validators import did_you_mean

#: Where studies keep their storage, runs and summary: ``<STUDY_ROOT>/<sweep name>/``.
STUDY_ROOT = Path("outputs/studies")
METHODS = ("grid", "random", "bayes")
#: ``fewshot/<method>/acc`` (mean over the run's settings), ``fewshot/<method>/<k>shot/alpha_<a>/acc``, or
#: ``fewshot/<method>/worst_gain_over_<other>`` (the run's smallest accuracy margin over ``other``, in points).
METRIC = re.compile(r"^fewshot/(?P<method>[a-z_]+)(/(?P<shots>\d+)shot/alpha_(?P<alpha>[^/]+))?/acc$"
                    r"|^fewshot/(?P<gainer>[a-z_]+)/worst_gain_over_(?P<other>[a-z_]+)$")
METRIC_FORMS = ("fewshot/<method>/acc, fewshot/<method>/<k>shot/alpha_<a>/acc or "
                "fewshot/<method>/worst_gain_over_<other>")
#: Arguments the study sets itself for every run.
STUDY_OWNED = ("output_dir",)


@dataclass
class Sweep:
    """A sweep file, checked: fixed arguments, swept parameters and the metric."""

    name: str
    method: str
    metric: str
    goal: str
    fixed: dict[str, Any]
    swept: dict[str, dict[str, Any]]  # name -> {"values": [...]} or a distribution
    run_cap: int | None = None
    path: Path | None = None
    extra: tuple[str, ...] = ()  # command-line key=value arguments, passed to every run as typed


    def points(self) -> list[dict[str, Any]]:
        """Every grid point, in the file's order (``method: grid`` only)."""
        names = list(self.swept)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.swept[n]["values"] for n in names))]


def read_sweep(path: Path, overrides: Sequence[str] = ()) -> Sweep:
    """A sweep file with command-line ``key=value`` arguments; a swept key given there is fixed to that value."""
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}; give one of conf/sweep/*.yaml or your own")
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if str(spec.get("program", "evaluate.py")) != "evaluate.py":
        raise ConfigError(f"{path}: program must be evaluate.py, got {spec.get('program')!r}")
    method = str(spec.get("method", ""))
    if method not in METHODS:
        hint = did_you_mean(method, METHODS).strip()
        raise ConfigError(f"{path}: method must be one of {', '.join(METHODS)}, got {method!r}"
                          + (f"; {hint}" if hint else ""))
    metric = spec.get("metric") or {}
    name = str(metric.get("name", ""))
    if not METRIC.match(name):
        raise ConfigError(f"{path}: metric.name must be {METRIC_FORMS}, got {name!r}")
    goal = str(metric.get("goal", "maximize"))
    if goal not in ("maximize", "minimize"):
        raise ConfigError(f"{path}: metric.goal must be maximize or minimize, got {goal!r}")
    fixed: dict[str, Any] = {}
    swept: dict[str, dict[str, Any]] = {}
    for key, options in (spec.get("parameters") or {}).items():
        if not isinstance(options, dict):
            raise ConfigError(f"{path}: parameters.{key} must be a mapping like {{value: ...}} or {{values: [...]}}")
        if "value" in options:
            fixed[key] = options["value"]
        elif "values" in options:
            if not options["values"]:
                raise ConfigError(f"{path}: parameters.{key}.values is empty")
            swept[key] = {"values": list(options["values"])}
        elif method == "grid":
            raise ConfigError(f"{path}: parameters.{key}: a grid sweep needs `values` (or a fixed `value`)")
        else:
            swept[key] = _distribution(path, key, options)
    extra: list[str] = []
    for text in overrides:
        key, raw = split_override(text)
        if key in STUDY_OWNED:
            raise ConfigError(f"{key}: the study gives every run its own folder under the study's folder; use --dir")
        swept.pop(key, None)
        fixed.pop(key, None)
        extra.append(text)  # as typed: evaluate.py reads it (checkpoint=null stays null, not the text None)
    for key in STUDY_OWNED:
        fixed.pop(key, None)
    if not swept:
        raise ConfigError(f"{path}: nothing is swept (no parameter has `values` or a distribution)")
    run_cap = spec.get("run_cap")
    sweep = Sweep(str(spec.get("name") or path.stem), method, name, goal, fixed, swept,
                  None if run_cap is None else int(run_cap), path, tuple(extra))
    match = METRIC.match(name)
    given = {split_override(t)[0]: split_override(t)[1] for t in extra}
    methods = str(given.get("methods", fixed.get("methods", "")))
    listed = [m.strip(" '\"") for m in methods.strip("[] ").split(",")]
    for needed in (match.group("method"), match.group("gainer"), match.group("other")):
        if needed and ("methods" in fixed or "methods" in given) and needed not in listed:
            raise ConfigError(f"{path}: the metric {name} needs method {needed} in `methods` ({methods})")
    return sweep


def _distribution(path: Path, key: str, options: dict[str, Any]) -> dict[str, Any]:
    kind = options.get("distribution")
    if kind is None and "min" in options and "max" in options:
        kind = "int_uniform" if all(isinstance(options[b], int) for b in ("min", "max")) else "uniform"
    if kind not in ("uniform", "int_uniform", "log_uniform_values"):
        raise ConfigError(f"{path}: parameters.{key}: distribution {kind!r} is not supported here; use values, "
                          "uniform, int_uniform or log_uniform_values (min, max)")
    low, high = options.get("min"), options.get("max")
    if low is None or high is None or not float(low) < float(high):
        raise ConfigError(f"{path}: parameters.{key} needs min < max, got min={low}, max={high}")
    return {"distribution": kind, "min": low, "max": high}


def agent_arguments(point: dict[str, Any]) -> list[str]:
    """``key=value`` arguments exactly as the W&B agent passes them to ``evaluate.py`` (its own formatter)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    return create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})["args_no_hyphens"]


def point_key(point: dict[str, Any]) -> str:
    """A folder name for a point: readable swept values, then a short hash of the whole point."""
    digest = hashlib.sha256(json.dumps(point, sort_keys=True, default=str).encode()).hexdigest()[:10]
    readable = "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
    return f"{slug(readable, 80)}-{digest}"


def storage_url(url: str) -> str:
    """``--storage`` as SQLAlchemy opens it. ``postgresql://`` (or ``postgres://``) means psycopg 3, the driver of
    the ``postgres`` extra: SQLAlchemy 2.0 would otherwise look for psycopg2. A missing driver is named here, before
    anything is written."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"--storage {url!r} is not a database URL; give sqlite:///path/to/study.db or "
                          "postgresql://user@host/database")
    if scheme not in ("postgresql", "postgres", "postgresql+psycopg"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg") is not None:
        return f"postgresql+psycopg://{rest}"
    if scheme != "postgresql+psycopg" and importlib.util.find_spec("psycopg2") is not None:
        return f"postgresql://{rest}"
    raise ConfigError(f"--storage {scheme}://...: the PostgreSQL driver psycopg is not installed; "
                      "pip install 'psycopg[binary]' (in a clone of this repository: pip install -e '.[postgres]')")


def metric_value(metric: str, summaries: Sequence[Any]) -> float:
    """The metric of one run from its per-setting summaries: one setting's accuracy, the mean over the run's, or
    the worst margin of one method over another (:func:`~lightning_putm.evaluation.report.worst_gain`)."""
    match = METRIC.match(metric)
    if match.group("gainer"):
        try:
            return float(worst_gain(summaries, match.group("gainer"), match.group("other")))
        except ValueError as exc:
            raise ConfigError(f"the run cannot give {metric}: {exc}; check the sweep's methods") from exc
    chosen = [s for s in summaries if s.method == match.group("method")
              and (match.group("shots") is None or (str(s.shots) == match.group("shots")
                                                   and s.alpha_label == match.group("alpha")))]
    if not chosen:
        raise ConfigError(f"the run logged no {metric}: check the sweep's methods, shots and alphas")
    return float(sum(s.accuracy for s in chosen) / len(chosen))


def metric_parts(metric: str) -> dict[str, str | None]:
    """The named parts of a study metric (``method``, ``shots``, ``alpha``, ``gainer``, ``other``; unused ones
    ``None``): what the summary needs to compute its CI and SimpleShot's value of the same metric."""
    match = METRIC.match(metric)
    if match is None:
        raise ConfigError(f"metric must be {METRIC_FORMS}, got {metric!r}")
    return {k: match.group(k) for k in ("method", "shots", "alpha", "gainer", "other")}


class Study:
    """One sweep as an Optuna study with heartbeats: every process running it takes the next unfinished point."""

    def __init__(self, sweep: Sweep, folder: Path, storage: str | None = None, heartbeat_s: int = 10,
                 grace_s: int = 30, seed: int = 0, log: Callable[[str], None] = print) -> None:
        self.sweep, self.folder, self.log = sweep, folder, log
        self.storage_url = storage_url(storage) if storage else f"sqlite:///{(folder / 'study.db').resolve()}"
        self.heartbeat_s, self.grace_s, self.seed = heartbeat_s, grace_s, seed
        self._study = None

    @property
    def storage_label(self) -> str:
        """The storage URL as it may be printed: without its password."""
        return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", self.storage_url)

    # ------------------------------------------------------------------------------------------- checks
    def check(self) -> None:
        """Every point (the grid, or the fixed part with each distribution's bounds) is a valid evaluate.py config;
        raises :class:`ConfigError` naming the point, before anything is written."""
        points = self.sweep.points() if self.sweep.method == "grid" else [self._bounds_point(b) for b in (0, 1)]
        for point in points:
            args = self.arguments(point, Path("outputs/studies/check"))
            try:
                settings_from_config(load_evaluate_config(args))
            except ConfigError as exc:
                raise ConfigError(f"sweep {self.sweep.name}, point {point}: {exc}") from None
        if self.sweep.method != "grid" and self.sweep.run_cap is None:
            raise ConfigError(f"sweep {self.sweep.name}: a {self.sweep.method} sweep needs run_cap in the file or "
                              "--max-runs N")

    def _bounds_point(self, which: int) -> dict[str, Any]:
        return {k: (v["values"][0] if "values" in v else (v["min"] if which == 0 else v["max"]))
                for k, v in self.sweep.swept.items()}

    def arguments(self, point: dict[str, Any], run_folder: Path) -> list[str]:
        group = [] if "wandb.group" in self.sweep.fixed else [f"wandb.group={self.sweep.name}"]
        name = [] if "wandb.name" in self.sweep.fixed else [f"wandb.name={self.sweep.name}-{run_folder.name}"]
        return [*agent_arguments({**self.sweep.fixed, **point}), *self.sweep.extra, f"output_dir={run_folder}", *group,
                *name]

    # ------------------------------------------------------------------------------------------- optuna
    @property
    def study(self):
        if self._study is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed run is reported once, by our own error
            # heartbeats are marked experimental in Optuna; they are what makes a dead process's run free again
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings("ignore", message=r".*fail_stale_trials is experimental")
            self.folder.mkdir(parents=True, exist_ok=True)
            storage = self._open_storage()
            sampler = (optuna.samplers.TPESampler(seed=self.seed) if self.sweep.method == "bayes"
                       else optuna.samplers.RandomSampler(seed=self.seed))
            self._study = optuna.create_study(study_name=self.sweep.name, storage=storage, sampler=sampler,
                                              direction=self.sweep.goal, load_if_exists=True)
        return self._study

    def _open_storage(self) -> Any:
        """The storage, with heartbeats. Machines that start on a fresh database at the same moment all create its
        tables: all but one fail on the duplicate, and a second look finds the tables made. Other failures (no
        server, no database, a wrong password) are one line naming the storage."""
        from optuna.storages import RDBStorage
        from sqlalchemy.exc import IntegrityError, ProgrammingError, SQLAlchemyError

        attempts = 5
        for attempt in range(attempts):
            try:
                return RDBStorage(self.storage_url, heartbeat_interval=self.heartbeat_s, grace_period=self.grace_s)
            except (IntegrityError, ProgrammingError) as exc:  # the tables were created meanwhile: look again
                if attempt + 1 < attempts:
                    time.sleep(0.2 * (attempt + 1))
                    continue
                error = exc
            except SQLAlchemyError as exc:
                error = exc
            reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
            raise ConfigError(f"--storage {self.storage_label}: cannot open it ({reason}); check that the server "
                              "runs and that the user and the database exist") from None

    def finished_keys(self) -> set[str]:
        from optuna.trial import TrialState

        return {t.user_attrs["point_key"] for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if "point_key" in t.user_attrs}

    def running_keys(self) -> set[str]:
        from optuna.trial import TrialState

        return {t.user_attrs["point_key"] for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if "point_key" in t.user_attrs}

    def objective(self, run: Callable[[list[str]], Sequence[Any]]) -> Callable[[Any], float]:
        def evaluate(trial: Any) -> float:
            point = {k: self._suggest(trial, k, spec) for k, spec in self.sweep.swept.items()}
            key = point_key(point)
            trial.set_user_attr("point_key", key)
            if self.sweep.method == "grid" and self._claimed_elsewhere(trial._trial_id, key):
                import optuna

                raise optuna.TrialPruned(f"{key} is finished or running in another process")
            trial.set_user_attr("point", json.dumps(point, default=str))
            folder = self.folder / "runs" / key
            trial.set_user_attr("output_dir", str(folder))
            label = self._run_started(key)
            summaries = [r.summary() for r in run(self.arguments(point, folder))]
            trial.set_user_attr("settings", json.dumps([{"method": s.method, "shots": s.shots, "alpha": s.alpha_label,
                                                          "accuracy": s.accuracy, "ci95": s.ci95} for s in summaries]))
            value = metric_value(self.sweep.metric, summaries)
            self._run_done(label, value)
            return value
        return evaluate

    # ------------------------------------------------------------------------------------------- progress
    def _start_progress(self, max_runs: int | None) -> None:
        """Count the runs of this process: ``run i/N`` numbers them among all the study's runs, the ETA comes
        from the pace of the runs solved here (runs finished earlier or elsewhere took no time here)."""
        self.total_runs = len(self.sweep.points()) if self.sweep.method == "grid" else int(self.sweep.run_cap or 0)
        self.finished_before = len(self.finished_keys())
        left = max(0, self.total_runs - self.finished_before)
        self.eta = Eta(left if max_runs is None else min(left, max_runs))
        self.current_run: str | None = None

    def _run_started(self, key: str) -> str:
        if getattr(self, "eta", None) is None:
            self._start_progress(None)
        label = f"run {self.finished_before + int(self.eta.done) + 1}/{self.total_runs}"
        self.current_run, self.run_started = f"{label} ({key})", self.eta.elapsed
        self.log(f"[{self.sweep.name}] {label} {key}")
        return label

    def _run_done(self, label: str, value: float) -> None:
        took = format_duration(self.eta.elapsed - self.run_started)
        self.eta.advance(1)
        self.current_run = None
        self.log(f"[{self.sweep.name}] {label} done in {took}: {self.sweep.metric} = {value:.2f}; {self.eta.text()}")

    def _claimed_elsewhere(self, trial_id: int, key: str) -> bool:
        """Whether another trial has finished this point or is running it. Two processes that look for a free
        point at the same moment both enqueue it, and a process killed between enqueueing and starting leaves its
        point waiting for whoever comes next. Each trial records its point, then looks: of two trials of one point
        at least the later one to look sees the other, so a point never runs twice at once (both may step aside;
        the loop then offers the point again)."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
        return any(t.user_attrs.get("point_key") == key for t in trials if t._trial_id != trial_id)

    @staticmethod
    def _suggest(trial: Any, key: str, spec: dict[str, Any]) -> Any:
        if "values" in spec:
            values = spec["values"]
            names = [Study._grid_value(v) for v in values]
            chosen = trial.suggest_categorical(key, names)
            return values[names.index(chosen)]
        low, high = spec["min"], spec["max"]
        if spec["distribution"] == "int_uniform":
            return trial.suggest_int(key, int(low), int(high))
        return trial.suggest_float(key, float(low), float(high), log=spec["distribution"] == "log_uniform_values")

    # ------------------------------------------------------------------------------------------- loop
    def run(self, run: Callable[[list[str]], Sequence[Any]], max_runs: int | None = None) -> int:
        """Solve unfinished points until none is left (grid) or the run cap is reached; returns runs done here."""
        import optuna
        from optuna.storages import fail_stale_trials

        objective, done_here = self.objective(run), 0
        limit = max_runs if max_runs is not None else self.sweep.run_cap
        self._start_progress(max_runs)
        while limit is None or done_here < limit:
            fail_stale_trials(self.study)  # runs whose process stopped beating: failed, their points free again
            if self.sweep.method == "grid":
                finished, running = self.finished_keys(), self.running_keys()
                todo = [p for p in self.sweep.points() if point_key(p) not in finished]
                if not todo:
                    break
                free = [p for p in todo if point_key(p) not in running]
                if not free:  # all left are in flight elsewhere (or in a process that died: wait for its heartbeat)
                    self.log(f"[{self.sweep.name}] {len(todo)} run(s) in flight in other processes; waiting")
                    time.sleep(max(1, self.heartbeat_s))
                    continue
                self.study.enqueue_trial({k: self._grid_value(v) for k, v in free[0].items()})
            elif len(self.finished_keys()) >= (self.sweep.run_cap or math.inf):
                break
            self.study.optimize(objective, n_trials=1, catch=())
            done_here += 1
        return done_here

    @staticmethod
    def _grid_value(value: Any) -> Any:
        """A grid value as Optuna stores categorical choices (lists as their JSON text, like :meth:`_suggest`)."""
        return json.dumps(value) if not isinstance(value, (str, int, float, bool)) else value

    def rows(self) -> list[StudyRow]:
        """One row per finished point (the first finished run of each), in the order runs finished."""
        from optuna.trial import TrialState

        rows, seen = [], set()
        parts = metric_parts(self.sweep.metric)
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            key = trial.user_attrs.get("point_key")
            if key is None or key in seen:
                continue
            seen.add(key)
            row = StudyRow(point=json.loads(trial.user_attrs["point"]), metric=float(trial.value), key=key,
                           output_dir=trial.user_attrs.get("output_dir", ""),
                           settings=json.loads(trial.user_attrs.get("settings", "[]")))
            rows.append(with_intervals(row, parts))  # the metric's 95% CI and SimpleShot's value, from the run
        return rows


def run_study(argv: Sequence[str], log: Callable[[str], None] = print,
              run: Callable[[list[str]], Sequence[Any]] | None = None) -> Path:
    """``python -m lightning_putm study SWEEP.yaml [key=value ...] [--storage URL] [--dir DIR] [--max-runs N]
    [--summary-only]``: run a sweep file as a resumable study and write its summary; returns the study folder."""
    options, rest = parse_options(list(argv))
    if not rest:
        raise ConfigError("give a sweep file: python -m lightning_putm study conf/sweep/<name>.yaml [key=value ...]")
    sweep = read_sweep(Path(rest[0]), rest[1:])
    if options.get("max_runs") is not None and sweep.method != "grid":
        sweep.run_cap = int(options["max_runs"])
    folder = Path(options.get("dir") or STUDY_ROOT / slug(sweep.name))
    study = Study(sweep, folder, options.get("storage"), int(options.get("heartbeat", 10)),
                  int(options.get("grace", 30)), log=log)
    study.check()  # every point is a valid configuration: before the folder, the storage or any W&B run exists
    if run is None:
        from lightning_putm.jobs.evaluate import run_evaluate

        def run(args: list[str]) -> Sequence[Any]:  # quiet, but for the line telling where each W&B run is
            return run_evaluate(args, log=lambda line: log(line) if line.startswith(WANDB_LINE) else None)

    if not options.get("summary_only"):
        total = len(sweep.points()) if sweep.method == "grid" else sweep.run_cap
        left = total - len(study.finished_keys()) if sweep.method == "grid" else None
        log(f"study {sweep.name}: {total} run(s) in all" + (f", {left} left" if left is not None else "") +
            f"; storage {study.storage_label}")
        try:
            study.run(run, None if sweep.method == "grid" else (None if options.get("max_runs") is None
                                                                else int(options["max_runs"])))
        except KeyboardInterrupt:  # Ctrl-C: finished runs are in the storage, the run in flight kept its settings
            current = getattr(study, "current_run", None)
            kept = f" in {current}; the finished runs and that run's finished settings" if current else \
                "; the finished runs"
            raise KeyboardInterrupt(
                f"study {sweep.name} stopped{kept} are kept: re-run the same command to resume: "
                f"python -m lightning_putm study {shlex.join(map(str, argv))}") from None
    paths = write_study_summary(study.rows(), sweep.metric, sweep.goal, list(sweep.swept), folder, sweep.name,
                                metric_parts(sweep.metric))
    log(f"study {sweep.name}: summary in " + ", ".join(str(p) for p in paths.values()))
    return folder


def parse_options(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    names = {"--storage": "storage", "--dir": "dir", "--max-runs": "max_runs", "--heartbeat": "heartbeat",
             "--grace": "grace"}
    options: dict[str, Any] = {}
    rest: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        flag, _, inline = arg.partition("=")
        if flag in names:
            value = inline if inline else (argv[index + 1] if index + 1 < len(argv) else None)
            if value is None:
                raise ConfigError(f"{flag} needs a value")
            options[names[flag]] = value
            index += 1 if inline else 2
            continue
        if arg == "--summary-only":
            options["summary_only"] = True
        elif arg.startswith("--"):
            known = [*names, "--summary-only"]
            raise ConfigError(f"unknown option {arg}; {did_you_mean(flag, known)}options: {', '.join(known)}")
        else:
            rest.append(arg)
        index += 1
    for key in ("max_runs", "heartbeat", "grace"):
        if key in options and (not str(options[key]).isdigit() or int(options[key]) < 1):
            raise ConfigError(f"--{key.replace('_', '-')} must be a positive integer, got {options[key]!r}")
    return options, rest


__all__ = ["STUDY_ROOT", "Study", "Sweep", "agent_arguments", "metric_value", "parse_options", "point_key", "read_sweep",
           "run_study", "storage_url"]
