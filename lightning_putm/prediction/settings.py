"""The ``evaluate.py predict`` job: a checkpoint, labelled support folders and query images → predictions CSV.

Order matters for trust: the config, the method's settings, the output paths, both folders, the checkpoint and
every image are checked before anything is written. Only then are the base-class features for CL2N extracted
(and cached, as ``evaluate.py`` does), the task solved and the two CSV files written. No logger, no run folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from omegaconf import DictConfig

from lightning_putm.config import (Override, Overrides, apply_overrides, conf_dir, load_yaml, progress_seconds,
                                   to_container)
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.presets import apply_presets
from lightning_putm.evaluation.settings import BASE_SPLIT_PREFIX, method_arguments, resolve_device
from lightning_putm.help import format_rows, help_width, job_rows, paragraph, usage
from lightning_putm.job_options import checked_options
from lightning_putm.methods.catalog import available_methods, check_method_options, known_method, method_configs
from lightning_putm.models.timm_names import check_model_name, timm_model_name
from lightning_putm.prediction.options import PredictOptions
from lightning_putm.validators import did_you_mean

if TYPE_CHECKING:  # torch loads once the settings are valid: config errors and --help come without it
    import torch

    from lightning_putm.evaluation.calibration import Calibration
    from lightning_putm.prediction.images import PredictionImages

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
    timm_model: str | None = None  # checkpoint=timm:<name>: a pretrained timm model
    pretrained_file: Path | None = None  # its weights file (None: timm's hub cache or download)
    calibration: str | float | None = "auto"  # "auto", "split:<name>", a feature file, a temperature, None (raw)
    calibration_tasks: int = 200


@dataclass
class PredictResult:
    """What one prediction produced (also returned to callers such as tests)."""

    images: PredictionImages
    probabilities: torch.Tensor  # [Q, N]
    counts: torch.Tensor  # [N] estimated queries per class (sums of the calibrated probabilities)
    output: Path
    counts_output: Path
    normalisation: str  # CL2N (with what) or L2N, for methods that use a base mean; "" for the others
    raw_probabilities: torch.Tensor | None = None  # [Q, N] the method's own, before calibration
    calibration: Calibration | None = None  # the temperature applied (None: raw probabilities)


def load_predict_config(overrides: Iterable[str | Override]) -> tuple[DictConfig, str]:
    """``conf/predict.yaml`` with every method's settings under ``method.<name>`` plus overrides (unknown keys are
    errors); ``method=<name>`` picks the method. Returns the config and the method's name."""
    chosen, overrides = Overrides.parse(overrides).pop("method")
    cfg = load_yaml(conf_dir() / "predict.yaml")
    name = str(cfg.method) if chosen is None else chosen
    if not known_method(name):
        raise ConfigError(f"unknown method {name!r}; {did_you_mean(name, available_methods())}available methods: "
                         f"{', '.join(available_methods())}")
    cfg.method = method_configs()
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
    """Validate the merged config; every problem is a :class:`ConfigError` naming the key. Each key is first checked
    against what its field declares (:func:`~lightning_putm.job_options.checked_options`); what follows relates
    keys to each other and to files."""
    checkpoint, support, query = (_required_path(cfg, k) for k in ("checkpoint", "support", "query"))
    values = checked_options(PredictOptions, cfg)
    progress_seconds()  # $LIGHTNING_PUTM_PROGRESS_SECONDS, read by the progress lines later: checked now
    timm_model = timm_model_name(cfg.checkpoint)
    given = cfg.get("pretrained_file")
    pretrained_file = None if given in (None, "", "null", "None") else Path(str(given)).expanduser()
    if timm_model is None and pretrained_file is not None:
        raise ConfigError(f"pretrained_file={given} is the weights file of a timm model: use it with "
                          "checkpoint=timm:<model name>, or drop it")
    if timm_model is not None:
        check_model_name(timm_model)
        if pretrained_file is not None and not pretrained_file.is_file():
            raise ConfigError(f"pretrained_file={pretrained_file}: file not found; give the weights file of "
                              f"timm:{timm_model}, or drop it to use timm's hub cache")
    params = method_arguments(to_container(cfg.method[method]))
    check_method_options(method, params, shots=1, balanced=False)  # a bad method.<name>.* value fails now
    output = _output_path(cfg.output, "output")
    counts_output = output.with_name(f"{output.stem}_counts.csv") if cfg.counts_output in (None, "") else \
        _output_path(cfg.counts_output, "counts_output")
    if counts_output.resolve() == output.resolve():
        raise ConfigError(f"`counts_output` and `output` are the same file ({output}); give two names")
    base = cfg.base_features
    base = None if base in (None, "", "null") else str(base)
    if timm_model is not None and base is not None and base.startswith(BASE_SPLIT_PREFIX):
        raise ConfigError(f"base_features={base}: a timm model records no training data to extract; give a feature "
                          f"file of base classes from timm:{timm_model} (evaluate.py checkpoint=timm:{timm_model} "
                          "base_features=split:train caches one in feature_cache_dir), auto or null")
    if base is not None and base != "auto" and not base.startswith(BASE_SPLIT_PREFIX) and not Path(base).is_file():
        raise ConfigError(f"base_features: file not found: {base}; give auto, split:train, a feature file of the base "
                          "classes from the same backbone, or null")
    calibration = calibration_choice(cfg.get("calibration", "auto"), timm_model)
    from lightning_putm.methods import build_method  # last, as it imports the methods (and torch)

    build_method(method, params, shots=1, balanced=False)  # a value only the constructor checks (UNEM's params_file)
    return PredictSettings(
        checkpoint=checkpoint, support=support, query=query, method=method, method_params=params, output=output,
        counts_output=counts_output, base_features=base,
        data_root=None if cfg.data_root in (None, "") else str(cfg.data_root),
        feature_cache_dir=Path(str(cfg.feature_cache_dir)), batch_size=values["batch_size"], seed=values["seed"],
        device=resolve_device(str(cfg.device)), memory_budget_mb=values["memory_budget_mb"], timm_model=timm_model,
        pretrained_file=pretrained_file, calibration=calibration, calibration_tasks=values["calibration_tasks"],
    )


def calibration_choice(value: Any, timm_model: str | None) -> str | float | None:
    """``calibration``: ``auto``, ``split:<name>``, a labelled feature file, a temperature > 0, or null (raw)."""
    if value is None or str(value).strip() in ("", "null", "None", "none"):
        return None
    if isinstance(value, bool):
        raise ConfigError(f"calibration={value}: give auto, split:val, a feature file, a temperature or null")
    if isinstance(value, (int, float)):
        if not math.isfinite(float(value)) or float(value) <= 0:
            raise ConfigError(f"calibration={value}: a temperature must be a number > 0 (1 keeps the method's own "
                              "probabilities); or give auto, split:val, a feature file or null")
        return float(value)
    text = str(value)
    if text.startswith(BASE_SPLIT_PREFIX) and timm_model is not None:
        raise ConfigError(f"calibration={text}: a timm model records no data to extract; give a feature file of "
                          f"labelled classes from timm:{timm_model}, a temperature, auto or null")
    if text != "auto" and not text.startswith(BASE_SPLIT_PREFIX) and not Path(text).expanduser().is_file():
        raise ConfigError(f"calibration: file not found: {text}; give auto, split:val, a feature file of labelled "
                          "classes outside your task (same backbone), a temperature (e.g. 2.5) or null")
    return text if text == "auto" or text.startswith(BASE_SPLIT_PREFIX) else str(Path(text).expanduser())


def predict_help(summary: str) -> str:
    """``evaluate.py predict --help``: every key of ``conf/predict.yaml`` with type, default and meaning."""
    width = help_width()
    table = job_rows("predict", skip=())  # `method` is a name here, not the group
    return "\n".join([paragraph(summary, width), "",
                      usage([("python evaluate.py predict checkpoint=<ckpt> support=<folder> query=<folder> "
                              "[key=value ...]", "")], width),
                      "", "Keys of conf/predict.yaml (key, type, default, meaning):", format_rows(table, width), "",
                      paragraph("method.<name>.<key>=value sets a method's settings as in evaluate.py (python "
                                "evaluate.py --help lists them).", width)])
