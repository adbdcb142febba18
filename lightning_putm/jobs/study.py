"""``python -m lightning_putm study <sweep.yaml>``: a sweep run as an Optuna study
(:mod:`lightning_putm.studies.study`), each point one ``evaluate.py`` run; Ctrl-C stops it and the same command
resumes it."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable, Sequence


from lightning_putm.errors import ConfigError
from lightning_putm.loggers import WANDB_LINE
from lightning_putm.runs import slug
from lightning_putm.studies.study import STUDY_ROOT, Study, parse_options, without_password
from lightning_putm.studies.summary_report import write_study_summary
from lightning_putm.studies.sweep import metric_parts, read_sweep


def resume_hint(argv: Sequence[str]) -> str:
    """How to resume: the same command, printed without the storage's password."""
    command, typed = shlex.join(without_password(str(a)) for a in argv), shlex.join(map(str, argv))
    hidden = "" if command == typed else " (with the storage's password where it shows ***)"
    return f"re-run the same command to resume{hidden}: python -m lightning_putm study {command}"


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
            study.run(run, None if options.get("max_runs") is None else int(options["max_runs"]))
        except KeyboardInterrupt:  # Ctrl-C: finished runs are in the storage, the run in flight kept its settings
            current = getattr(study, "current_run", None)
            kept = f" in {current}; the finished runs and that run's finished settings" if current else \
                "; the finished runs"
            raise KeyboardInterrupt(f"study {sweep.name} stopped{kept} are kept: {resume_hint(argv)}") from None
    paths = write_study_summary(study.rows(), sweep.metric, sweep.goal, list(sweep.swept), folder, sweep.name,
                                metric_parts(sweep.metric))
    log(f"study {sweep.name}: summary in " + ", ".join(str(p) for p in paths.values()))
    return folder
