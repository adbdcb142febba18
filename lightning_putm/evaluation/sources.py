"""Where the evaluated features come from: the built-in demo, a feature file, a backbone checkpoint or a timm model.

With ``checkpoint=`` the backbone's features of ``data``'s split are extracted in the test loop of
``Trainer.test`` (:class:`~lightning_putm.features.extraction.BackboneFeatures`) and cached by content
(:mod:`lightning_putm.features.cache`); a cache hit, a feature file or the demo is replayed through the same loop
(:class:`~lightning_putm.features.extraction.FeatureRows`). CL2N's base-class mean (SimpleShot, Wang et al. 2019)
is read from ``base_features``: a feature file, or a split extracted with the checkpoint.

``checkpoint=timm:<model name>`` takes a pretrained timm model instead (:mod:`lightning_putm.models.timm_pretrained`):
the images of every split go through the model's own preprocessing, and the cache key holds the model's name and
the SHA-256 of its weights file (``pretrained_file=`` or the hub cache's).
"""

from __future__ import annotations

import functools
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from lightning_putm.config import build_trainer, to_container
from lightning_putm.data.datamodule import FewShotDataModule
from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.data.transforms import eval_transform
from lightning_putm.errors import FeatureError
from lightning_putm.evaluation.progress import extraction_bar
from lightning_putm.evaluation.settings import BASE_SPLIT_PREFIX, EvaluationSettings
from lightning_putm.features.cache import FeatureCache, FeatureCacheKey, extraction_precision, file_sha256
from lightning_putm.features.extraction import BackboneFeatures, FeatureCollector, FeatureRows, FeatureRowsDataModule
from lightning_putm.features.files import FeatureSet, check_feature_path, load_features
from lightning_putm.methods import method_uses_base_covariance, method_uses_base_mean
from lightning_putm.methods.bavardage import base_within_class_scatter
from lightning_putm.models.timm_pretrained import TimmWeights, find_weights, load_timm_backbone, timm_transform
from lightning_putm.pretraining.checkpoints import (check_checkpoint_backbone, load_checkpoint_backbone,
                                                    missing_checkpoint_hint)
from lightning_putm.signals import interrupting_signal, stop_on_signals
from lightning_putm.validators import integer, mapping, positive

def load_feature_source(settings: EvaluationSettings) -> FeatureSet:
    """The feature set named by ``features=``: the built-in demo or a file."""
    feature_set = digits_feature_set() if settings.features == "demo" else load_features(
        settings.features, allow_pickle=settings.allow_pickle
    )
    feature_set.check_finite(f"features from {settings.features}")
    return feature_set


@dataclass
class BaseStatistics:
    """Statistics of the base classes some methods normalise with: the mean (CL2N: SimpleShot, BD-CSPN,
    LaplacianShot, BAVARDAGE) and the within-class scatter (BAVARDAGE's whitening)."""

    mean: torch.Tensor | None = None  # [d]
    covariance: torch.Tensor | None = None  # [d, d]


@dataclass(frozen=True)
class Extraction:
    """What extracting a split's features from a checkpoint needs besides the data: the checkpoint, the feature
    cache, the backbone it should hold, the Trainer's accelerator and precision, and the console."""

    checkpoint: Path
    feature_cache_dir: Path
    refresh_features: bool = False
    backbone: str = "auto"  # the backbone the checkpoint must hold (auto: whatever it holds)
    trainer: dict[str, Any] = field(default_factory=dict)  # its accelerator and precision are used
    progress: bool = False
    output_dir: Path | None = None  # the Trainer's root folder
    weights: TimmWeights | None = None  # checkpoint=timm:<name>: the model and its weights file

    @classmethod
    def of(cls, settings: EvaluationSettings, weights: TimmWeights | None = None) -> Extraction:
        """The extraction an ``evaluate.py checkpoint=...`` run does (``weights``: of its timm model)."""
        assert settings.checkpoint is not None
        return cls(settings.checkpoint, settings.feature_cache_dir, settings.refresh_features, settings.backbone,
                   settings.trainer, settings.progress, settings.output_dir, weights)

    def source(self) -> str:
        """What the features come from, for the feature set's metadata and the console."""
        return str(self.checkpoint) if self.weights is None else f"timm:{self.weights.model} ({self.weights.file})"


def load_base_statistics(settings: EvaluationSettings, dim: int, log: Callable[[str], None] = print) -> BaseStatistics:
    """The statistics of ``base_features`` that the selected methods use, or none with one notice when it is not set."""
    if settings.base_features is None:
        notice = missing_base_notice(settings)
        if notice:
            log(notice)
        return BaseStatistics()
    covariance = any(method_uses_base_covariance(name) for name in settings.methods)
    statistics, rows = read_base_statistics(settings.base_features, dim, covariance, settings.allow_pickle)
    log(f"base-class mean for CL2N: {rows} rows of {settings.base_features}")
    return statistics


def check_base_features(settings: EvaluationSettings, dim: int) -> None:
    """The errors of :func:`read_base_statistics` (an unreadable file, another dimension, NaN, no rows) before the
    run folder exists. The statistics the methods will use are computed here, once: :func:`load_base_statistics`
    finds them in :func:`read_base_statistics`'s cache instead of reading the file again."""
    if settings.base_features is not None:
        covariance = any(method_uses_base_covariance(name) for name in settings.methods)
        read_base_statistics(settings.base_features, dim, covariance, settings.allow_pickle)


def read_base_statistics(path: str | Path, dim: int, covariance: bool,
                         allow_pickle: bool = False) -> tuple[BaseStatistics, int]:
    """The base-class mean of the feature file ``path`` (and, with ``covariance``, BAVARDAGE's within-class
    scatter), checked against the evaluated features' dimension ``dim``; also the number of rows it holds.

    A run asks twice (the check before its folder exists, then the methods): the last few results are kept,
    keyed by the file's identity (path, inode, size, modification time: a file rewritten or replaced is read
    again), and each caller gets its own copy: a base file of miniImageNet's size is slow to read and average
    (measured: docs/lab/code-notes.md#reading-a-base-feature-file)."""
    try:
        status = Path(path).stat()
    except OSError:  # load_features names the file and the fix
        return _read_base_statistics(path, dim, covariance, allow_pickle)
    statistics, rows = _cached_base_statistics(str(path), (status.st_dev, status.st_ino, status.st_size,
                                                           status.st_mtime_ns), dim, covariance, allow_pickle)
    return BaseStatistics(*(None if t is None else t.clone() for t in (statistics.mean, statistics.covariance))), rows


@functools.lru_cache(maxsize=4)
def _cached_base_statistics(path: str, version: tuple[int, int, int, int], dim: int, covariance: bool,
                            allow_pickle: bool) -> tuple[BaseStatistics, int]:
    """:func:`_read_base_statistics` of one version of a file (``version``: its device, inode, size and
    modification time)."""
    return _read_base_statistics(path, dim, covariance, allow_pickle)


def _read_base_statistics(path: str | Path, dim: int, covariance: bool,
                          allow_pickle: bool) -> tuple[BaseStatistics, int]:
    """:func:`read_base_statistics` without the cache."""
    base = load_features(path, allow_pickle=allow_pickle, setting="base_features=")
    base.check_finite(f"base features from {path}")
    if base.dim != dim:
        raise FeatureError(f"base_features {path} has d={base.dim} but the evaluated features have d={dim}; "
                           "both must come from the same backbone")
    if len(base) == 0:
        raise FeatureError(f"base_features {path} has no rows")
    mean = base.features.double().mean(0).float()
    scatter = base_within_class_scatter(base.features, base.labels, mean) if covariance else None
    return BaseStatistics(mean, scatter), len(base)


def missing_base_notice(settings: EvaluationSettings) -> str:
    """The one notice of a run without ``base_features``: which of ITS methods fall back to what, and the fix.

    Only the methods this run evaluates are named; BAVARDAGE is named for its own fallback (it centres each task
    on the mean of the task's rows) only when it runs with ``task_centring`` on, else it is one of the L2N ones.
    """
    users = [name for name in settings.methods if method_uses_base_mean(name)]
    centring = [name for name in users if name == "bavardage"
                and settings.method_params.get(name, {}).get("task_centring", True)]
    plain = [name for name in users if name not in centring]
    if not users:
        return ""
    said = []
    if plain:
        said.append(f"{', '.join(plain)} cannot subtract the base-class mean (CL2N) and use plain L2 normalisation "
                    "(L2N) instead")
    if centring:
        said.append("bavardage centres each task on the mean of its own rows instead of the base-class mean")
    return (f"notice: no base_features file given, so {'; '.join(said)}; pass base_features=<file> with features "
            "of the base classes from the same backbone (with checkpoint=: base_features=split:train)")


def check_source_exists(settings: EvaluationSettings) -> None:
    """The checkpoint or feature file the settings evaluate is a file (a study checks every point's before it
    starts); a timm model's weights and the demo need none."""
    checkpoint = settings.checkpoint
    if checkpoint is not None and settings.timm_model is None and not checkpoint.is_file():
        what = "is a folder" if checkpoint.is_dir() else "not found"
        raise FeatureError(f"checkpoint {what}: {checkpoint}; {missing_checkpoint_hint(checkpoint)}")
    if checkpoint is None and settings.features != "demo":
        check_feature_path(settings.features)


@dataclass
class FeatureSource:
    """The test loop's module and datamodule, the feature cache to fill (``None`` when nothing is extracted), and
    the split's labels and class names, so that its episodes can be checked before any output exists."""

    module: Any
    datamodule: Any
    cache: FeatureCache | None
    labels: torch.Tensor
    class_names: list[str]
    features: torch.Tensor | None = None  # None: extracted by the test loop


def build_feature_source(cfg: DictConfig, settings: EvaluationSettings,
                         log: Callable[[str], None] = print) -> FeatureSource:
    """Where the evaluated features come from (:class:`FeatureSource`).

    * ``checkpoint=``: a cache hit replays the cached features; otherwise the backbone extracts them from the
      images of ``data``'s ``split`` and the callback stores them in the cache.
    * ``features=<file>`` or the demo: the feature rows are replayed.
    """
    if settings.checkpoint is None:
        feature_set = load_feature_source(settings)
        return FeatureSource(FeatureRows(), FeatureRowsDataModule(feature_set), None, feature_set.labels,
                             list(feature_set.class_names), feature_set.features)

    checkpoint = settings.checkpoint
    weights = None
    check_source_exists(settings)
    if settings.timm_model is not None:  # no file to check: the weights file is found (or downloaded) now
        weights = find_weights(settings.timm_model, settings.pretrained_file)
        log(f"timm:{weights.model}: weights from {weights.origin}")
    extraction = Extraction.of(settings, weights)
    split = settings.split
    datamodule, images, key = checkpoint_split(cfg.data, file_sha256(weights.file if weights else checkpoint), split,
                                               weights, settings.trainer.get("precision"))  # hashed once per run
    if settings.base_features is not None and settings.base_features.startswith(BASE_SPLIT_PREFIX):
        # from here on base_features names the cached file, which load_base_statistics reads like any feature file
        base_split = settings.base_features[len(BASE_SPLIT_PREFIX):]
        settings.base_features = str(base_split_features(cfg.data, extraction, base_split, key.checkpoint_sha256, log))
    data = cfg.data
    cache = FeatureCache(settings.feature_cache_dir, key)
    images.metadata.update(source=f"{extraction.source()} on {data.name}/{split}", checkpoint=str(checkpoint),
                           checkpoint_sha256=key.checkpoint_sha256)
    cached = None if settings.refresh_features else fresh_cache(cache, images, log)
    if cached is not None:
        if weights is None:  # backbone= is checked on a cache hit too
            check_checkpoint_backbone(checkpoint, settings.backbone)
        log(f"features: reusing the cache {cache.path} (refresh_features=true rebuilds it)")
        return FeatureSource(FeatureRows(), FeatureRowsDataModule(cached), None, cached.labels,
                             list(cached.class_names), cached.features)
    if weights is not None:
        backbone = load_timm_backbone(weights)
        log(f"features: extracting the {split} split of {data.name} ({len(images)} images) with timm:{weights.model} "
            f"(its own preprocessing: {datamodule.eval_transform_override!r})")
        return FeatureSource(BackboneFeatures(backbone), datamodule, cache, images.labels, list(images.class_names))
    backbone, hparams = load_checkpoint_backbone(checkpoint, in_channels=datamodule.in_channels,
                                                 expected_backbone=settings.backbone)
    log(f"features: extracting the {split} split of {data.name} ({len(images)} images) with the "
        f"{hparams.get('backbone')} backbone of {checkpoint}")
    return FeatureSource(BackboneFeatures(backbone), datamodule, cache, images.labels, list(images.class_names))


def checkpoint_split(data: DictConfig, checkpoint_sha256: str, split: str, weights: TimmWeights | None = None,
                     precision: object = None) -> tuple[FewShotDataModule, ImageSplit, FeatureCacheKey]:
    """The datamodule whose test loop yields ``split`` of ``data`` (images in order, with their row index),
    the split itself, and the feature-cache key of (checkpoint content, dataset, split, eval transform).

    With a timm model (``weights``) the images go through the model's own preprocessing instead of ``data``'s
    evaluation transform, and the key also holds the model's name (``checkpoint_sha256`` is its weights file's).
    ``precision`` is the extracting Trainer's ``precision``: part of the key unless it is full precision."""
    override = timm_transform(weights.model) if weights is not None else None

    class SplitDataModule(FewShotDataModule):
        """The dataset's ``split`` as the test loop."""

        eval_transform_override = override

        def test_dataloader(self):  # type: ignore[override]
            return self._eval_loader(split, self.eval_transform_override)

    datamodule = SplitDataModule(
        str(data.name), root=data.root, image_size=integer(data.image_size, "data.image_size", 1),
        eval_batch_size=integer(data.eval_batch_size, "data.eval_batch_size", 1), num_workers=integer(data.num_workers, "data.num_workers", 0),
        normalize=_data_mapping(data, "normalize"), eval_resize=float(positive(data.eval_resize, "data.eval_resize")),
        options=_data_mapping(data, "options") or {}, download=data.get("download", False),
    )
    images = datamodule.split(split)
    if len(images) == 0:
        raise FeatureError(f"{data.name}: the {split} split is empty; check data.root and split=")
    transform = override if override is not None else eval_transform(
        datamodule.image_size, datamodule.in_channels, datamodule.normalize, from_files=not datamodule.info.in_memory,
        resize_factor=datamodule.eval_resize)
    key = FeatureCacheKey(
        checkpoint_sha256=checkpoint_sha256, dataset=str(data.name),
        root=str(Path(str(data.root)).expanduser().resolve()) if data.root else "",
        options=json.dumps(to_container(data.options) if data.options else {}, sort_keys=True), split=split,
        transform=repr(transform), model=weights.model if weights is not None else "",
        precision=extraction_precision(precision),
    )
    return datamodule, images, key


def fresh_cache(cache: FeatureCache, images: ImageSplit, log: Callable[[str], None]) -> FeatureSet | None:
    """The cached features of ``images``, or ``None`` when there are none or they no longer match the split.

    The cache key holds the data's root, options and split, not the files in it: images added to or removed from
    the folder would otherwise be evaluated with the old features (a new class silently left out). The labels and
    class names of the split as read now must equal the cached ones."""
    cached = cache.load()
    if cached is None:
        return None
    if list(cached.class_names) != list(images.class_names) or not torch.equal(cached.labels, images.labels):
        log(f"features: the cache {cache.path} no longer matches the split ({len(cached)} images of "
            f"{len(cached.class_names)} classes cached, {len(images)} of {len(images.class_names)} now): extracting "
            "again")
        return None
    return cached


def base_split_features(data: DictConfig, extraction: Extraction, split: str, checkpoint_sha256: str,
                        log: Callable[[str], None] = print, purpose: str = "base features",
                        use: str = "for CL2N") -> Path:
    """Features of the base classes (``split`` of ``data``) from the checkpoint's backbone, for CL2N.

    SimpleShot (Wang et al. 2019) centres features on the mean of the base classes the backbone was trained on;
    this extracts that split once, through the same ``Trainer.test`` loop as the evaluated split, into the
    feature cache under the same key rules, and returns the cache file. ``evaluate.py`` and ``evaluate.py
    predict`` both call it, so they share the cache (``predict`` also reads the validation split with it, to
    calibrate its probabilities: ``purpose`` and ``use`` say why in the console lines).
    """
    checkpoint = extraction.checkpoint
    datamodule, images, key = checkpoint_split(data, checkpoint_sha256, split, extraction.weights,
                                               extraction.trainer.get("precision"))
    cache = FeatureCache(extraction.feature_cache_dir, key)
    if not extraction.refresh_features and fresh_cache(cache, images, log) is not None:
        log(f"{purpose}: reusing the cache {cache.path}")
        return cache.path
    if extraction.weights is not None:
        backbone = load_timm_backbone(extraction.weights)
    else:
        backbone, _ = load_checkpoint_backbone(checkpoint, in_channels=datamodule.in_channels,
                                               expected_backbone=extraction.backbone)
    log(f"{purpose}: extracting the {split} split of {data.name} ({len(images)} images)" + (f" {use}" if use else ""))
    feature_set = extract_split(BackboneFeatures(backbone), datamodule, split, extraction, log)
    feature_set.metadata.update(source=f"{extraction.source()} on {data.name}/{split}", checkpoint=str(checkpoint),
                                checkpoint_sha256=key.checkpoint_sha256)
    feature_set.check_finite(f"base features of {data.name}/{split} from {extraction.source()}")
    return cache.store(feature_set)


def _data_mapping(data: DictConfig, key: str) -> dict[str, Any] | None:
    """``data.<key>``: a mapping or null (an empty mapping counts as null)."""
    return mapping(data[key], f"data.{key}", example=f"data.{key}={{mean: [0.5], std: [0.5]}}") or None


def extract_split(module: BackboneFeatures, datamodule: FewShotDataModule, split: str,
                  settings: Extraction, log: Callable[[str], None] = print) -> FeatureSet:
    """Features of ``split`` (the test loop of ``datamodule``) through ``module``, on one device (``log``: the
    progress lines where no bar is drawn).

    Ctrl-C and SIGTERM stop it within a batch (:func:`~lightning_putm.signals.stop_on_signals`) with one line:
    ``KeyboardInterrupt``, or ``InterruptedError`` for SIGTERM (exit status 143); nothing is cached before the split
    is complete, so the same command extracts it again."""
    collector = FeatureCollector(split)
    options = {k: v for k, v in settings.trainer.items() if k in ("accelerator", "precision")}
    trainer = build_trainer(options, devices=1, logger=False, enable_checkpointing=False,
                            callbacks=[collector, *extraction_bar(settings.progress, log)],
                            enable_progress_bar=settings.progress, enable_model_summary=False,
                            default_root_dir=str(settings.output_dir))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with stop_on_signals():
            trainer.test(module, datamodule=datamodule, verbose=False)
    except SystemExit as exc:  # Lightning turns the interruption into exit(1) and leaves SIGINT ignored
        if not trainer.interrupted:
            raise
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
        message = (f"feature extraction of the {split} split stopped before it was complete (nothing was cached); run "
                   "the same command again to extract it")
        if interrupting_signal(exc) == signal.SIGTERM or trainer.received_sigterm:
            raise InterruptedError(f"{message} (the process received a termination signal, SIGTERM)") from None
        raise KeyboardInterrupt(message) from None
    assert collector.feature_set is not None
    return collector.feature_set
