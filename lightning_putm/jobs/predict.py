"""The ``evaluate.py predict`` job: a checkpoint, labelled support folders and query images → predictions CSV.

Order matters for trust: the config, the method's settings, the output paths, both folders, the checkpoint and
every image are checked before anything is written. Only then are the base-class features for CL2N extracted
(and cached, as ``evaluate.py`` does), the task solved, the probabilities calibrated on validation tasks and
the two CSV files written. No logger, no run folder. The config is checked before torch is imported, so that a
mistyped key is reported at once.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Sequence

from lightning_putm.prediction.settings import PredictResult, load_predict_config, predict_settings


def run_predict(overrides: Sequence[str], log: Callable[[str], None] = print) -> PredictResult:
    """Run ``evaluate.py predict`` with ``key=value`` overrides; returns what was predicted and written."""
    cfg, method_name = load_predict_config(overrides)
    settings = predict_settings(cfg, method_name)
    # the config is valid: now torch, the backbone and the methods
    from lightning_putm.methods import build_method
    from lightning_putm.methods.calibration import scale_probabilities, soft_counts
    from lightning_putm.models.timm_pretrained import find_weights, load_timm_backbone
    from lightning_putm.prediction.checkpoint_splits import base_statistics, resolve_calibration, unem_default_params
    from lightning_putm.prediction.images import (checkpoint_image_reader, extract_features, read_folders,
                                                  timm_image_reader)
    from lightning_putm.prediction.outputs import predict_task, summary_table, write_counts, write_predictions
    from lightning_putm.pretraining.checkpoints import load_checkpoint_backbone

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
    from lightning_putm.evaluation.progress import ProgressLines, on_terminal  # (it imports Lightning)

    features = []
    for kind, paths in (("support", images.support_paths), ("query", images.query_paths)):
        lines = None if on_terminal() else ProgressLines(f"reading {kind} images", len(paths), log)  # a log file
        features.append(extract_features(backbone, paths, reader, settings.device, settings.batch_size,
                                         None if lines is None else lines.update))
        if lines is not None:
            lines.close()
    support, query = features
    mean, covariance, normalisation = base_statistics(settings, support.shape[1], log)
    # K may differ per class; a method's "by setting" defaults (PUTM's inertia, α-TIM's α, LaplacianShot's λ)
    # follow the smallest class. The query proportions are unknown, so the Dirichlet (imbalanced) defaults apply.
    params = unem_default_params(settings, images.ways, min(shots), len(images.query_paths), log)  # UNEM's auto
    method = build_method(settings.method, params, shots=min(shots), balanced=False,
                          base_mean=mean, base_covariance=covariance, memory_budget_mb=settings.memory_budget_mb)
    device = settings.device
    raw = predict_task(method, support.to(device), images.support_labels.to(device), query.to(device), images.ways,
                       settings.seed)
    calibration = resolve_calibration(settings, method, images.ways, min(shots), len(images.query_paths),
                                      normalisation, log, base=(mean, covariance))
    probabilities = raw if calibration is None else scale_probabilities(raw, calibration.temperature)
    predicted = raw.argmax(dim=1)  # the method's decision; calibration never changes it
    write_predictions(settings.output, images, probabilities, predicted)
    write_counts(settings.counts_output, images, probabilities, predicted)
    counts = soft_counts(probabilities)
    if calibration is None:
        log("probabilities: the method's own, not calibrated" + (" (calibration=null)" if settings.calibration is None
                                                                   else ""))
    elif calibration.tasks:
        log(f"probabilities: calibrated, {calibration.describe()}")
    else:
        log(f"probabilities: scaled by the given temperature {calibration.temperature:g}")
    estimate = "π_f, PUTM's forward navigator" if settings.method == "putm" else f"{settings.method}'s probabilities"
    log(f"estimated queries per class = the sums of the {'calibrated ' if calibration else ''}query probabilities "
        f"({estimate}), with a 95% interval Σp ± 1.96·√Σp(1−p)" + (f"; normalisation: {normalisation}"
                                                                    if normalisation else ""))
    log(summary_table(images, probabilities, predicted))
    log(f"wrote {settings.output} ({len(images.query_paths)} rows) and {settings.counts_output}")
    return PredictResult(images, probabilities, counts.estimate, settings.output, settings.counts_output,
                         normalisation, raw, calibration)
