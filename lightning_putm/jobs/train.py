"""The ``train_backbone.py`` job: settings → per stage a datamodule, S2M2 module and Trainer → checkpoints.

The parts live in :mod:`lightning_putm.pretraining` (settings, module, stages, checkpoints); this module runs
the stages in order, writes each stage's ``config.yaml`` and turns Ctrl-C/SIGTERM into a clean stop.
"""

from __future__ import annotations

import logging
import signal
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_only

from lightning_putm.atomic import atomic_write_text
from lightning_putm.config import build_trainer, command_line_value, to_container, to_yaml
from lightning_putm.data.datamodule import FewShotDataModule
from lightning_putm.data.episodes import check_episodes_possible
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.loggers import console, finish_logger
from lightning_putm.pretraining.checkpoints import check_init_from, check_resume_checkpoint, init_from_checkpoint
from lightning_putm.pretraining.interruption import InterruptionCheckpoint, resume_point
from lightning_putm.pretraining.module import S2M2Module
from lightning_putm.pretraining.settings import (TrainSettings, load_train_config, recorded_data_config,
                                                 settings_from_config)
from lightning_putm.pretraining.stages import (StageResult, build_datamodule, build_module, build_stage_logger,
                                               build_stage_trainer, check_batch_fractions, interruption_message,
                                               precision_hint, resolve_run_folder, stopped_by)
from lightning_putm.signals import requested_signal, stop_on_signals, stop_requested
from lightning_putm.validators import path_hint


def run_train_backbone(overrides: Sequence[str], log: Callable[[str], None] = print) -> list[StageResult]:
    """Run every configured stage; returns where each stage's checkpoints went.

    Everything a user can get wrong is checked before the run folder exists or a logger starts: the config,
    ``init_from``, the backbone options (the first stage's module is built) and the Trainer options.

    Ctrl-C or SIGTERM at any moment raises ``KeyboardInterrupt`` (exit status 130 from the command line) with a
    message saying how to continue; checkpoint writes finish first (:mod:`lightning_putm.signals`), so
    ``last.ckpt`` is always a complete checkpoint of the last finished epoch. In the middle of an epoch the stop
    comes at the end of the training batch in progress, or within seconds in validation, and ``interrupted.ckpt``
    holds that point; ``resume=true`` continues from it (:mod:`lightning_putm.pretraining.interruption`).
    """
    with stop_on_signals():
        return _train_stages(overrides, log)


def check_episode_settings(datamodule: FewShotDataModule, settings: TrainSettings, has_val: bool) -> None:
    """The episodes of validation, of the final test and of ``fewshot_eval`` against the splits they are drawn
    from (enough classes and images), before the run folder exists; the error names the settings' key."""
    checks = []  # (key, split, ways, shots, queries, alphas, tasks, seed)
    drawn = {"val": has_val, "test": settings.run_test and datamodule.has_split("test")}  # splits with episodes
    for key, split in (("val_episodes", "val"), ("test_episodes", "test")):
        if drawn[split]:
            e = datamodule.episode_settings[split]
            checks.append((key, split, e.ways, [e.shots], e.queries, [e.alpha], e.tasks, e.seed))
    if (f := settings.fewshot_eval) is not None and has_val:
        checks.append(("fewshot_eval", "val", f.ways, f.shots, f.queries, f.alphas, f.tasks, f.seed))
    for key, split, *episodes in checks:
        data = datamodule.split(split)
        try:
            check_episodes_possible(data.labels, *episodes, data.class_names, key=f"{key}.queries")
        except (ConfigError, DataError) as exc:
            raise type(exc)(f"{key} ({split} split): {exc}") from exc


def _train_stages(overrides: Sequence[str], log: Callable[[str], None]) -> list[StageResult]:
    """The body of :func:`run_train_backbone` (which holds the SIGTERM handler around it)."""
    cfg = load_train_config(overrides)
    settings = settings_from_config(cfg)
    datamodule = build_datamodule(cfg, settings)
    datamodule.setup("fit")
    has_val = datamodule.has_split("val")
    rank_zero = getattr(rank_zero_only, "rank", 0) == 0  # from RANK / LOCAL_RANK set by the DDP launcher
    say = console(log) if rank_zero else (lambda _: None)
    if not cfg.get("verbose"):  # Lightning's per-stage banners and tips ("GPU available", "💡 Tip", ...)
        for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
            logging.getLogger(name).setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)
    say(("effective config:\n" + to_yaml(cfg)) if cfg.get("verbose") else
        f"train_backbone: {settings.dataset} / {settings.backbone}, stages {command_line_value(settings.stages)} "
        f"({', '.join(str(settings.epochs[s]) for s in settings.stages)} epochs)")
    train = datamodule.split("train")
    say(f"data: {settings.dataset} train {len(train)} images / {train.num_classes} classes; "
        f"val {len(datamodule.split('val'))} images" + ("" if has_val else " (no validation split: best = last)"))

    previous = settings.init_from
    if previous is not None and not previous.is_file():
        raise DataError(f"init_from={previous} does not exist; {path_hint(previous)}pass an existing checkpoint "
                        f"(e.g. {settings.stage_dir('rotation') / 'best.ckpt'})")
    data_config = recorded_data_config(cfg)
    pl.seed_everything(settings.seed, workers=True, verbose=False)  # stage 0's seed, before its weights are drawn
    first_module = build_module(settings, datamodule.in_channels, train.num_classes, 0, data_config)
    probe = build_trainer(settings.trainer, logger=False, enable_checkpointing=False, max_epochs=1)  # bad trainer.*
    check_batch_fractions(settings.trainer, datamodule, has_val)
    hint = precision_hint(probe.strategy.root_device.type, str(probe.precision))
    if hint:
        say(hint)
    if previous is not None:
        check_init_from(first_module, previous)  # another model's weights: refused before the run folder exists
    check_episode_settings(datamodule, settings, has_val)
    results: list[StageResult] = []
    testing = settings.run_test and datamodule.has_split("test")
    module: S2M2Module | None = None
    trainer: pl.Trainer | None = None
    with resolve_run_folder(settings, say) as folder:
        settings.run_folder = folder
        checked = None
        if settings.resume:  # the first stage's checkpoint: corrupt or another model's, refused before config.yaml
            checked = resume_point(settings.stage_dir(settings.stages[0]))
            assert checked is not None  # resolve_run_folder refused a run without one
            check_resume_checkpoint(first_module, checked)
        if rank_zero:
            atomic_write_text(folder / "config.yaml", to_yaml(cfg))
        say(f"run folder: {folder}")
        for index, stage in enumerate(settings.stages):
            if index == 0:
                module = first_module
            else:
                pl.seed_everything(settings.seed + index, workers=True, verbose=False)
                module = build_module(settings, datamodule.in_channels, train.num_classes, index, data_config)
            last = settings.stage_dir(stage) / "last.ckpt"
            resume_path = resume_point(settings.stage_dir(stage)) if settings.resume else None
            if resume_path is not None:
                if resume_path != checked:
                    check_resume_checkpoint(module, resume_path)  # corrupt, unsafe or another model's: a clear error
                say(f"[{stage}] resuming from {resume_path}")
            elif previous is not None:
                init_from_checkpoint(module, previous)
                say(f"[{stage}] starting from {previous}")
            logger = build_stage_logger(settings, stage, to_container(cfg), say)
            trainer = build_stage_trainer(settings, stage, has_val, logger, say)
            # the last stage's logger stays open for the final test: the test score belongs to that stage's run
            keep_open = testing and index == len(settings.stages) - 1
            trained = False
            start = time.perf_counter()
            try:
                trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_path) if resume_path else None,
                            weights_only=True)
                trained = True
            except MisconfigurationException as exc:  # e.g. limit_train_batches=0.001 of 11 batches: less than one
                raise ConfigError(f"stage {stage}: the Trainer refused its options: {' '.join(str(exc).split())}") \
                    from exc
            except SystemExit as exc:
                # Ctrl-C (or SIGTERM, see run_train_backbone): Lightning catches the KeyboardInterrupt, shuts down and
                # calls exit(1); last.ckpt (end of the last finished epoch) is intact
                if not trainer.interrupted:
                    raise
                earlier = previous if index > 0 else None  # resume=true needs the first stage's last.ckpt
                how = stopped_by(trainer, exc)
                saved = next((c for c in trainer.callbacks if isinstance(c, InterruptionCheckpoint)), None)
                point = (saved.path, *saved.point) if saved is not None and saved.point is not None else None
                raise KeyboardInterrupt(interruption_message(stage, last, folder, how, earlier, point)) from None
            finally:
                if not (trained and keep_open):
                    finish_logger(logger, rank_zero)
            if stop_requested():  # held until the stage ended (its last checkpoint's write): the stage is complete
                if trained and keep_open:
                    finish_logger(logger, rank_zero)
                how = "SIGTERM" if requested_signal() == signal.SIGTERM else "Ctrl-C"
                raise KeyboardInterrupt(interruption_message(stage, last, folder, how, None))
            seconds = time.perf_counter() - start
            if not last.is_file():  # a Trainer option ended the stage before any epoch (the usual ones are refused)
                finish_logger(logger, rank_zero)
                given = ", ".join(f"{k}={v}" for k, v in settings.trainer.items())
                raise ConfigError(f"stage {stage} ended without training an epoch, so it wrote no checkpoint; check "
                                  f"the trainer.* options ({given})")
            callback = trainer.checkpoint_callbacks[0]  # the best-by-val/acc one when there is validation
            best = Path(callback.best_model_path) if has_val and callback.best_model_path else last
            score = float(callback.best_model_score) if has_val and callback.best_model_score is not None else None
            results.append(StageResult(stage, last, best, score, seconds))
            if has_val and not callback.best_model_path:
                say(f"[{stage}] no epoch computed val/acc (validation did not cover the validation episodes, e.g. "
                    "trainer.limit_val_batches); best = last checkpoint")
            score_text = f", best val/acc {score:.2f}%" if score is not None else ""
            say(f"[{stage}] done in {seconds:.0f} s: last checkpoint {last}; best {best}{score_text}")
            previous = best
        if testing and module is not None and trainer is not None:
            try:
                outcome = trainer.test(module, datamodule=datamodule, ckpt_path=str(results[-1].best),
                                       weights_only=True, verbose=False)
            except SystemExit as exc:  # Ctrl-C while testing: the training is complete
                if not trainer.interrupted:
                    raise
                raise KeyboardInterrupt(f"test stopped ({stopped_by(trainer, exc)}); the training is complete, its "
                                        f"checkpoints are in {folder}") from None
            finally:  # the last stage's logger, kept open for this test
                finish_logger(trainer.logger, rank_zero)
            if outcome and "test/acc" in outcome[0]:
                t = settings.test_episodes
                kind = "balanced" if t.alpha is None else f"Dirichlet alpha={t.alpha:g}"
                say(f"test: {t.ways}-way {t.shots}-shot, {t.queries} queries ({kind}), {t.tasks} tasks, nearest "
                    f"class mean: {outcome[0]['test/acc']:.2f} ± {outcome[0]['test/ci95']:.2f}% "
                    f"({results[-1].best.name})")
    return results
