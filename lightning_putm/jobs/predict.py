"""The ``evaluate.py predict`` job: a checkpoint, labelled support folders and query images → predictions CSV.

Order matters for trust: the config, the method's settings, the output paths, both folders, the checkpoint and
every image are checked before anything is written. Only then are the base-class features for CL2N extracted
(and cached, as ``evaluate.py`` does), the task solved and the two CSV files written. No logger, no run folder.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from omegaconf import DictConfig

from lightning_putm.config import (apply_overrides, conf_dir, group_options, load_group, load_yaml, peel_override,
                                   to_container)
from lightning_putm.errors import ConfigError, DataError, LightningPutmError
from lightning_putm.evaluation.settings import (BASE_SPLIT_PREFIX, apply_presets, check_method_params,
                                                load_evaluate_config, method_arguments, resolve_device,
                                                settings_from_config)
from lightning_putm.evaluation.sources import base_split_features
from lightning_putm.extraction import file_sha256, load_checkpoint_backbone
from lightning_putm.features import load_features
from lightning_putm.help import format_rows, help_width, paragraph, rows, usage, yaml_comments
from lightning_putm.methods import (available_methods, build_method, method_uses_base_covariance,
                                    method_uses_base_mean)
from lightning_putm.methods.bavardage import base_within_class_scatter
from lightning_putm.prediction import (PredictionImages, checkpoint_image_reader, estimated_counts,
                                       extract_features, predict_task, read_folders, summary_table,
                                       write_counts, write_predictions)
from lightning_putm.validators import did_you_mean, integer, memory_budget

REQUIRED = {"checkpoint": "a .ckpt written by train_backbone.py", "support": "a folder with one sub-folder per class",
            "query": "a folder of unlabelled images"}


@dataclass
class PredictSettings:
    """Validated values of ``conf/predict.yaml``."""

    checkpoint: Path
    support: Path
    query: Path
    method: str
    method_params: dict[str, Any]
    output: Path
    counts_output: Path
    base_features: str | None  # "auto", "split:<name>", a feature file, or None (L2N)
    data_root: str | None
    feature_cache_dir: Path
    batch_size: int
    seed: int
    device: torch.device
    memory_budget_mb: float | str  # MB, or "auto" (free device memory on CUDA)


@dataclass
class PredictResult:
    """What one prediction produced (also returned to callers such as tests)."""

    images: PredictionImages
    probabilities: torch.Tensor  # [Q, N]
    counts: torch.Tensor  # [N] estimated queries per class
    output: Path
    counts_output: Path
    normalisation: str  # CL2N (with what) or L2N, for methods that use a base mean; "" for the others


def load_predict_config(overrides: Sequence[str]) -> tuple[DictConfig, str]:
    """``conf/predict.yaml`` with every method's settings under ``method.<name>`` plus overrides (unknown keys are
    errors); ``method=<name>`` picks the method. Returns the config and the method's name."""
    chosen, overrides = peel_override(list(overrides), "method")
    cfg = load_yaml(conf_dir() / "predict.yaml")
    name = str(cfg.method) if chosen is None else chosen
    if name not in available_methods():
        raise ConfigError(f"unknown method {name!r}; {did_you_mean(name, available_methods())}available methods: "
                         f"{', '.join(available_methods())}")
    cfg.method = {n: load_group("method", n) for n in group_options("method")}
    cfg, overrides = apply_presets(cfg, overrides)
    return apply_overrides(cfg, overrides), name


def _required_path(cfg: DictConfig, key: str) -> Path:
    value = cfg[key]
    if value is None or str(value).strip() in ("", "None", "null"):
        raise ConfigError(f"`{key}` is required: pass {key}=<path> ({REQUIRED[key]})")
    return Path(str(value)).expanduser()


def _output_path(value: Any, key: str) -> Path:
    if value is None or not str(value).strip():
        raise ConfigError(f"`{key}` must be a file path, e.g. {key}=predictions.csv")
    path = Path(str(value)).expanduser()
    if path.is_dir():
        raise ConfigError(f"`{key}`={path} is a folder; give a file path, e.g. {key}={path / 'predictions.csv'}")
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"`{key}`={path}: {parent} is a file, so the folder cannot be created")
    return path


def predict_settings(cfg: DictConfig, method: str) -> PredictSettings:
    """Validate the merged config; every problem is a :class:`ConfigError` naming the key."""
    checkpoint, support, query = (_required_path(cfg, k) for k in ("checkpoint", "support", "query"))
    check_method_params(cfg, [method])
    params = method_arguments(to_container(cfg.method[method]))
    build_method(method, params, shots=1, balanced=False)  # a bad method.<name>.* value fails now
    output = _output_path(cfg.output, "output")
    counts_output = output.with_name(f"{output.stem}_counts.csv") if cfg.counts_output in (None, "") else \
        _output_path(cfg.counts_output, "counts_output")
    if counts_output.resolve() == output.resolve():
        raise ConfigError(f"`counts_output` and `output` are the same file ({output}); give two names")
    base = cfg.base_features
    base = None if base in (None, "", "null") else str(base)
    if base is not None and base != "auto" and not base.startswith(BASE_SPLIT_PREFIX) and not Path(base).is_file():
        raise ConfigError(f"base_features: file not found: {base}; give auto, split:train, a feature file of the base "
                          "classes from the same backbone, or null")
    return PredictSettings(
        checkpoint=checkpoint, support=support, query=query, method=method, method_params=params, output=output,
        counts_output=counts_output, base_features=base,
        data_root=None if cfg.data_root in (None, "") else str(cfg.data_root),
        feature_cache_dir=Path(str(cfg.feature_cache_dir)), batch_size=integer(cfg.batch_size, "batch_size", 1),
        seed=integer(cfg.seed, "seed", 0), device=resolve_device(str(cfg.device)),
        memory_budget_mb=memory_budget(cfg.memory_budget_mb),
    )


def base_statistics(settings: PredictSettings, dim: int,
                    log: Callable[[str], None]) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    """The base-class mean (and BAVARDAGE's scatter) for CL2N, the way ``evaluate.py`` gets them, and a note.

    ``auto`` extracts the train split of the data the checkpoint records (cached); when that data cannot be read
    here, the method uses L2N and the note says so. ``split:<name>`` insists (its failure is an error).
    """
    if not method_uses_base_mean(settings.method):
        return None, None, ""
    choice = settings.base_features
    if choice is None:
        return None, None, "L2N (base_features=null)"
    path = choice
    if choice == "auto" or choice.startswith(BASE_SPLIT_PREFIX):
        split = "train" if choice == "auto" else choice[len(BASE_SPLIT_PREFIX):]
        try:
            path = str(checkpoint_base_split(settings, split, log))
        except LightningPutmError as exc:
            if choice != "auto":
                raise
            note = (f"notice: {settings.method} uses plain L2 normalisation (L2N), not CL2N: the checkpoint's "
                    f"training data cannot be read here ({exc}); pass data_root=<folder> to use its base-class mean")
            log(note)
            return None, None, "L2N (training data not found)"
    base = load_features(path)
    base.check_finite(f"base features from {path}")
    if base.dim != dim or len(base) == 0:
        raise DataError(f"base_features {path} has {len(base)} rows of d={base.dim} but the backbone gives d={dim}; "
                        "use base features of the same backbone")
    mean = base.features.double().mean(0).float()
    covariance = base_within_class_scatter(base.features, base.labels, mean) \
        if method_uses_base_covariance(settings.method) else None
    return mean, covariance, f"CL2N (mean of {len(base)} base-class rows: {path})"


def checkpoint_base_split(settings: PredictSettings, split: str, log: Callable[[str], None]) -> Path:
    """Features of ``split`` of the checkpoint's own data, through ``evaluate.py``'s extraction and cache."""
    accelerator = {"cpu": "cpu", "cuda": "gpu"}[settings.device.type]
    overrides = [f"checkpoint={settings.checkpoint}", f"methods=[{settings.method}]", "logger=none", "plots=false",
                 "progress=false", f"feature_cache_dir={settings.feature_cache_dir}",
                 f"output_dir={settings.feature_cache_dir}", f"base_features={BASE_SPLIT_PREFIX}{split}",
                 f"trainer.accelerator={accelerator}"]
    if settings.data_root is not None:
        overrides.append(f"data.root={settings.data_root}")
    cfg = load_evaluate_config(overrides)
    evaluation = settings_from_config(cfg)
    return base_split_features(cfg, evaluation, split, file_sha256(settings.checkpoint), log)


def run_predict(overrides: Sequence[str], log: Callable[[str], None] = print) -> PredictResult:
    """Run ``evaluate.py predict`` with ``key=value`` overrides; returns what was predicted and written."""
    cfg, method_name = load_predict_config(overrides)
    settings = predict_settings(cfg, method_name)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)  # "GPU available: ..." banners of the base-split extraction
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)
    images = read_folders(settings.support, settings.query)
    backbone, hparams = load_checkpoint_backbone(settings.checkpoint)
    reader = checkpoint_image_reader(hparams, str(settings.checkpoint))
    shots = images.shots()
    log(f"predict: {settings.method} on {images.ways} classes ({', '.join(images.class_names)}), support images per "
        f"class {shots}, {len(images.query_paths)} query images | {hparams.get('backbone')} backbone of "
        f"{settings.checkpoint}")
    if images.ignored:
        names = ", ".join(str(p) for p in images.ignored[:5])
        log(f"notice: ignored {len(images.ignored)} file(s) whose extension is not an image's: {names}"
            f"{' …' if len(images.ignored) > 5 else ''}")
    log(f"images are read as {reader.description}")
    support = extract_features(backbone, images.support_paths, reader, settings.device, settings.batch_size)
    query = extract_features(backbone, images.query_paths, reader, settings.device, settings.batch_size)
    mean, covariance, normalisation = base_statistics(settings, support.shape[1], log)
    # K may differ per class; a method's "by setting" defaults (PUTM's inertia, α-TIM's α, LaplacianShot's λ)
    # follow the smallest class. The query proportions are unknown, so the Dirichlet (imbalanced) defaults apply.
    method = build_method(settings.method, settings.method_params, shots=min(shots), balanced=False,
                          base_mean=mean, base_covariance=covariance, memory_budget_mb=settings.memory_budget_mb)
    device = settings.device
    probabilities = predict_task(method, support.to(device), images.support_labels.to(device), query.to(device),
                                 images.ways, settings.seed)
    write_predictions(settings.output, images, probabilities)
    write_counts(settings.counts_output, images, probabilities)
    counts = estimated_counts(probabilities)
    estimate = "the column sums of PUTM's forward navigator π_f" if settings.method == "putm" else \
        f"the sums of {settings.method}'s query probabilities"
    log(f"estimated queries per class = {estimate}" + (f"; normalisation: {normalisation}" if normalisation else ""))
    log(summary_table(images, probabilities))
    log(f"wrote {settings.output} ({len(images.query_paths)} rows) and {settings.counts_output}")
    return PredictResult(images, probabilities, counts, settings.output, settings.counts_output, normalisation)


def predict_help(summary: str) -> str:
    """``evaluate.py predict --help``: every key of ``conf/predict.yaml`` with type, default and meaning."""
    path = conf_dir() / "predict.yaml"
    width = help_width()
    table = rows(load_yaml(path), yaml_comments(path), "", skip=())  # `method` is a name here, not the group
    return "\n".join([paragraph(summary, width), "",
                      usage([("python evaluate.py predict checkpoint=<ckpt> support=<folder> query=<folder> "
                              "[key=value ...]", "")], width),
                      "", "Keys of conf/predict.yaml (key, type, default, meaning):", format_rows(table, width), "",
                      paragraph("method.<name>.<key>=value sets a method's settings as in evaluate.py (python "
                                "evaluate.py --help lists them).", width)])
