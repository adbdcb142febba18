"""The ``evaluate.py predict`` job: a checkpoint, labelled support folders and query images → predictions CSV.

Order matters for trust: the config, the method's settings, the output paths, both folders, the checkpoint and
every image are checked before anything is written. Only then are the base-class features for CL2N extracted
(and cached, as ``evaluate.py`` does), the task solved and the two CSV files written. No logger, no run folder.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Callable, Sequence

import torch

from lightning_putm.errors import LightningPutmError
from lightning_putm.evaluation.settings import BASE_SPLIT_PREFIX, checkpoint_data
from lightning_putm.evaluation.sources import Extraction, base_split_features, read_base_statistics
from lightning_putm.features.cache import file_sha256
from lightning_putm.methods import build_method, method_uses_base_covariance, method_uses_base_mean
from lightning_putm.models.timm_pretrained import find_weights, load_timm_backbone
from lightning_putm.prediction.images import checkpoint_image_reader, extract_features, read_folders, timm_image_reader
from lightning_putm.prediction.outputs import (estimated_counts, predict_task, summary_table, write_counts,
                                               write_predictions)
from lightning_putm.prediction.settings import PredictResult, PredictSettings, load_predict_config, predict_settings
from lightning_putm.pretraining.checkpoints import load_checkpoint_backbone


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
    if choice == "auto" and settings.timm_model is not None:
        log(f"notice: {settings.method} uses plain L2 normalisation (L2N), not CL2N: a timm model records no training "
            f"data; pass base_features=<feature file of base classes from timm:{settings.timm_model}> (evaluate.py "
            f"checkpoint=timm:{settings.timm_model} base_features=split:train caches one in feature_cache_dir)")
        return None, None, "L2N (a timm model records no base classes)"
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
    statistics, rows = read_base_statistics(path, dim, method_uses_base_covariance(settings.method))
    return statistics.mean, statistics.covariance, f"CL2N (mean of {rows} base-class rows: {path})"


def checkpoint_base_split(settings: PredictSettings, split: str, log: Callable[[str], None]) -> Path:
    """Features of ``split`` of the checkpoint's own data, through ``evaluate.py``'s extraction and cache."""
    accelerator = {"cpu": "cpu", "cuda": "gpu"}[settings.device.type]
    extraction = Extraction(settings.checkpoint, settings.feature_cache_dir, trainer={"accelerator": accelerator},
                            output_dir=settings.feature_cache_dir)
    return base_split_features(checkpoint_data(settings.checkpoint, settings.data_root), extraction, split,
                               file_sha256(settings.checkpoint), log)


def run_predict(overrides: Sequence[str], log: Callable[[str], None] = print) -> PredictResult:
    """Run ``evaluate.py predict`` with ``key=value`` overrides; returns what was predicted and written."""
    cfg, method_name = load_predict_config(overrides)
    settings = predict_settings(cfg, method_name)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)  # "GPU available: ..." banners of the base-split extraction
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)
    images = read_folders(settings.support, settings.query)
    if settings.timm_model is not None:
        weights = find_weights(settings.timm_model, settings.pretrained_file)
        backbone = load_timm_backbone(weights)
        reader = timm_image_reader(settings.timm_model)
        described = f"timm:{weights.model} (weights from {weights.origin})"
    else:
        backbone, hparams = load_checkpoint_backbone(settings.checkpoint)
        reader = checkpoint_image_reader(hparams, str(settings.checkpoint))
        described = f"{hparams.get('backbone')} backbone of {settings.checkpoint}"
    shots = images.shots()
    log(f"predict: {settings.method} on {images.ways} classes ({', '.join(images.class_names)}), support images per "
        f"class {shots}, {len(images.query_paths)} query images | {described}")
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
