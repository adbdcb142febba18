"""Run a W&B sweep file (``conf/sweep/*.yaml``) as a study: resumable, offline or online, on one or many processes.

``wandb sweep`` + ``wandb agent`` need a W&B server. A :class:`Study` runs the same files without one, with Optuna
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

import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence


from lightning_putm.errors import ConfigError, LightningPutmError
from lightning_putm.evaluation.progress import Eta, format_duration
from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
from lightning_putm.evaluation.sources import check_source_exists
from lightning_putm.studies.summary import StudyRow, with_intervals
from lightning_putm.studies.sweep import Sweep, agent_arguments, metric_parts, metric_value
from lightning_putm.validators import did_you_mean

#: Where studies keep their storage, runs and summary: ``<STUDY_ROOT>/<sweep name>/``.
STUDY_ROOT = Path("outputs/studies")


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


def without_password(text: str) -> str:
    """``text`` with the password of any database URL in it masked (``user:***@host``, ``password=***``), as it
    may be printed. As SQLAlchemy reads a URL, the password runs to the first ``@`` and may hold ``/``."""
    text = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", text)
    return re.sub(r"([?&]password=)[^&\s]*", r"\1***", text)


#: The study's user attribute holding the fixed settings of its runs (:meth:`Study.fixed_settings`), as JSON.
FIXED_SETTINGS = "fixed_settings"


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
        return without_password(self.storage_url)

    # ------------------------------------------------------------------------------------------- checks
    def check(self) -> None:
        """Every point (the grid, or the fixed part with each distribution's bounds) is a valid evaluate.py config;
        raises :class:`ConfigError` naming the point, before anything is written."""
        points = self.sweep.points() if self.sweep.method == "grid" else [self._bounds_point(b) for b in (0, 1)]
        for point in points:
            args = self.arguments(point, Path("outputs/studies/check"))
            try:
                check_source_exists(settings_from_config(load_evaluate_config(args)))
            except LightningPutmError as exc:
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
            study = optuna.create_study(study_name=self.sweep.name, storage=storage, sampler=sampler,
                                        direction=self.sweep.goal, load_if_exists=True)
            self._check_fixed_settings(study)
            self._study = study
        return self._study

    def fixed_settings(self) -> dict[str, str]:
        """What every run of the study shares: the sweep file's fixed values, then the command line's arguments
        (which win), each as ``key -> value`` text; not the swept keys the command line pins (part of each point)."""
        fixed = {key: json.dumps(value, default=str) for key, value in self.sweep.fixed.items()}
        given = dict(text.split("=", 1) for text in self.sweep.extra)
        return {key: value for key, value in {**fixed, **given}.items() if key not in self.sweep.pinned}

    def _check_fixed_settings(self, study: Any) -> None:
        """A finished point counts only for the fixed settings it ran with. The first process records them with
        the study; a later one with others (``tasks=2``, then ``tasks=3``) is refused, instead of finding every
        point finished and summarising runs made with other settings."""
        mine = self.fixed_settings()
        recorded = study.user_attrs.get(FIXED_SETTINGS)
        if recorded is None:
            study.set_user_attr(FIXED_SETTINGS, json.dumps(mine, sort_keys=True))
            return
        theirs = json.loads(recorded)
        changed = [f"{key}: {theirs.get(key, '(not set)')} -> {mine.get(key, '(not set)')}"
                   for key in sorted(set(theirs) | set(mine)) if theirs.get(key) != mine.get(key)]
        if changed:
            raise ConfigError(f"study {self.sweep.name} in {self.storage_label} ran with other fixed settings "
                              f"({'; '.join(without_password(c) for c in changed)}); its finished runs would count for "
                              "these: give this study its own folder (--dir) or name (`name:` in the sweep file), or "
                              "run it with the settings it has")

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
            key = self.sweep.key(point)
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
                todo = [p for p in self.sweep.points() if self.sweep.key(p) not in finished]
                if not todo:
                    break
                free = [p for p in todo if self.sweep.key(p) not in running]
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
        """One row per finished point (the first finished run of each): in the sweep's order for a grid (the
        summary keeps it where test conditions are swept), else in the order runs finished."""
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
        if self.sweep.method == "grid":
            rank = {self.sweep.key(point): index for index, point in enumerate(self.sweep.points())}
            rows.sort(key=lambda r: rank.get(r.key, len(rank)))
        return rows


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


__all__ = ["STUDY_ROOT", "Study", "parse_options", "storage_url", "without_password"]
