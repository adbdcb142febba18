"""One S2M2 stage's parts: its datamodule, module, logger and Trainer (atomic checkpoints, best/last callbacks,
the in-training few-shot validation), the run folder, and what a stopped stage tells the user."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig

from lightning_putm.config import build_trainer
from lightning_putm.data.datamodule import FewShotDataModule
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.evaluation.callback import FewShotEvaluationCallback
from lightning_putm.evaluation.progress import on_terminal
from lightning_putm.features.files import FeatureSet, save_features
from lightning_putm.features.table import scatter_rows
from lightning_putm.loggers import build_logger
from lightning_putm.pretraining.checkpoints import AtomicCheckpointIO, BestCheckpoint
from lightning_putm.pretraining.interruption import InterruptionCheckpoint, resume_point
from lightning_putm.pretraining.module import S2M2Module
from lightning_putm.pretraining.progress import EpochLines, StageProgressBar
from lightning_putm.pretraining.settings import TrainSettings
from lightning_putm.runs import LATEST, folder_locked, latest_run, point_latest, run_dir
from lightning_putm.signals import interrupting_signal
from lightning_putm.validators import integer, mapping, positive


def build_datamodule(cfg: DictConfig, settings: TrainSettings) -> FewShotDataModule:
    data = cfg.data
    return FewShotDataModule(
        settings.dataset,
        root=data.root,
        image_size=positive(data.image_size, "data.image_size", integer=True),
        batch_size=positive(data.batch_size, "data.batch_size", integer=True),
        eval_batch_size=positive(data.eval_batch_size, "data.eval_batch_size", integer=True),
        num_workers=integer(data.num_workers, "data.num_workers", 0),
        augment=mapping(data.augment, "data.augment"),
        normalize=mapping(data.normalize, "data.normalize") or None,
        eval_resize=float(positive(data.eval_resize, "data.eval_resize")),
        options=mapping(data.options, "data.options"),
        val_episodes=settings.val_episodes,
        test_episodes=settings.test_episodes,
        seed=settings.seed,
        loader=settings.loader,
        download=data.get("download", False),
    )


def build_stage_logger(settings: TrainSettings, stage: str, config: dict[str, Any],
                       log: Callable[[str], None] = print) -> Any:
    """The stage's logger: CSV in ``log_dir/<dataset>/<backbone>/<run>/<stage>`` (a resume appends to it), W&B
    (offline works without a key; the stages of a run share a group, ``job_type`` names the stage) or none.

    The stage's W&B run id is kept in the run folder (``wandb_run-<stage>.json``, beside ``config.yaml``; not in
    the stage's folder, which Lightning expects empty): ``resume=true`` continues that run; a stage trained afresh
    is a new run."""
    assert settings.run_folder is not None
    run = settings.run_folder.name
    group = f"{settings.dataset}-{settings.backbone}-{run}"
    return build_logger(settings.logger, settings.log_dir, settings.wandb, f"{group}-{stage}", log,
                        csv_name=f"{settings.dataset}/{settings.backbone}/{run}", csv_version=stage,
                        job_type=f"train-{stage}", group=group, config=config,
                        run_file=settings.run_folder / f"wandb_run-{stage}.json", resume=settings.resume)


def build_stage_trainer(settings: TrainSettings, stage: str, has_val: bool, logger: Any,
                        say: Callable[[str], None] = print) -> pl.Trainer:
    """A Trainer with ``trainer.*`` options, atomic checkpoint IO and the best/last checkpoint callbacks.

    Two callbacks: Lightning (2.6) refreshes ``save_last`` only in steps where a top-k checkpoint was written,
    which would leave ``last.ckpt`` stale once validation accuracy stops improving. ``best`` comes first so the
    ``last.ckpt`` written after it carries the updated best score for resuming. ``last.ckpt`` is written at the end
    of every training epoch whatever the validation schedule (``check_val_every_n_epoch``, ``val_check_interval``),
    so it always holds a finished epoch to resume from. ``best`` skips epochs without ``val/acc`` (see
    :class:`BestCheckpoint`). Ctrl-C or SIGTERM in the middle of an epoch leaves ``interrupted.ckpt``, the point
    reached (:class:`~lightning_putm.pretraining.interruption.InterruptionCheckpoint`).
    """
    from pytorch_lightning.callbacks import ModelCheckpoint

    folder = str(settings.stage_dir(stage))
    callbacks: list[pl.Callback] = []
    if has_val:
        callbacks.append(BestCheckpoint(dirpath=folder, filename="best", monitor="val/acc", mode="max", save_top_k=1,
                                        auto_insert_metric_name=False, enable_version_counter=False))
    callbacks.append(ModelCheckpoint(dirpath=folder, filename="last", monitor=None, save_top_k=1, every_n_epochs=1,
                                     save_on_train_epoch_end=True, enable_version_counter=False))
    callbacks.append(InterruptionCheckpoint(folder))
    extra: dict[str, Any] = {}
    if settings.trainer.get("enable_progress_bar", True) not in (False, 0):
        if "enable_progress_bar" in settings.trainer or on_terminal():
            callbacks.append(StageProgressBar(stage))
        else:  # piped or logged to a file: plain lines, not a bar's redraws
            callbacks.append(EpochLines(stage, say))
            extra["enable_progress_bar"] = False
    if settings.fewshot_every is not None and has_val:
        fewshot = replace(settings.fewshot_eval, output_dir=settings.fewshot_eval.output_dir / stage)
        split = settings.fewshot_base_split
        base = None if split is None else SplitFeatures(split, fewshot.output_dir / f"base_features_{split}.pt")
        callbacks.append(FewShotEvaluationCallback(fewshot, every_n_val_epochs=settings.fewshot_every, plots=False,
                                                   run_at_test=False, base_features_from=base, log=say))
    return build_trainer(settings.trainer, max_epochs=settings.epochs[stage], logger=logger, callbacks=callbacks,
                         plugins=[AtomicCheckpointIO()], enable_checkpointing=True, **extra)


class SplitFeatures:
    """The features of a split (``train``: the base classes) with the weights being trained, for CL2N in the
    in-training few-shot check; a callable for ``FewShotEvaluationCallback(base_features_from=...)``.

    SimpleShot, BD-CSPN, LaplacianShot and BAVARDAGE centre the features on the mean of the base classes the
    backbone was trained on. During training that mean moves with the weights, so it is taken at every check: the
    split is passed once through the backbone in eval mode with the evaluation transform (as ``evaluate.py``'s
    ``base_features=split:train`` extracts it from a checkpoint). The features of the epoch's training batches
    would not do: they are augmented (and mixed up in ``s2m2r``) and come from weights that changed during the
    epoch. The file is rewritten at each check (atomically), each process extracting its shard.
    """

    def __init__(self, split: str, path: Path) -> None:
        self.split = split
        self.path = path

    def __call__(self, trainer: pl.Trainer, module: pl.LightningModule) -> Path:
        datamodule: FewShotDataModule = trainer.datamodule
        world = trainer.world_size
        loader = datamodule.eval_loader(self.split, shard=(trainer.global_rank, world) if world > 1 else None)
        rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), trainer.precision_plugin.val_step_context():
                for images, labels, indices in loader:
                    rows.append((module(images.to(module.device)).float(), labels.to(module.device),
                                 indices.to(module.device)))
        finally:
            module.train(was_training)
        data = datamodule.split(self.split)
        features, labels, indices = (torch.cat([r[i] for r in rows]) for i in range(3))
        table, label_table, _ = scatter_rows(len(data), indices, features, labels,
                                             all_gather=module.all_gather if world > 1 else None)
        feature_set = FeatureSet(table.cpu(), label_table.cpu(), list(data.class_names),
                                 {"source": f"{datamodule.dataset_name}/{self.split} at epoch "
                                            f"{trainer.current_epoch + 1}"})
        if trainer.is_global_zero:
            save_features(feature_set, self.path)
        trainer.strategy.barrier()  # every process reads the file
        return self.path


@dataclass
class StageResult:
    stage: str
    last: Path
    best: Path
    best_score: float | None
    seconds: float


def check_batch_fractions(trainer_args: dict[str, Any], datamodule: FewShotDataModule, has_val: bool) -> None:
    """A fraction ``trainer.limit_{train,val}_batches`` below one batch of the split, refused before the run folder
    exists (Lightning refuses it only when the stage starts, by the same rule: ``int(fraction × batches) == 0``)."""
    loaders = {"train": [datamodule.train_dataloader()]}
    if has_val:
        val = datamodule.val_dataloader()
        loaders["val"] = val if isinstance(val, list) else [val]
    for mode, split_loaders in loaders.items():
        value = trainer_args.get(f"limit_{mode}_batches")
        if not isinstance(value, float) or value <= 0:
            continue
        for loader in split_loaders:
            batches = len(loader)
            if batches and int(value * batches) == 0:
                raise ConfigError(f"trainer.limit_{mode}_batches={value} is less than one of the {batches} {mode} "
                                  f"batches; use at least {1 / batches:.4g}, or a whole number of batches (e.g. "
                                  f"trainer.limit_{mode}_batches=1)")


def resolve_run_folder(settings: TrainSettings,
                       log: Callable[[str], None] = print) -> contextlib.AbstractContextManager[Path]:
    """The run's folder: ``resume=true`` continues ``run`` (default: the latest run), ``run=<name>`` names a new
    folder (one holding checkpoints is refused: nothing is overwritten), otherwise a new ``<date>_<time>`` folder;
    ``latest`` points at the folder in use. The folder is locked while the run lasts
    (:func:`~lightning_putm.runs.folder_locked`): a ``resume=true`` of a run that is still training is refused."""
    root = settings.runs_root()
    first = settings.stages[0]
    if settings.resume:
        folder = root / settings.run if settings.run else latest_run(root)
        if folder is None or resume_point(folder / first) is None:
            where = folder / first / "last.ckpt" if folder is not None else root / LATEST
            raise DataError(f"resume=true but there is no {where} to resume from; run without resume=true (or check "
                            "checkpoint_dir, run, data and backbone)")
        return folder_locked(folder, f"resume=true run={folder.name} ({folder})", log)
    if settings.run:
        folder = root / settings.run
        held = sorted(folder.glob("*/*.ckpt"))
        if held:  # a new training would overwrite them, and a stop before its first epoch would point at them
            raise DataError(f"run={settings.run} already holds a training run ({held[0]}): continue it with "
                            "resume=true, or give another run name (or delete the folder to start it over)")
        folder.mkdir(parents=True, exist_ok=True)
        return _locked_then_latest(root, folder, f"run={settings.run} ({folder})", log)
    return _new_locked_run(root, log)


@contextlib.contextmanager
def _locked_then_latest(root: Path, folder: Path, what: str, log: Callable[[str], None]) -> Iterator[Path]:
    """``folder`` locked, and only then ``latest`` pointed at it (a refused run moves nothing)."""
    with folder_locked(folder, what, log):
        point_latest(root, folder)
        yield folder


@contextlib.contextmanager
def _new_locked_run(root: Path, log: Callable[[str], None]) -> Iterator[Path]:
    """A new ``<date>_<time>`` run folder, locked (a later ``resume=true`` while it trains is refused)."""
    with run_dir(root, "", flat=True) as folder, folder_locked(folder, f"run={folder.name} ({folder})", log):
        yield folder


def stopped_by(trainer: pl.Trainer, exit_: BaseException) -> str:
    """``SIGTERM`` or ``Ctrl-C``: what ended the Trainer call that exited with ``exit_`` (or the stop itself).

    Lightning turns a KeyboardInterrupt into ``exit(1)`` (the interrupt is the exit's context); its own SIGTERM
    handler, where ours is not installed, raises a ``SystemExit`` subclass and sets ``received_sigterm``.
    """
    sigterm = interrupting_signal(exit_) == signal.SIGTERM or bool(getattr(trainer, "received_sigterm", False))
    return "SIGTERM" if sigterm else "Ctrl-C"


def interruption_message(stage: str, last: Path, folder: Path, how: str, restart_from: Path | None,
                         interrupted: tuple[Path, int, int] | None = None) -> str:
    """What a stopped training tells the user: which signal (``how``), which stage, and how to continue.
    ``interrupted``: the checkpoint of the point reached, its epoch and the batches of that epoch it holds."""
    if interrupted is not None:
        path, epoch, batches = interrupted
        return (f"training stopped in stage {stage} ({how}) in epoch {epoch} after {batches} training batches; "
                f"{path} holds that point: continue from it with resume=true run={folder.name}")
    if last.is_file():
        return (f"training stopped in stage {stage} ({how}); {last} holds the last finished epoch: continue with "
                f"resume=true run={folder.name}")
    if restart_from is not None:
        return (f"training stopped in stage {stage} ({how}) before its first epoch finished; resume=true "
                f"run={folder.name} starts it again from {restart_from}")
    return (f"training stopped in stage {stage} ({how}) before its first epoch finished: there is no checkpoint to "
            "resume from; run the command again without resume=true")


def precision_hint(device_type: str, precision: str) -> str | None:
    """A one-line recommendation when a GPU trains in full fp32 (the default, kept for exact CPU results)."""
    if device_type == "cuda" and precision in ("32-true", "32"):
        return ("tip: training on CUDA in fp32; trainer.precision=bf16-mixed is faster on Ampere or newer GPUs "
                "(16-mixed on older ones); see docs/gpu.md")
    return None


def build_module(settings: TrainSettings, in_channels: int, num_classes: int, index: int,
                 data_config: dict[str, Any]) -> S2M2Module:
    """The S2M2 module of stage ``index``; a backbone option it cannot use is a :class:`ConfigError`."""
    try:
        return S2M2Module(backbone=settings.backbone, backbone_options=settings.backbone_options,
                          in_channels=in_channels, num_classes=num_classes, stage=settings.stages[index],
                          seed=settings.seed + index, data_config=data_config, **settings.module_args)
    except (TypeError, ValueError, RuntimeError) as exc:  # e.g. backbone.width=abc or -3
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"cannot build the {settings.backbone} backbone with options {settings.backbone_options} "
                          f"({type(exc).__name__}: {exc}); check the backbone.<key> values against "
                          f"conf/backbone/{settings.backbone}.yaml") from exc
