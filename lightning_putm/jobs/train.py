"""The ``train_backbone.py`` job: config → datamodule, S2M2 module and Trainer per stage → checkpoints.

Config: ``conf/train_backbone.yaml``; ``data=<name>`` picks ``conf/data/<name>.yaml`` and ``backbone=<name>``
picks ``conf/backbone/<name>.yaml`` (both peeled off the overrides before the rest is applied, so
``data.root=...`` and ``backbone.dropout=...`` are checked against the chosen files). ``trainer.<arg>=value``
accepts any argument of ``pytorch_lightning.Trainer`` (checked against its signature) except the few this job
owns (logger, callbacks, plugins, checkpointing).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, ListConfig, OmegaConf
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.utilities import rank_zero_only

from lightning_putm.atomic import atomic_write_text
from lightning_putm.callbacks import FewShotEvaluationCallback
from lightning_putm.checkpoints import AtomicCheckpointIO, BestCheckpoint
from lightning_putm.config import (apply_overrides, apply_trainer_overrides, build_trainer, command_line_value, conf_dir,
                                    load_group,
                                   load_saved_config,
                                   load_yaml, peel_override, split_override, split_trainer_overrides, to_container,
                                   to_yaml)
from lightning_putm.data.datamodule import EpisodeSettings, FewShotDataModule, LoaderSettings
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.evaluation.progress import format_duration, on_terminal
from lightning_putm.evaluation.settings import EvaluationSettings, load_evaluate_config
from lightning_putm.evaluation.settings import settings_from_config as evaluation_settings
from lightning_putm.loggers import build_logger, console, finish_logger
from lightning_putm.pretrain import (STAGES, S2M2Module, check_channels_last, check_compile,
                                     check_resume_checkpoint, init_from_checkpoint)
from lightning_putm.runs import LATEST, latest_run, point_latest, run_dir, slug
from lightning_putm.signals import Terminated, sigterm_as_interrupt
from lightning_putm.validators import (choice, did_you_mean, flag, integer, mapping, number, parse_alpha, path,
                                       positive)

#: Trainer arguments this job sets itself; use the named config keys instead.
RESERVED_TRAINER_ARGS = {
    "logger": "use logger=csv|wandb|none",
    "callbacks": "checkpointing callbacks are built from checkpoint_dir",
    "plugins": "the checkpoint IO plugin is fixed (atomic writes, weights_only reads)",
    "enable_checkpointing": "checkpoints are always written to checkpoint_dir",
    "default_root_dir": "use checkpoint_dir and log_dir",
}


# --------------------------------------------------------------------------------------------- config
def load_train_config(overrides: Sequence[str] = ()) -> DictConfig:
    """``conf/train_backbone.yaml`` + the chosen data and backbone files + overrides (unknown keys are errors)."""
    overrides = list(overrides)
    saved_path, overrides = peel_override(overrides, "config")
    data_name, overrides = peel_override(overrides, "data")
    backbone_name, overrides = peel_override(overrides, "backbone")
    saved = None
    if saved_path is not None:  # re-run a recorded run: its config.yaml is the base, overrides still apply
        if not Path(saved_path).is_file():
            raise ConfigError(f"config={saved_path}: file not found; give the config.yaml saved in a run folder")
        saved = load_yaml(Path(saved_path))
        data_name = data_name or OmegaConf.select(saved, "data.name")
        backbone_name = backbone_name or OmegaConf.select(saved, "backbone.name")
    trainer_overrides, overrides = split_trainer_overrides(overrides)
    for text in overrides:
        if split_override(text)[0] in ("data.name", "backbone.name"):
            raise ConfigError(f"{text!r}: choose the dataset with data=<name> and the backbone with backbone=<name>")

    cfg = load_yaml(conf_dir() / "train_backbone.yaml")
    data_name = data_name or str(cfg.data)
    data = load_group("data", data_name)
    backbone_name = backbone_name or str(cfg.backbone)
    if backbone_name == "auto":
        backbone_name = str(data.get("backbone"))
    backbone = load_group("backbone", backbone_name)
    cfg.data = OmegaConf.merge({"name": data_name}, data)
    cfg.backbone = OmegaConf.merge({"name": backbone_name}, backbone)
    if saved_path is not None:
        cfg = load_saved_config(saved_path, cfg)
        cfg.run = "auto"  # a re-run gets its own run folder (run=<name> to choose one)
    cfg = apply_overrides(cfg, overrides)
    return apply_trainer_overrides(cfg, trainer_overrides, RESERVED_TRAINER_ARGS, "train_backbone.py")


@dataclass
class TrainSettings:
    """Validated values of the merged config."""

    dataset: str
    backbone: str
    backbone_options: dict[str, Any]
    stages: list[str]
    epochs: dict[str, int]
    init_from: Path | None
    resume: bool
    checkpoint_dir: Path
    run: str | None  # None = a new run folder; else that folder (resume=true without a name: the latest run)
    seed: int
    module_args: dict[str, Any]
    val_episodes: EpisodeSettings
    test_episodes: EpisodeSettings
    run_test: bool
    logger: str
    log_dir: Path
    wandb: dict[str, Any]
    trainer: dict[str, Any]
    loader: LoaderSettings = LoaderSettings()
    fewshot_eval: EvaluationSettings | None = None  # settings of the periodic PUTM/peer evaluation, or None
    fewshot_every: int | None = None

    run_folder: Path | None = None  # resolved by the job: <checkpoint_dir>/<dataset>/<backbone>/<run>

    def runs_root(self) -> Path:
        """``<checkpoint_dir>/<dataset>/<backbone>``: one folder per run, ``latest`` points at the newest."""
        return (self.checkpoint_dir / self.dataset / self.backbone).absolute()

    def stage_dir(self, stage: str) -> Path:
        folder = self.run_folder if self.run_folder is not None else self.runs_root() / LATEST
        return folder / stage


def _check_backbone_options(options: dict[str, Any], name: str) -> None:
    """Each ``backbone.<key>`` must have the kind of its default in ``conf/backbone/<name>.yaml``: counts and sizes
    positive integers (``backbone.width=0`` would build a network that divides by zero), rates numbers in [0, 1)."""
    defaults = load_group("backbone", name)
    for key, value in options.items():
        default, where = defaults.get(key), f"backbone.{key}"
        if isinstance(default, bool):
            flag(value, where)
        elif isinstance(default, int):
            positive(value, where, integer=True)
        elif isinstance(default, float):
            if number(value, where) >= 1.0:
                raise ConfigError(f"`{where}` must be a rate in [0, 1), got {value!r}")
        elif isinstance(default, ListConfig):
            if not isinstance(value, list) or not value:
                raise ConfigError(f"`{where}` must be a list like {list(default)}, got {value!r}")
            for item in value:
                positive(item, where, integer=True)


def _episodes(cfg: DictConfig, key: str) -> EpisodeSettings:
    node = cfg[key]
    alpha = None if node.alpha is None else parse_alpha(node.alpha, f"`{key}.alpha`")
    values = {k: positive(node[k], f"{key}.{k}", integer=True) for k in ("ways", "shots", "queries", "tasks")}
    return EpisodeSettings(alpha=alpha, seed=integer(node.seed, f"{key}.seed", 0), **values)


def settings_from_config(cfg: DictConfig) -> TrainSettings:
    chosen = cfg.data.get("stages", ["rotation", "s2m2r"]) if cfg.stages == "auto" else cfg.stages
    stages = chosen if not isinstance(chosen, str) else [chosen]
    stages = [str(s) for s in stages] if isinstance(stages, ListConfig) else [repr(stages)]
    if not stages or any(s not in STAGES for s in stages):
        wrong = next((s for s in stages if s not in STAGES), "")
        hint = did_you_mean(wrong, STAGES).strip()
        raise ConfigError(f"`stages` must list stages among {', '.join(STAGES)}, got {stages}"
                          + (f"; {hint}" if hint else ""))
    epochs_cfg = to_container(cfg.data.epochs)
    max_epochs = cfg.trainer.get("max_epochs")
    epochs = {}
    for stage in stages:
        value = max_epochs if max_epochs is not None else epochs_cfg.get(stage)
        if value is None:
            raise ConfigError(f"no epoch count for stage {stage!r}: set data.epochs.{stage} or trainer.max_epochs")
        epochs[stage] = positive(value, "trainer.max_epochs" if max_epochs is not None else f"data.epochs.{stage}",
                                  integer=True)
    scale = cfg.head.scale
    head_scale = None if scale in (None, "auto") else float(positive(scale, "head.scale"))
    choice(cfg.logger, "logger", ("csv", "wandb", "none"))
    seed = integer(cfg.seed, "seed", 0)
    mix_layers = cfg.mix_layers if not isinstance(cfg.mix_layers, int) else [cfg.mix_layers]
    if (not isinstance(mix_layers, (list, ListConfig)) or not mix_layers
            or any(isinstance(m, bool) or not isinstance(m, int) for m in mix_layers)):
        raise ConfigError(f"`mix_layers` must be a non-empty list of layer indices (0 = input, i = after block i), "
                          f"e.g. mix_layers=[0,1,2,3]; got {cfg.mix_layers!r}")
    mix_layers = [int(m) for m in mix_layers]
    backbone_options = {k: v for k, v in to_container(cfg.backbone).items() if k != "name"}
    _check_backbone_options(backbone_options, str(cfg.backbone.name))
    trainer = {k: v for k, v in to_container(cfg.trainer).items() if k != "max_epochs"}
    _check_trainer_writes_checkpoints(trainer)
    check_compile(cfg.compile, "compile")  # false | true | a torch.compile backend name
    return TrainSettings(
        dataset=str(cfg.data.name),
        backbone=str(cfg.backbone.name),
        backbone_options=backbone_options,
        stages=stages,
        epochs=epochs,
        init_from=path(cfg.init_from, "init_from") if cfg.init_from else None,
        resume=flag(cfg.resume, "resume"),
        checkpoint_dir=path(cfg.checkpoint_dir, "checkpoint_dir"),
        run=None if cfg.run in (None, "", "auto") else slug(str(cfg.run)),
        seed=seed,
        module_args={
            "lr": float(positive(cfg.lr, "lr")),
            "weight_decay": number(cfg.weight_decay, "weight_decay"),
            "scheduler": str(cfg.scheduler),
            "mixup_alpha": float(positive(cfg.mixup_alpha, "mixup_alpha")),
            "mix_layers": mix_layers,
            "head_scale": head_scale,
            "class_gain": flag(cfg.head.class_gain, "head.class_gain"),
            "ncm_normalise": str(cfg.ncm),
            "channels_last": check_channels_last(cfg.channels_last, "channels_last"),
            "compile": cfg.compile,
        },
        val_episodes=_episodes(cfg, "val_episodes"),
        test_episodes=_episodes(cfg, "test_episodes"),
        run_test=flag(cfg.run_test, "run_test"),
        logger=str(cfg.logger),
        log_dir=path(cfg.log_dir, "log_dir"),
        wandb=mapping(cfg.wandb, "wandb"),
        trainer=trainer,
        loader=_loader_settings(cfg),
        fewshot_every=_fewshot_every(cfg),
        fewshot_eval=_fewshot_settings(cfg),
    )


def _check_trainer_writes_checkpoints(trainer: dict[str, Any]) -> None:
    """Refuse, before anything starts, the Trainer options under which a stage would end without a checkpoint."""
    if trainer.get("fast_dev_run") not in (None, False, 0):
        raise ConfigError(f"trainer.fast_dev_run={trainer['fast_dev_run']} writes no checkpoint, and checkpoints are "
                          "what train_backbone.py is for; for a quick trial use trainer.max_epochs=1 "
                          "trainer.limit_train_batches=2")
    for name in ("limit_train_batches", "max_steps"):  # Lightning would skip the training
        value = trainer.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            raise ConfigError(f"trainer.{name}={value} trains nothing, so no checkpoint would be written; give a "
                              f"positive value or leave trainer.{name} out")


def _loader_settings(cfg: DictConfig) -> LoaderSettings:
    """``loader.*``: each ``auto`` or a value of its kind (checked by :class:`LoaderSettings`)."""
    node = mapping(cfg.loader, "loader")
    unknown = sorted(set(node) - set(LoaderSettings.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"unknown key(s) loader.{', loader.'.join(unknown)}; loader keys: "
                          f"{', '.join(LoaderSettings.__dataclass_fields__)}")
    return LoaderSettings(**node)


def _fewshot_every(cfg: DictConfig) -> int | None:
    every = cfg.fewshot_eval.every_n_epochs
    return None if every is None else int(positive(every, "fewshot_eval.every_n_epochs", integer=True))


def _fewshot_settings(cfg: DictConfig) -> EvaluationSettings | None:
    """Settings of the periodic few-shot evaluation on the validation split (evaluate.py's validation rules)."""
    if cfg.fewshot_eval.every_n_epochs is None:
        return None
    node = cfg.fewshot_eval
    overrides = [f"methods={list(node.methods)}".replace("'", ""), f"shots={list(node.shots)}",
                 f"alphas={list(node.alphas)}".replace("'", ""), f"tasks={node.tasks}",
                 f"ways={cfg.val_episodes.ways}", f"queries={cfg.val_episodes.queries}", f"seed={cfg.val_episodes.seed}",
                 "split=val", "progress=false", f"output_dir={Path(str(cfg.log_dir)) / 'fewshot' / str(cfg.data.name)}",
                 *[str(o) for o in (node.overrides or [])]]
    try:
        return evaluation_settings(load_evaluate_config(overrides))
    except ConfigError as exc:
        raise ConfigError(f"fewshot_eval: {exc}") from exc


# --------------------------------------------------------------------------------------------- building blocks
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
    (offline works without a key; the stages of a run share a group, ``job_type`` names the stage) or none."""
    assert settings.run_folder is not None
    run = settings.run_folder.name
    group = f"{settings.dataset}-{settings.backbone}-{run}"
    return build_logger(settings.logger, settings.log_dir, settings.wandb, f"{group}-{stage}", log,
                        csv_name=f"{settings.dataset}/{settings.backbone}/{run}", csv_version=stage,
                        job_type=f"train-{stage}", group=group, config=config)


class StageProgressBar(TQDMProgressBar):
    """Lightning's progress bar with the stage and epoch (``[classifier] epoch 3/40``) and without ``v_num``:
    the logger's version, which here is the stage name cut to its last four letters (``v_num=fier``)."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        epoch = f"[{self.stage}] epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"
        self.train_progress_bar.set_description(epoch)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class EpochLines(pl.Callback):
    """One plain line per finished epoch where the output is not a terminal (a pipe, ``| tee``, a job log), instead
    of a progress bar whose carriage-return redraws would leave fragments there:
    ``[classifier] epoch 3/40: train/loss 1.0700, val/acc 99.60 (4 s; stage 0:12, ETA 2:28)``."""

    def __init__(self, stage: str, say: Callable[[str], None] = print) -> None:
        self.stage, self.say = stage, say
        self.started = self.epoch_started = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_started = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        now, done = time.perf_counter(), trainer.current_epoch + 1
        metrics = trainer.callback_metrics
        shown = [f"{name.removesuffix('_epoch')} {float(metrics[name]):.{2 if 'acc' in name else 4}f}"
                 for name in ("train/loss_epoch", "val/acc") if name in metrics]
        elapsed = now - self.started
        left = elapsed / done * max(0, trainer.max_epochs - done) if trainer.max_epochs and trainer.max_epochs > 0 else 0
        self.say(f"[{self.stage}] epoch {done}/{trainer.max_epochs}: {', '.join(shown) or 'done'} "
                 f"({now - self.epoch_started:.0f} s; stage {format_duration(elapsed)}, ETA {format_duration(left)})")


def build_stage_trainer(settings: TrainSettings, stage: str, has_val: bool, logger: Any,
                        say: Callable[[str], None] = print) -> pl.Trainer:
    """A Trainer with ``trainer.*`` options, atomic checkpoint IO and the best/last checkpoint callbacks.

    Two callbacks: Lightning (2.6) refreshes ``save_last`` only in steps where a top-k checkpoint was written,
    which would leave ``last.ckpt`` stale once validation accuracy stops improving. ``best`` comes first so the
    ``last.ckpt`` written after it carries the updated best score for resuming. ``last.ckpt`` is written at the end
    of every training epoch whatever the validation schedule (``check_val_every_n_epoch``, ``val_check_interval``),
    so it always holds a finished epoch to resume from. ``best`` skips epochs without ``val/acc`` (see
    :class:`BestCheckpoint`).
    """
    from pytorch_lightning.callbacks import ModelCheckpoint

    folder = str(settings.stage_dir(stage))
    callbacks: list[pl.Callback] = []
    if has_val:
        callbacks.append(BestCheckpoint(dirpath=folder, filename="best", monitor="val/acc", mode="max", save_top_k=1,
                                        auto_insert_metric_name=False, enable_version_counter=False))
    callbacks.append(ModelCheckpoint(dirpath=folder, filename="last", monitor=None, save_top_k=1, every_n_epochs=1,
                                     save_on_train_epoch_end=True, enable_version_counter=False))
    extra: dict[str, Any] = {}
    if settings.trainer.get("enable_progress_bar", True) not in (False, 0):
        if "enable_progress_bar" in settings.trainer or on_terminal():
            callbacks.append(StageProgressBar(stage))
        else:  # piped or logged to a file: plain lines, not a bar's redraws
            callbacks.append(EpochLines(stage, say))
            extra["enable_progress_bar"] = False
    if settings.fewshot_every is not None and has_val:
        fewshot = replace(settings.fewshot_eval, output_dir=settings.fewshot_eval.output_dir / stage)
        callbacks.append(FewShotEvaluationCallback(fewshot, every_n_val_epochs=settings.fewshot_every, plots=False,
                                                   run_at_test=False))
    return build_trainer(settings.trainer, max_epochs=settings.epochs[stage], logger=logger, callbacks=callbacks,
                         plugins=[AtomicCheckpointIO()], enable_checkpointing=True, **extra)


# --------------------------------------------------------------------------------------------- the job
@dataclass
class StageResult:
    stage: str
    last: Path
    best: Path
    best_score: float | None
    seconds: float


#: The ``data.*`` keys a checkpoint records: what its evaluation must use to see the same kind of images.
DATA_KEYS_RECORDED = ("name", "root", "image_size", "normalize", "eval_resize", "options")


def recorded_data_config(cfg: DictConfig) -> dict[str, Any]:
    return {key: to_container(cfg.data)[key] for key in DATA_KEYS_RECORDED if key in cfg.data}


def resolve_run_folder(settings: TrainSettings) -> contextlib.AbstractContextManager[Path]:
    """The run's folder: ``resume=true`` continues ``run`` (default: the latest run), ``run=<name>`` reuses that
    folder, otherwise a new ``<date>_<time>`` folder; ``latest`` points at the folder in use."""
    root = settings.runs_root()
    first = settings.stages[0]
    if settings.resume:
        folder = root / settings.run if settings.run else latest_run(root)
        if folder is None or not (folder / first / "last.ckpt").is_file():
            where = folder / first / "last.ckpt" if folder is not None else root / LATEST
            raise DataError(f"resume=true but there is no {where} to resume from; run without resume=true (or check "
                            "checkpoint_dir, run, data and backbone)")
        return contextlib.nullcontext(folder)
    if settings.run:
        folder = root / settings.run
        folder.mkdir(parents=True, exist_ok=True)
        point_latest(root, folder)
        return contextlib.nullcontext(folder)
    return run_dir(root, "", flat=True)


def stopped_by(trainer: pl.Trainer, exit_: SystemExit) -> str:
    """``SIGTERM`` or ``Ctrl-C``: what ended the Trainer call that exited with ``exit_``.

    Lightning turns a KeyboardInterrupt into ``exit(1)`` (the interrupt is the exit's context); its own SIGTERM
    handler, where ours is not installed, raises a ``SystemExit`` subclass and sets ``received_sigterm``.
    """
    sigterm = isinstance(exit_.__context__, Terminated) or bool(getattr(trainer, "received_sigterm", False))
    return "SIGTERM" if sigterm else "Ctrl-C"


def interruption_message(stage: str, last: Path, folder: Path, how: str, restart_from: Path | None) -> str:
    """What a stopped training tells the user: which signal (``how``), which stage, and how to continue."""
    if last.is_file():
        return (f"training stopped in stage {stage} ({how}); {last} holds the last finished epoch: continue with "
                f"resume=true run={folder.name}")
    if restart_from is not None:
        return (f"training stopped in stage {stage} ({how}) before its first epoch finished; resume=true "
                f"run={folder.name} starts it again from {restart_from}")
    return (f"training stopped in stage {stage} ({how}) before its first epoch finished: there is no checkpoint to "
            "resume from; run the command again without resume=true")


def run_train_backbone(overrides: Sequence[str], log: Callable[[str], None] = print) -> list[StageResult]:
    """Run every configured stage; returns where each stage's checkpoints went.

    Everything a user can get wrong is checked before the run folder exists or a logger starts: the config,
    ``init_from``, the backbone options (the first stage's module is built) and the Trainer options.

    Ctrl-C or SIGTERM at any moment raises ``KeyboardInterrupt`` (exit status 130 from the command line) with a
    message saying how to continue; checkpoint writes finish first (:mod:`lightning_putm.signals`), so
    ``last.ckpt`` is always a complete checkpoint of the last finished epoch.
    """
    with sigterm_as_interrupt():
        return _train_stages(overrides, log)


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
        raise DataError(f"init_from={previous} does not exist; pass an existing checkpoint (e.g. "
                        f"{settings.stage_dir('rotation') / 'best.ckpt'})")
    data_config = recorded_data_config(cfg)
    pl.seed_everything(settings.seed, workers=True, verbose=False)  # stage 0's seed, before its weights are drawn
    first_module = build_module(settings, datamodule.in_channels, train.num_classes, 0, data_config)
    probe = build_trainer(settings.trainer, logger=False, enable_checkpointing=False, max_epochs=1)  # bad trainer.*
    hint = precision_hint(probe.strategy.root_device.type, str(probe.precision))
    if hint:
        say(hint)
    results: list[StageResult] = []
    module: S2M2Module | None = None
    trainer: pl.Trainer | None = None
    with resolve_run_folder(settings) as folder:
        settings.run_folder = folder
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
            resume_path = last if settings.resume and last.is_file() else None
            if resume_path is not None:
                check_resume_checkpoint(module, resume_path)  # corrupt, unsafe or another model's: a clear error
                say(f"[{stage}] resuming from {resume_path}")
            elif previous is not None:
                init_from_checkpoint(module, previous)
                say(f"[{stage}] starting from {previous}")
            logger = build_stage_logger(settings, stage, to_container(cfg), say)
            trainer = build_stage_trainer(settings, stage, has_val, logger, say)
            start = time.perf_counter()
            try:
                trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_path) if resume_path else None,
                            weights_only=True)
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
                raise KeyboardInterrupt(interruption_message(stage, last, folder, how, earlier)) from None
            finally:
                finish_logger(logger, rank_zero)
            seconds = time.perf_counter() - start
            if not last.is_file():  # a Trainer option ended the stage before any epoch (the usual ones are refused)
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
        if settings.run_test and module is not None and trainer is not None and datamodule.has_split("test"):
            try:
                outcome = trainer.test(module, datamodule=datamodule, ckpt_path=str(results[-1].best),
                                       weights_only=True, verbose=False)
            except SystemExit as exc:  # Ctrl-C while testing: the training is complete
                if not trainer.interrupted:
                    raise
                raise KeyboardInterrupt(f"test stopped ({stopped_by(trainer, exc)}); the training is complete, its "
                                        f"checkpoints are in {folder}") from None
            if outcome and "test/acc" in outcome[0]:
                t = settings.test_episodes
                kind = "balanced" if t.alpha is None else f"Dirichlet alpha={t.alpha:g}"
                say(f"test: {t.ways}-way {t.shots}-shot, {t.queries} queries ({kind}), {t.tasks} tasks, nearest "
                    f"class mean: {outcome[0]['test/acc']:.2f} ± {outcome[0]['test/ci95']:.2f}% "
                    f"({results[-1].best.name})")
    return results


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
