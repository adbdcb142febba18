"""``train_backbone.py``'s settings: ``conf/train_backbone.yaml`` + the data and backbone files + overrides, read
and checked into :class:`TrainSettings` before anything is created.

``data=<name>`` picks ``conf/data/<name>.yaml`` and ``backbone=<name>`` picks ``conf/backbone/<name>.yaml`` (both
peeled off the overrides before the rest is applied, so ``data.root=...`` and ``backbone.dropout=...`` are checked
against the chosen files). ``trainer.<arg>=value`` accepts any argument of ``pytorch_lightning.Trainer`` (checked
against its signature) except the few the job owns (logger, callbacks, plugins, checkpointing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_putm.config import (Override, Overrides, apply_overrides, apply_trainer_overrides, conf_dir,
                                   is_trainer_override, load_group, load_saved_config, load_yaml, to_container)
from lightning_putm.data.settings import EpisodeSettings, LoaderSettings
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.settings import (EvaluationSettings, load_evaluate_config,
                                                settings_from_config as evaluation_settings)
from lightning_putm.job_options import checked, checked_options
from lightning_putm.loggers import LOGGERS, check_wandb_mode
from lightning_putm.pretraining.choices import check_compile
from lightning_putm.pretraining.options import TrainBackboneOptions
from lightning_putm.runs import LATEST, slug
from lightning_putm.validators import flag, mapping, number, parse_alpha, positive


#: Trainer arguments this job sets itself; use the named config keys instead.
RESERVED_TRAINER_ARGS = {
    "logger": f"use logger={'|'.join(LOGGERS)}",
    "callbacks": "checkpointing callbacks are built from checkpoint_dir",
    "plugins": "the checkpoint IO plugin is fixed (atomic writes, weights_only reads)",
    "enable_checkpointing": "checkpoints are always written to checkpoint_dir",
    "default_root_dir": "use checkpoint_dir and log_dir",
}


def load_train_config(overrides: Iterable[str | Override] = ()) -> DictConfig:
    """``conf/train_backbone.yaml`` + the chosen data and backbone files + overrides (unknown keys are errors).

    The arguments are parsed once, first; the selectors (``config=``, ``data=``, ``backbone=``) and ``trainer.*``
    are taken out before the YAML files are composed, and the rest is merged."""
    overrides = Overrides.parse(overrides)
    saved_path, overrides = overrides.pop("config")
    data_name, overrides = overrides.pop("data")
    backbone_name, overrides = overrides.pop("backbone")
    saved = None
    if saved_path is not None:  # re-run a recorded run: its config.yaml is the base, overrides still apply
        if not Path(saved_path).is_file():
            raise ConfigError(f"config={saved_path}: file not found; give the config.yaml saved in a run folder")
        saved = load_yaml(Path(saved_path))
        data_name = data_name or OmegaConf.select(saved, "data.name")
        backbone_name = backbone_name or OmegaConf.select(saved, "backbone.name")
    trainer_overrides, overrides = overrides.partition(is_trainer_override)
    for override in overrides:
        if override.key in ("data.name", "backbone.name"):
            raise ConfigError(f"{override.text!r}: choose the dataset with data=<name> and the backbone with "
                              "backbone=<name>")

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
    fewshot_base_split: str | None = None  # "train": CL2N's base features are that split's, extracted at each check

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


def _episodes(cfg: DictConfig, key: str, values: dict[str, Any]) -> EpisodeSettings:
    """``val_episodes``/``test_episodes``: the checked counts and seed (``values``), the alpha parsed."""
    node = cfg[key]
    alpha = None if node.alpha is None else parse_alpha(node.alpha, f"`{key}.alpha`")
    return EpisodeSettings(alpha=alpha, **{k: values[f"{key}.{k}"] for k in ("ways", "shots", "queries", "tasks",
                                                                            "seed")})


def check_train_arguments(overrides: Iterable[str | Override]) -> None:
    """Raise the config's first error, if any, without importing torch or Lightning: the scripts call this before
    they load the job, so a mistyped key is reported in a fraction of a second (the job reads the config again)."""
    settings_from_config(load_train_config(overrides))


def settings_from_config(cfg: DictConfig) -> TrainSettings:
    """Validate the merged config; every problem is a :class:`ConfigError` naming the key. Each key is first checked
    against what its field declares (:func:`~lightning_putm.job_options.checked_options`); what follows relates
    keys to each other and to the data and backbone files."""
    values = checked_options(TrainBackboneOptions, cfg)
    stages = values["stages"]
    if stages == "auto":  # the dataset's recipe, checked as if it had been given
        stages = checked(TrainBackboneOptions, "stages", cfg.data.get("stages", ["rotation", "s2m2r"]))
    epochs_cfg = to_container(cfg.data.epochs)
    max_epochs = cfg.trainer.get("max_epochs")
    epochs = {}
    for stage in stages:
        value = max_epochs if max_epochs is not None else epochs_cfg.get(stage)
        if value is None:
            raise ConfigError(f"no epoch count for stage {stage!r}: set data.epochs.{stage} or trainer.max_epochs")
        epochs[stage] = positive(value, "trainer.max_epochs" if max_epochs is not None else f"data.epochs.{stage}",
                                  integer=True)
    head_scale = None if values["head.scale"] == "auto" else values["head.scale"]
    wandb = mapping(cfg.wandb, "wandb")
    check_wandb_mode(wandb.get("mode"), values["logger"])
    backbone_options = {k: v for k, v in to_container(cfg.backbone).items() if k != "name"}
    _check_backbone_options(backbone_options, str(cfg.backbone.name))
    trainer = {k: v for k, v in to_container(cfg.trainer).items() if k != "max_epochs"}
    _check_trainer_writes_checkpoints(trainer)
    check_compile(cfg.compile, "compile")  # false | true | a torch.compile backend name (asks torch which)
    return TrainSettings(
        dataset=str(cfg.data.name),
        backbone=str(cfg.backbone.name),
        backbone_options=backbone_options,
        stages=stages,
        epochs=epochs,
        init_from=None if values["init_from"] is None else Path(values["init_from"]),
        resume=values["resume"],
        checkpoint_dir=Path(values["checkpoint_dir"]),
        run=None if cfg.run in (None, "", "auto") else slug(str(cfg.run)),
        seed=values["seed"],
        module_args={
            "lr": values["lr"],
            "weight_decay": values["weight_decay"],
            "scheduler": values["scheduler"],
            "mixup_alpha": values["mixup_alpha"],
            "mix_layers": values["mix_layers"],
            "head_scale": head_scale,
            "class_gain": values["head.class_gain"],
            "ncm_normalise": values["ncm"],
            "channels_last": values["channels_last"],
            "compile": cfg.compile,
        },
        val_episodes=_episodes(cfg, "val_episodes", values),
        test_episodes=_episodes(cfg, "test_episodes", values),
        run_test=values["run_test"],
        logger=values["logger"],
        log_dir=Path(values["log_dir"]),
        wandb=wandb,
        trainer=trainer,
        loader=_loader_settings(cfg),
        fewshot_every=values["fewshot_eval.every_n_epochs"],
        fewshot_eval=_fewshot_settings(cfg),
        fewshot_base_split=_fewshot_base_split(cfg),
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


def _fewshot_settings(cfg: DictConfig) -> EvaluationSettings | None:
    """Settings of the periodic few-shot evaluation on the validation split (evaluate.py's validation rules)."""
    if cfg.fewshot_eval.every_n_epochs is None:
        return None
    node = cfg.fewshot_eval
    if any(str(o).partition("=")[0].strip() == "base_features" for o in (node.overrides or [])):
        raise ConfigError("fewshot_eval.overrides: give the base features as fewshot_eval.base_features (split:train "
                          "or null), not as an evaluate.py key")
    overrides = [f"methods={list(node.methods)}".replace("'", ""), f"shots={list(node.shots)}",
                 f"alphas={list(node.alphas)}".replace("'", ""), f"tasks={node.tasks}",
                 f"ways={cfg.val_episodes.ways}", f"queries={cfg.val_episodes.queries}", f"seed={cfg.val_episodes.seed}",
                 "split=val", "progress=false", f"output_dir={Path(str(cfg.log_dir)) / 'fewshot' / str(cfg.data.name)}",
                 "base_features=null",  # split:train is extracted by the check itself (pretraining/stages.py)
                 *[str(o) for o in (node.overrides or [])]]
    try:
        return evaluation_settings(load_evaluate_config(overrides))
    except ConfigError as exc:
        raise ConfigError(f"fewshot_eval: {exc}") from exc


def _fewshot_base_split(cfg: DictConfig) -> str | None:
    """``split:train`` → ``"train"`` (the check extracts that split with the weights it checks), ``null`` → None
    (plain L2 normalisation, with the notice). A feature file is refused: it would come from other weights than
    the ones being trained, so its mean would not centre these features."""
    value = cfg.fewshot_eval.get("base_features")
    if value in (None, "", "null"):
        return None
    if value != "split:train":
        raise ConfigError(f"fewshot_eval.base_features must be split:train (the train split's features, extracted "
                          f"with the weights of each check) or null (plain L2 normalisation); got {value!r} (a "
                          "feature file would hold another backbone's features)")
    return "train"


#: The ``data.*`` keys a checkpoint records: what its evaluation must use to see the same kind of images.
DATA_KEYS_RECORDED = ("name", "root", "image_size", "normalize", "eval_resize", "options")


def recorded_data_config(cfg: DictConfig) -> dict[str, Any]:
    return {key: to_container(cfg.data)[key] for key in DATA_KEYS_RECORDED if key in cfg.data}
