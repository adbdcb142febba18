"""Evaluation on features: every method on the same seeded episode bank per (shot, α), then a report.

This is where feature sets, episodes and methods meet (DESIGN §1). ``evaluate.py`` is a thin wrapper:
it loads ``conf/evaluate.yaml`` with overrides, calls :func:`evaluate_features` and :func:`write_report`.
"""

from __future__ import annotations

import csv
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from lightning_putm.config import (apply_overrides, conf_dir, group_options, load_group, load_yaml, split_override,
                                   to_container, to_yaml)
from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import EpisodeBank, sample_episode_bank
from lightning_putm.errors import ConfigError, FeatureError
from lightning_putm.features import FeatureSet, load_features
from lightning_putm.methods import available_methods, build_method, method_uses_base_mean, method_uses_class_prior
from lightning_putm.metrics import mean_and_ci95, task_accuracy

DEMO_TASKS = 100
DEFAULT_TASKS = 1000
SPLITS = ("train", "val", "test")

#: Trainer arguments evaluation sets itself.
EVALUATION_TRAINER_ARGS = {
    "logger": "use logger=auto|wandb|csv|none",
    "callbacks": "the few-shot evaluation callback is built from this config",
    "enable_checkpointing": "evaluation writes no checkpoints",
    "inference_mode": "PUTM needs gradients for its navigators (inference_mode is off)",
    "default_root_dir": "use output_dir",
    "enable_progress_bar": "use progress=true|false",
}


#: ``base_features=split:<name>``: the base-class features are that split of ``data``, extracted with the checkpoint.
BASE_SPLIT_PREFIX = "split:"
BASE_SPLITS = ("train", "val")


@dataclass
class EvaluationSettings:
    """Validated values of ``conf/evaluate.yaml``."""

    features: str
    methods: list[str]
    ways: int
    shots: list[int]
    queries: int
    alphas: list[float | None]  # None = balanced
    tasks: int
    seed: int
    device: torch.device
    output_dir: Path
    allow_pickle: bool = False
    memory_budget_mb: float = 2048.0
    progress: bool = True
    method_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    base_features: str | None = None  # base-class feature file whose mean CL2N subtracts
    oracle_prior: bool = False  # give methods with a class prior the TRUE query counts (labelled, unfair)
    checkpoint: Path | None = None  # extract features of data/split from this backbone checkpoint
    split: str = "test"
    feature_cache_dir: Path = Path("outputs/feature_cache")
    refresh_features: bool = False
    logger: str = "auto"
    wandb: dict[str, Any] = field(default_factory=dict)
    plots: bool = True
    plot_task: int = 0
    trainer: dict[str, Any] = field(default_factory=dict)
    backbone: str = "auto"  # expected backbone of the checkpoint (auto = whatever it holds)


@dataclass
class SettingResult:
    method: str
    shots: int
    alpha: float | None
    accuracies: torch.Tensor  # [T] float64
    seconds: float
    bank: EpisodeBank
    oracle_prior: bool = False  # the method received the true query counts

    @property
    def alpha_label(self) -> str:
        return "balanced" if self.alpha is None else f"{self.alpha:g}"

    def summary(self) -> dict[str, Any]:
        mean, ci = mean_and_ci95(self.accuracies)
        return {
            "method": self.method,
            "shots": self.shots,
            "alpha": self.alpha_label,
            "accuracy": round(100 * mean, 4),
            "ci95": round(100 * ci, 4),
            "tasks": int(self.accuracies.numel()),
            "seconds": round(self.seconds, 3),
            "oracle_prior": _flag(self.oracle_prior),
        }


def _flag(value: bool) -> str:
    return "true" if value else "false"


# --------------------------------------------------------------------------------------------- config
def load_evaluate_config(overrides: Sequence[str] = ()) -> DictConfig:
    """``conf/evaluate.yaml`` with every ``conf/method/*.yaml`` under ``method.<name>``, the chosen
    ``conf/data/<name>.yaml`` under ``data`` (``data=<name>`` picks it), plus overrides; ``trainer.<arg>``
    accepts any ``pytorch_lightning.Trainer`` argument except those evaluation sets itself."""
    from lightning_putm.training import apply_trainer_overrides, peel_override

    overrides = list(overrides)
    data_name, overrides = peel_override(overrides, "data")
    trainer_overrides = [o for o in overrides if split_override(o)[0].startswith("trainer.")]
    overrides = [o for o in overrides if o not in trainer_overrides]
    cfg = load_yaml(conf_dir() / "evaluate.yaml")
    cfg.method = {name: load_group("method", name) for name in group_options("method")}
    data_name = data_name or str(cfg.data)
    cfg.data = OmegaConf.merge({"name": data_name}, load_group("data", data_name))
    cfg = apply_overrides(cfg, overrides)
    return apply_trainer_overrides(cfg, trainer_overrides, EVALUATION_TRAINER_ARGS, "evaluate.py")


def _int(cfg: DictConfig, key: str, low: int) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"`{key}` must be an integer >= {low}, got {value!r}")
    return value


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) or hasattr(value, "__iter__") and not isinstance(value, str) else [value]


def parse_alpha(value: Any) -> float | None:
    """A Dirichlet α (> 0, finite) or ``balanced`` → ``None``."""
    if isinstance(value, str) and value.strip().lower() == "balanced":
        return None
    if isinstance(value, bool):
        raise ConfigError(f"alphas: {value!r} is neither a positive number nor `balanced`")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"alphas: {value!r} is neither a positive number nor `balanced`") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"alphas: Dirichlet alpha must be > 0 (or `balanced`), got {value!r}")
    return float(value)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device: cannot use {name!r} ({exc}); use auto, cpu or cuda[:index]") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device: {name!r} is not supported; use auto, cpu or cuda[:index]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here; use device=auto or device=cpu")
    return device


def check_method_params(cfg: DictConfig, methods: list[str]) -> None:
    """Each ``method.<name>.<key>`` must have the type of its default in ``conf/method/<name>.yaml``."""
    for name in methods:
        defaults = load_group("method", name)
        for key, value in cfg.method[name].items():
            default = defaults.get(key)
            where = f"method.{name}.{key}"
            if default is None or value is None:
                continue
            if isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ConfigError(f"`{where}` must be true or false, got {value!r}")
            elif isinstance(default, (int, float)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ConfigError(f"`{where}` must be a number (default {default}), got {value!r}")
                if isinstance(default, int) and not isinstance(value, int):
                    raise ConfigError(f"`{where}` must be an integer (default {default}), got {value!r}")
            elif isinstance(default, str) and not isinstance(value, str):
                raise ConfigError(f"`{where}` must be text (default {default!r}), got {value!r}")
            elif OmegaConf.is_list(default) and not OmegaConf.is_list(value):
                raise ConfigError(f"`{where}` must be a list like {to_container(default)}, got {value!r}")


def settings_from_config(cfg: DictConfig) -> EvaluationSettings:
    """Validate the merged config; every problem is a :class:`ConfigError` naming the key."""
    methods = [str(m) for m in _as_list(cfg.methods)]
    if not methods:
        raise ConfigError(f"`methods` is empty; choose from {', '.join(available_methods())}")
    for name in methods:
        if name not in available_methods():
            raise ConfigError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    ways = _int(cfg, "ways", 2)
    shots = _as_list(cfg.shots)
    if not shots or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shots):
        raise ConfigError(f"`shots` must be a list of positive integers (e.g. shots=[1,5]), got {cfg.shots!r}")
    queries = 15 * ways if cfg.queries is None else _int(cfg, "queries", 1)
    alphas = [parse_alpha(a) for a in _as_list(cfg.alphas)]
    if not alphas:
        raise ConfigError("`alphas` is empty; give Dirichlet alphas and/or `balanced`, e.g. alphas=[2,balanced]")
    features = str(cfg.features)
    from_checkpoint = cfg.checkpoint not in (None, "")
    demo = str(cfg.data.name) == "digits" if from_checkpoint else features in ("demo", "auto")
    if cfg.tasks == "auto":
        tasks = DEMO_TASKS if demo else DEFAULT_TASKS
    else:
        tasks = _int(cfg, "tasks", 1)
    seed = _int(cfg, "seed", 0)
    budget = cfg.memory_budget_mb
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ConfigError(f"`memory_budget_mb` must be a positive number, got {budget!r}")
    oracle_prior = cfg.get("oracle_prior", False)
    if not isinstance(oracle_prior, bool):
        raise ConfigError(f"`oracle_prior` must be true or false, got {oracle_prior!r}")
    base_features = cfg.get("base_features")
    base_features = None if base_features in (None, "") else str(base_features)
    checkpoint = None if cfg.checkpoint in (None, "") else Path(str(cfg.checkpoint))
    if base_features == "auto":  # CL2N from the checkpoint's base classes when a method needs them, else none
        wanted = checkpoint is not None and any(method_uses_base_mean(m) for m in methods)
        base_features = "split:train" if wanted and str(cfg.get("split", "test")) != "train" else None
    if base_features is not None and base_features.startswith(BASE_SPLIT_PREFIX):
        base_split = base_features[len(BASE_SPLIT_PREFIX):]
        if checkpoint is None:
            raise ConfigError(f"base_features={base_features} extracts a split with the checkpoint's backbone; "
                              "give checkpoint=PATH too, or base_features=<feature file>")
        if base_split == str(cfg.get("split", "test")):
            raise ConfigError(f"base_features={base_features} is the evaluated split itself; CL2N subtracts the "
                              "mean of the base classes: use base_features=split:train")
        if base_split not in BASE_SPLITS:
            raise ConfigError(f"base_features={base_features}: unknown split {base_split!r}; use split:train "
                              "(the base classes the backbone was trained on) or split:val")
    if checkpoint is not None and features not in ("auto", "demo"):
        raise ConfigError(f"give either features=<file> or checkpoint=<ckpt>, not both (features={features}, "
                          f"checkpoint={checkpoint})")
    if checkpoint is not None:
        features = f"checkpoint:{checkpoint}"
    elif features == "auto":
        features = "demo"
    split = str(cfg.split)
    if split not in SPLITS:
        raise ConfigError(f"`split` must be one of {', '.join(SPLITS)}, got {split!r}")
    if cfg.output_dir is None or str(cfg.output_dir).strip() in ("", "None", "null"):
        raise ConfigError("`output_dir` must be a folder path, e.g. output_dir=outputs/evaluate")
    check_method_params(cfg, methods)
    for key in ("refresh_features", "plots", "progress", "allow_pickle"):
        if not isinstance(cfg[key], bool):
            raise ConfigError(f"`{key}` must be true or false, got {cfg[key]!r}")
    from lightning_putm.loggers import LOGGERS

    if str(cfg.logger) not in LOGGERS:
        raise ConfigError(f"`logger` must be one of {', '.join(LOGGERS)}, got {cfg.logger!r}")
    return EvaluationSettings(
        features=features,
        methods=methods,
        ways=ways,
        shots=[int(s) for s in shots],
        queries=queries,
        alphas=alphas,
        tasks=tasks,
        seed=seed,
        device=resolve_device(str(cfg.device)),
        output_dir=Path(str(cfg.output_dir)),
        allow_pickle=cfg.allow_pickle,
        memory_budget_mb=float(budget),
        progress=bool(cfg.progress),
        method_params={name: to_container(cfg.method[name]) for name in methods if name in cfg.method},
        base_features=base_features,
        oracle_prior=oracle_prior,
        checkpoint=checkpoint,
        split=split,
        feature_cache_dir=Path(str(cfg.feature_cache_dir)),
        refresh_features=cfg.refresh_features,
        logger=str(cfg.logger),
        wandb=to_container(cfg.wandb),
        plots=cfg.plots,
        plot_task=_int(cfg, "plot_task", 0),
        trainer=to_container(cfg.trainer),
        backbone=str(cfg.backbone),
    )


def load_feature_source(settings: EvaluationSettings) -> FeatureSet:
    """The feature set named by ``features=``: the built-in demo or a file."""
    feature_set = digits_feature_set() if settings.features == "demo" else load_features(
        settings.features, allow_pickle=settings.allow_pickle
    )
    feature_set.check_finite(f"features from {settings.features}")
    return feature_set


def load_base_mean(settings: EvaluationSettings, dim: int, log: Callable[[str], None] = print) -> torch.Tensor | None:
    """Mean ``[d]`` of the rows of ``base_features`` for CL2N, or ``None`` with one notice when it is not set."""
    users = [name for name in settings.methods if method_uses_base_mean(name)]
    if settings.base_features is None:
        if users:
            log(f"notice: no base_features file given, so {', '.join(users)} cannot subtract the base-class "
                "mean (CL2N) and use plain L2 normalisation (L2N) instead; pass base_features=<file> with "
                "features of the base classes from the same backbone (with checkpoint=: base_features=split:train)")
        return None
    base = load_features(settings.base_features, allow_pickle=settings.allow_pickle)
    base.check_finite(f"base features from {settings.base_features}")
    if base.dim != dim:
        raise FeatureError(
            f"base_features {settings.base_features} has d={base.dim} but the evaluated features have d={dim}; "
            "both must come from the same backbone"
        )
    if len(base) == 0:
        raise FeatureError(f"base_features {settings.base_features} has no rows")
    log(f"base-class mean for CL2N: {len(base)} rows of {settings.base_features}")
    return base.features.double().mean(0).float()


# --------------------------------------------------------------------------------------------- run
def shard_range(tasks: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous block ``[start, stop)`` of the ``tasks`` tasks that process ``rank`` of ``world_size`` solves."""
    per_rank = math.ceil(tasks / world_size)
    return min(tasks, rank * per_rank), min(tasks, (rank + 1) * per_rank)


def gather_shards(local: torch.Tensor, tasks: int, world_size: int,
                  all_gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-task values of every rank's block, in task order (blocks padded to equal length for all_gather)."""
    per_rank = math.ceil(tasks / world_size)
    padded = local.new_full((per_rank,), float("nan"))
    padded[: local.numel()] = local
    gathered = all_gather(padded).reshape(world_size, per_rank).reshape(-1)
    return gathered[:tasks].clone()


def evaluate_features(
    feature_set: FeatureSet,
    settings: EvaluationSettings,
    log: Callable[[str], None] = print,
    rank: int = 0,
    world_size: int = 1,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: bool | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[SettingResult]:
    """Run every method on the same episode bank for each (shot, α); returns one result per triple.

    With ``world_size > 1`` every process samples the same banks, solves its contiguous block of tasks and
    ``gather`` (an all-gather) assembles the per-task accuracies, so the table equals a single process's.
    ``should_stop`` is polled after every chunk of tasks (e.g. SIGTERM received): the run then stops early.
    """
    if world_size > 1 and gather is None:
        raise ValueError("evaluate_features with world_size > 1 needs a gather function (all_gather)")
    base_mean = load_base_mean(settings, feature_set.dim, log)
    if base_mean is not None:
        base_mean = base_mean.to(settings.device)
    show = settings.progress if progress is None else progress
    start_task, stop_task = shard_range(settings.tasks, rank, world_size)
    total = len(settings.shots) * len(settings.alphas) * len(settings.methods) * (stop_task - start_task)
    bar = tqdm(total=total, desc="tasks", unit="task", disable=not show, dynamic_ncols=True)
    results: list[SettingResult] = []
    try:
        for shots in settings.shots:
            for alpha in settings.alphas:
                bank = sample_episode_bank(
                    feature_set.labels, settings.ways, shots, settings.queries, alpha, settings.tasks,
                    settings.seed, class_names=feature_set.class_names,
                )
                gathered = bank.gather(feature_set.features, settings.device)
                batch = gathered.batch.slice(start_task, stop_task)
                query_labels = gathered.query_labels[start_task:stop_task]
                for name in settings.methods:
                    oracle = settings.oracle_prior and method_uses_class_prior(name)
                    method = build_method(
                        name, settings.method_params.get(name, {}), shots=shots, balanced=alpha is None,
                        show_progress=show, memory_budget_mb=settings.memory_budget_mb, base_mean=base_mean,
                        query_counts=bank.query_counts[start_task:stop_task] if oracle else None,
                    )
                    bar.set_postfix_str(f"{name} {shots}-shot alpha={bank.alpha_label}")
                    start = time.perf_counter()
                    probabilities = method.predict(batch, on_chunk=lambda n: _advance(bar, n, should_stop))
                    seconds = time.perf_counter() - start
                    accuracies = task_accuracy(probabilities, query_labels)
                    if world_size > 1:
                        accuracies = gather_shards(accuracies, settings.tasks, world_size, gather)
                    accuracies = accuracies.cpu()
                    results.append(SettingResult(name, shots, alpha, accuracies, seconds, bank, method.oracle_prior))
    finally:
        bar.close()
    return results


def _advance(bar: Any, tasks: int, should_stop: Callable[[], bool] | None) -> None:
    bar.update(tasks)
    if should_stop is not None and should_stop():
        raise InterruptedError("evaluation stopped: the process received a termination signal (SIGTERM); "
                               "no result files were written for this run")


# --------------------------------------------------------------------------------------------- report
SUMMARY_COLUMNS = ["method", "shots", "alpha", "accuracy", "ci95", "tasks", "seconds", "oracle_prior"]


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table: method, shot, α, accuracy ± 95% CI, tasks, seconds, oracle prior."""
    header = ["method", "shots", "alpha", "accuracy (%)", "tasks", "time (s)", "oracle_prior"]
    body = [
        [str(r["method"]), str(r["shots"]), str(r["alpha"]), f"{r['accuracy']:.2f} ± {r['ci95']:.2f}",
         str(r["tasks"]), f"{r['seconds']:.1f}", str(r.get("oracle_prior", "false"))]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(b) for b in body)])


def per_task_rows(results: list[SettingResult]) -> list[dict[str, Any]]:
    """One row per (method, shot, α, task) with the task's query counts and imbalance."""
    rows = []
    for result in results:
        bank = result.bank
        imbalance = bank.imbalance()
        for t in range(len(bank)):
            counts = bank.query_counts[t].tolist()
            rows.append({
                "method": result.method,
                "shots": result.shots,
                "alpha": result.alpha_label,
                "task": t,
                "accuracy": f"{float(result.accuracies[t]):.6f}",
                "oracle_prior": _flag(result.oracle_prior),
                "query_counts": ";".join(str(c) for c in counts),
                "class_ids": ";".join(str(c) for c in bank.class_ids[t].tolist()),
                "max_min_ratio": f"{float(imbalance['max_min_ratio'][t]):.4f}",
                "normalised_entropy": f"{float(imbalance['normalised_entropy'][t]):.6f}",
            })
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> Path:
    """Write rows atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    columns = columns or (list(rows[0].keys()) if rows else [])
    with open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path


def write_report(results: list[SettingResult], output_dir: Path, config_yaml: str | None = None) -> dict[str, Path]:
    """``results.csv`` (summary), ``per_task.csv`` and ``config.yaml`` in ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": write_csv(output_dir / "results.csv", [r.summary() for r in results], SUMMARY_COLUMNS),
        "per_task": write_csv(output_dir / "per_task.csv", per_task_rows(results)),
    }
    if config_yaml is not None:
        config_path = output_dir / "config.yaml"
        config_path.write_text(config_yaml)
        paths["config"] = config_path
    return paths


# --------------------------------------------------------------------------------------------- the job
def build_feature_source(cfg: DictConfig, settings: EvaluationSettings, log: Callable[[str], None] = print) -> tuple[Any, Any, Any]:
    """The test loop's module and datamodule, and the feature cache to fill (``None`` when nothing to extract).

    * ``checkpoint=``: a cache hit replays the cached features; otherwise the backbone extracts them from the
      images of ``data``'s ``split`` and the callback stores them in the cache.
    * ``features=<file>`` or the demo: the feature rows are replayed.
    """
    from lightning_putm.extraction import FeatureCache, file_sha256, load_checkpoint_backbone
    from lightning_putm.feature_modules import BackboneFeatures, FeatureRows, FeatureRowsDataModule

    if settings.checkpoint is None:
        feature_set = load_feature_source(settings)
        return FeatureRows(), FeatureRowsDataModule(feature_set), None

    checkpoint = settings.checkpoint
    if not checkpoint.is_file():
        raise FeatureError(f"checkpoint not found: {checkpoint}; pass checkpoint=PATH to a .ckpt written by "
                           "train_backbone.py (e.g. checkpoints/digits/conv4/s2m2r/best.ckpt)")
    split = settings.split
    datamodule, images, key = checkpoint_split(cfg, file_sha256(checkpoint), split)  # hashed once per run
    if settings.base_features is not None and settings.base_features.startswith(BASE_SPLIT_PREFIX):
        # from here on base_features names the cached file, which load_base_mean reads like any feature file
        base_split = settings.base_features[len(BASE_SPLIT_PREFIX):]
        settings.base_features = str(base_split_features(cfg, settings, base_split, key.checkpoint_sha256, log))
    data = cfg.data
    cache = FeatureCache(settings.feature_cache_dir, key)
    images.metadata.update(source=f"{checkpoint} on {data.name}/{split}", checkpoint=str(checkpoint),
                           checkpoint_sha256=key.checkpoint_sha256)
    cached = None if settings.refresh_features else cache.load()
    if cached is not None:
        log(f"features: reusing the cache {cache.path} (refresh_features=true rebuilds it)")
        return FeatureRows(), FeatureRowsDataModule(cached), None
    backbone, hparams = load_checkpoint_backbone(checkpoint, in_channels=datamodule.in_channels,
                                                 expected_backbone=settings.backbone)
    log(f"features: extracting the {split} split of {data.name} ({len(images)} images) with the "
        f"{hparams.get('backbone')} backbone of {checkpoint}")
    return BackboneFeatures(backbone), datamodule, cache


def checkpoint_split(cfg: DictConfig, checkpoint_sha256: str, split: str) -> tuple[Any, Any, Any]:
    """The datamodule whose test loop yields ``split`` of ``cfg.data`` (images in order, with their row index),
    the split itself, and the feature-cache key of (checkpoint content, dataset, split, eval transform)."""
    from lightning_putm.data.datamodule import FewShotDataModule
    from lightning_putm.data.transforms import eval_transform
    from lightning_putm.extraction import FeatureCacheKey

    data = cfg.data

    class SplitDataModule(FewShotDataModule):
        """The dataset's ``split`` as the test loop."""

        def test_dataloader(self):  # type: ignore[override]
            return self._eval_loader(split)

    datamodule = SplitDataModule(
        str(data.name), root=data.root, image_size=_data_int(data, "image_size", 1),
        eval_batch_size=_data_int(data, "eval_batch_size", 1), num_workers=_data_int(data, "num_workers", 0),
        normalize=_data_mapping(data, "normalize"), eval_resize=_data_positive(data, "eval_resize"),
        options=_data_mapping(data, "options") or {},
    )
    images = datamodule.split(split)
    if len(images) == 0:
        raise FeatureError(f"{data.name}: the {split} split is empty; check data.root and split=")
    transform = eval_transform(datamodule.image_size, datamodule.in_channels, datamodule.normalize,
                               from_files=not datamodule.info.in_memory, resize_factor=datamodule.eval_resize)
    key = FeatureCacheKey(
        checkpoint_sha256=checkpoint_sha256, dataset=str(data.name),
        root=str(Path(str(data.root)).expanduser().resolve()) if data.root else "",
        options=json.dumps(to_container(data.options) if data.options else {}, sort_keys=True), split=split,
        transform=repr(transform),
    )
    return datamodule, images, key


def base_split_features(cfg: DictConfig, settings: EvaluationSettings, split: str, checkpoint_sha256: str,
                        log: Callable[[str], None] = print) -> Path:
    """Features of the base classes (``split`` of ``cfg.data``) from the checkpoint's backbone, for CL2N.

    SimpleShot (Wang et al. 2019) centres features on the mean of the base classes the backbone was trained on;
    this extracts that split once (batched, in eval mode, with a progress bar) into the feature cache, under
    the same key rules as the evaluated split, and returns the cache file.
    """
    from lightning_putm.extraction import FeatureCache, load_checkpoint_backbone
    from lightning_putm.features import FeatureSet

    checkpoint = settings.checkpoint
    assert checkpoint is not None
    datamodule, images, key = checkpoint_split(cfg, checkpoint_sha256, split)
    cache = FeatureCache(settings.feature_cache_dir, key)
    if not settings.refresh_features and cache.load() is not None:
        log(f"base features: reusing the cache {cache.path}")
        return cache.path
    backbone, _ = load_checkpoint_backbone(checkpoint, in_channels=datamodule.in_channels,
                                           expected_backbone=settings.backbone)
    backbone = backbone.to(settings.device).eval()
    log(f"base features: extracting the {split} split of {cfg.data.name} ({len(images)} images) for CL2N")
    rows: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    with torch.inference_mode():
        for batch in tqdm(datamodule._eval_loader(split), desc=f"base features ({split})", unit="batch",
                          disable=not settings.progress, dynamic_ncols=True):
            rows.append(backbone(batch[0].to(settings.device)).float().cpu())
            labels.append(batch[1].cpu())
    metadata = {"source": f"{checkpoint} on {cfg.data.name}/{split}", "checkpoint": str(checkpoint),
                "checkpoint_sha256": key.checkpoint_sha256}
    feature_set = FeatureSet(torch.cat(rows).clone(), torch.cat(labels).clone(), list(images.class_names), metadata)
    feature_set.check_finite(f"base features of {cfg.data.name}/{split} from {checkpoint}")
    return cache.store(feature_set)

def _data_int(data: DictConfig, key: str, low: int) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"`data.{key}` must be an integer >= {low}, got {value!r}")
    return value


def _data_positive(data: DictConfig, key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"`data.{key}` must be a positive number, got {value!r}")
    return float(value)


def _data_mapping(data: DictConfig, key: str) -> dict[str, Any] | None:
    value = data[key]
    if value is None or value == {}:
        return None
    if not OmegaConf.is_dict(value):
        raise ConfigError(f"`data.{key}` must be a mapping (e.g. data.normalize={{mean: [0.5], std: [0.5]}}) or null, "
                          f"got {value!r}")
    return to_container(value)


def build_evaluation_trainer(settings: EvaluationSettings, logger: Any, callback: Any) -> Any:
    import pytorch_lightning as pl
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    kwargs = dict(settings.trainer)
    kwargs.update(logger=logger, callbacks=[callback], enable_checkpointing=False, inference_mode=False,
                  enable_progress_bar=settings.progress, enable_model_summary=False,
                  default_root_dir=str(settings.output_dir))
    try:
        return pl.Trainer(**kwargs)
    except (TypeError, ValueError, ImportError, RuntimeError, MemoryError, MisconfigurationException) as exc:
        raise ConfigError(f"invalid trainer options {settings.trainer}: {exc}") from exc


def run_evaluate(overrides: Sequence[str], log: Callable[[str], None] = print) -> list[SettingResult]:
    """The whole ``evaluate.py`` job: config → features (file, demo or checkpoint) → ``Trainer.test`` with the
    few-shot callback → table, CSV files, plots and logger entries."""
    import logging

    from pytorch_lightning.utilities import rank_zero_only

    from lightning_putm.callbacks import FewShotEvaluationCallback
    from lightning_putm.loggers import build_evaluation_logger

    cfg = load_evaluate_config(overrides)
    settings = settings_from_config(cfg)
    cfg.tasks = settings.tasks  # show the resolved value, not `auto`
    cfg.queries = settings.queries
    config_yaml = to_yaml(cfg)
    say = log if getattr(rank_zero_only, "rank", 0) == 0 else (lambda _: None)
    say("effective config:\n" + config_yaml)
    module, datamodule, cache = build_feature_source(cfg, settings, say)
    source = settings.checkpoint.stem if settings.checkpoint else Path(settings.features).stem
    logger = build_evaluation_logger(settings.logger, settings.output_dir, settings.wandb, f"evaluate-{source}", say)
    callback = FewShotEvaluationCallback(settings, feature_cache=cache, config_yaml=config_yaml, plots=settings.plots,
                                         plot_task=settings.plot_task, log=say)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)  # "GPU available: ..." banners
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)  # Lightning internals
    try:
        trainer = build_evaluation_trainer(settings, logger, callback)
        trainer.test(module, datamodule=datamodule, verbose=False)
    finally:  # also after an error: a W&B run left open would swallow the next run's logs in this process
        if type(logger).__name__ == "WandbLogger" and getattr(rank_zero_only, "rank", 0) == 0:
            logger.experiment.finish()
    return callback.results
