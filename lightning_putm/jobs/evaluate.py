"""The ``evaluate.py`` job: config → features (file, demo or checkpoint) → ``Trainer.test`` with the few-shot
callback → table, CSV files, plots and logger entries.

Order matters for trust: everything a user can get wrong (config keys and values, method parameters, files,
the checkpoint, Trainer options) is checked before the run folder is created or a W&B run is started. The config
is read and checked first, with no torch or Lightning imported yet, so that a mistyped key is reported at once.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import warnings
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from omegaconf import DictConfig

from lightning_putm.config import (Override, Overrides, build_trainer, changed_keys, command_line_value,
                                   to_container, to_yaml)
from lightning_putm.evaluation.settings import (EvaluationSettings, RUN_ROOT, check_methods_accept,
                                                checkpoint_run_name, load_evaluate_config, settings_from_config)
from lightning_putm.loggers import WANDB_RUN_FILE, build_logger, console, finish_logger
from lightning_putm.runs import folder_locked, run_dir
from lightning_putm.signals import interrupting_signal, signals_recorded, stop_on_signals
from lightning_putm.validators import alpha_label, query_classes_label

if TYPE_CHECKING:
    from lightning_putm.evaluation.callback import FewShotEvaluationCallback
    from lightning_putm.evaluation.runner import SettingResult


def build_evaluation_trainer(settings: EvaluationSettings, callback: FewShotEvaluationCallback,
                             log: Callable[[str], None] = print) -> Any:
    """A Trainer for the test loop (no logger yet): ``trainer.*`` options plus what evaluation fixes itself
    (``log``: where the extraction's progress lines go when no bar is drawn)."""
    from lightning_putm.evaluation.progress import extraction_bar

    return build_trainer(settings.trainer, logger=False, callbacks=[callback, *extraction_bar(settings.progress, log)],
                         enable_checkpointing=False, inference_mode=False, enable_progress_bar=settings.progress,
                         enable_model_summary=False, default_root_dir=str(settings.output_dir or RUN_ROOT))


@contextlib.contextmanager
def output_folder(settings: EvaluationSettings, log: Callable[[str], None] = print) -> Iterator[Path]:
    """The folder named by ``output_dir``, or a new run folder under ``outputs/evaluate`` (``latest`` points at it),
    locked for this run (:func:`~lightning_putm.runs.folder_locked`): a second run into a folder that a running
    one holds is refused before it writes anything."""
    if settings.output_dir is not None:
        settings.output_dir.mkdir(parents=True, exist_ok=True)
        with folder_locked(settings.output_dir, f"output_dir={settings.output_dir}", log):
            yield settings.output_dir
        return
    with run_dir(RUN_ROOT, settings.name) as folder, folder_locked(folder, f"output_dir={folder}", log):
        yield folder


def describe(cfg: DictConfig, settings: EvaluationSettings) -> str:
    """What the console shows of the config: the keys the user set (all of them with verbose=true).

    The baseline is the config the run would have without the user's settings: with a checkpoint, its recorded
    data (dataset group and settings) are defaults, not changes; a dataset named on purpose (``data=`` with
    ``force_data=true``) is listed as ``data=<name>``, its group's own values are not.
    """
    if settings.verbose:
        return "effective config:\n" + to_yaml(cfg)
    defaults = load_evaluate_config([])
    # typed overrides, not strings: a checkpoint path is a path whatever characters it holds
    checkpoint = str(cfg.checkpoint)
    source = Overrides([Override("checkpoint", checkpoint, checkpoint)] if settings.checkpoint else [])
    baseline = load_evaluate_config(source)  # the checkpoint's data and its recorded settings
    dataset = str(cfg.data.name)
    named = {"data": dataset} if dataset != str(baseline.data.name) else {}
    if named:
        baseline = load_evaluate_config(source + [Override("data", dataset, dataset),
                                                  Override("force_data", "true", True)])
    baseline.checkpoint, baseline.force_data = defaults.checkpoint, defaults.force_data  # the user's, if set
    changed = {**named, **changed_keys(baseline, cfg)}
    methods = ", ".join(settings.methods)
    alphas = command_line_value([alpha_label(a) for a in settings.alphas])
    keff = "" if settings.query_classes == [None] else \
        f", query_classes {command_line_value([query_classes_label(k) for k in settings.query_classes])}"
    lines = [f"evaluate: {methods} | {settings.ways}-way, shots {command_line_value(settings.shots)}{keff}, alphas "
             f"{alphas}, {settings.tasks} tasks per setting, {settings.queries} queries | {settings.features}"]
    if changed:  # written as typed on the command line: methods=[putm, simpleshot], force_data=true
        lines.append("settings changed from the defaults: "
                     + ", ".join(f"{k}={command_line_value(v)}" for k, v in changed.items()))
    return "\n".join(lines)


def run_evaluate(overrides: Sequence[str], log: Callable[[str], None] = print) -> list[SettingResult]:
    """Run ``evaluate.py`` with ``key=value`` overrides; returns one result per (method, shot, α)."""
    cfg = load_evaluate_config(overrides)
    settings = settings_from_config(cfg)
    summary = describe(cfg, settings)
    cfg.tasks = settings.tasks  # record the resolved values, not `auto`
    cfg.queries = settings.queries
    # the config is valid: now Lightning, the data and the features
    from pytorch_lightning.utilities import rank_zero_only

    from lightning_putm.data.episodes import check_episodes_possible
    from lightning_putm.evaluation.callback import FewShotEvaluationCallback
    from lightning_putm.evaluation.report import log_results_artifact
    from lightning_putm.evaluation.sources import build_feature_source, check_base_features
    from lightning_putm.evaluation.unem_default import resolve_unem_default, wants_default

    rank_zero = getattr(rank_zero_only, "rank", 0) == 0
    say = console(log) if rank_zero else (lambda _: None)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)  # "GPU available: ..." banners
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)  # Lightning internals
    callback = FewShotEvaluationCallback(settings, plots=settings.plots, plot_task=settings.plot_task, log=say)
    trainer = build_evaluation_trainer(settings, callback, say)  # bad trainer.* options fail here, before any output
    source = build_feature_source(cfg, settings, say)  # checks files and the checkpoint
    # a split with too few classes or images, or features a method refuses: errors before any output
    check_episodes_possible(source.labels, settings.ways, settings.shots, settings.queries, settings.alphas,
                            settings.tasks, settings.seed, source.class_names, query_classes=settings.query_classes)
    if source.features is not None:
        check_methods_accept(source.features, settings)  # e.g. negative features for PUTM's power transform
        check_base_features(settings, source.features.shape[1])
    if wants_default(settings):  # UNEM's learned=auto: fitted on the checkpoint's validation classes (cached)
        resolve_unem_default(settings, cfg.data, source, say)
    say(summary)
    auto_folder = settings.output_dir is None
    with output_folder(settings, say) as folder:
        settings.output_dir = folder
        cfg.output_dir = str(folder)
        callback.feature_cache, callback.config_yaml = source.cache, to_yaml(cfg)
        # unique and readable: the run folder's date and name, or the name and the time for a named folder
        wandb_name = f"{folder.parent.name}_{folder.name}" if auto_folder else \
            f"{settings.name}-{datetime.now():%Y-%m-%d_%H-%M-%S}"
        # the folder's W&B run: a re-run into the same output_dir (a resume) continues it, a new folder is a new run
        logger = build_logger(settings.logger, folder, settings.wandb, wandb_name, say, job_type="evaluate",
                              group=wandb_group(settings), config=to_container(cfg),
                              run_file=folder / WANDB_RUN_FILE, resume=True)
        try:
            if logger:
                trainer.logger = logger
            run_test_loop(trainer, source.module, source.datamodule, folder)
            if logger and rank_zero:
                log_results_artifact([logger], folder)
        except BaseException:  # also after an error: a W&B run left open would swallow this process's next logs
            finish_logger(logger, rank_zero)
            raise
        close_logger(logger, rank_zero, folder)
    return callback.results


def wandb_group(settings: EvaluationSettings) -> str | None:
    """The W&B group of an evaluation, so the evaluations of one model sit together: the checkpoint's run name
    (``<dataset>-<backbone>-<run>-<stage>``, see :func:`checkpoint_run_name`) or ``timm-<model>``; none for a
    feature file (its name does not say which model made it). ``wandb.group`` wins (a study sets it)."""
    if settings.timm_model is not None:
        return f"timm-{settings.timm_model}"
    return checkpoint_run_name(settings.checkpoint) if settings.checkpoint is not None else None


def close_logger(logger: Any, rank_zero: bool, folder: Path) -> None:
    """Close the logger of a finished evaluation, with SIGTERM held back meanwhile.

    Once the test loop is over Lightning has put back the default SIGTERM handler, so a SIGTERM then (a
    scheduler's time limit in the run's last second) would kill the process on the spot, silently, with the W&B
    run left unfinished although every result is on disk. Here the logger closes first; then a SIGTERM received
    meanwhile stops the command with one line (``InterruptedError``: exit status 143).
    """
    with signals_recorded((signal.SIGTERM,)) as received:
        finish_logger(logger, rank_zero)
    if received:
        raise InterruptedError(f"SIGTERM arrived as the evaluation finished; its results are complete in {folder}")


def run_test_loop(trainer: Any, module: Any, datamodule: Any, folder: Path) -> None:
    """``trainer.test``, with Ctrl-C turned back into a :class:`KeyboardInterrupt` that says how to resume, and
    SIGTERM into an :class:`InterruptedError` (exit status 143) that says the same.

    Ctrl-C and SIGTERM stop the extraction and the solvers within seconds, worker threads included
    (:func:`~lightning_putm.signals.stop_on_signals`). Lightning catches the interruption itself, ignores SIGINT
    from then on and calls ``exit(1)``: the command would end silently with a generic error code, and a study running
    it would never learn that its run was interrupted. Every setting finished before the interruption is already on
    disk (:mod:`~lightning_putm.evaluation.store`); the one in progress is solved again on resume.
    """
    handler = signal.getsignal(signal.SIGINT)
    try:
        with stop_on_signals():
            trainer.test(module, datamodule=datamodule, verbose=False)
    except SystemExit as exc:
        if not trainer.interrupted:
            raise
        if handler is not None:  # Lightning left SIGINT ignored: a second Ctrl-C must still stop this process
            signal.signal(signal.SIGINT, handler)
        kept = (f"the settings finished so far are kept in {folder}/settings: resume with "
                f"output_dir={shlex.quote(str(folder))}")
        if interrupting_signal(exc) == signal.SIGTERM or trainer.received_sigterm:
            raise InterruptedError(f"evaluation stopped: the process received a termination signal (SIGTERM); {kept}") \
                from None
        raise KeyboardInterrupt(f"evaluation stopped; {kept}") from None
