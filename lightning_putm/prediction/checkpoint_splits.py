"""What ``evaluate.py predict`` reads besides the user's images: splits of the checkpoint's own data.

Two of them, both extracted once through ``evaluate.py``'s extraction and feature cache:

* the base classes (``train``), whose feature mean centres CL2N for SimpleShot, BD-CSPN, LaplacianShot and
  BAVARDAGE (Wang et al. 2019);
* the validation classes (``val``), on which each method's probability temperature is fitted
  (:mod:`~lightning_putm.evaluation.calibration`), so that a ``probability`` of 0.9 is right about 9 times in 10.

Either may be missing here (data moved, a timm model that records no data); ``auto`` then falls back with a
notice that says how to get the real thing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from lightning_putm.atomic import atomic_write_text
from lightning_putm.errors import DataError, LightningPutmError
from lightning_putm.evaluation.calibration import CALIBRATION_CHUNK, Calibration, fit_calibration
from lightning_putm.evaluation.settings import BASE_SPLIT_PREFIX, checkpoint_data
from lightning_putm.evaluation.sources import Extraction, base_split_features, read_base_statistics
from lightning_putm.evaluation.store import tensor_digest
from lightning_putm.features.cache import file_sha256
from lightning_putm.features.files import load_features
from lightning_putm.methods import method_uses_base_covariance, method_uses_base_mean
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.prediction.settings import PredictSettings

#: Bump when a change to the calibration tasks or the fit changes the temperature a cache entry holds.
CALIBRATION_CACHE_VERSION = 2  # 2: the key holds the base statistics and learned parameters by content


def checkpoint_split(settings: PredictSettings, split: str, log: Callable[[str], None],
                     purpose: str = "base features", use: str = "for CL2N") -> Path:
    """Features of ``split`` of the checkpoint's own data, through ``evaluate.py``'s extraction and cache."""
    accelerator = {"cpu": "cpu", "cuda": "gpu"}[settings.device.type]
    extraction = Extraction(settings.checkpoint, settings.feature_cache_dir, trainer={"accelerator": accelerator},
                            progress=True, output_dir=settings.feature_cache_dir)  # thousands of images: say so
    return base_split_features(checkpoint_data(settings.checkpoint, settings.data_root), extraction, split,
                               file_sha256(settings.checkpoint), log, purpose=purpose, use=use)


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
            path = str(checkpoint_split(settings, split, log))
        except LightningPutmError as exc:
            if choice != "auto":
                raise
            note = (f"notice: {settings.method} uses plain L2 normalisation (L2N), not CL2N: the checkpoint's "
                    f"training data cannot be read here ({exc}); pass data_root=<folder> to use its base-class mean")
            log(note)
            return None, None, "L2N (training data not found)"
    statistics, rows = read_base_statistics(path, dim, method_uses_base_covariance(settings.method))
    return statistics.mean, statistics.covariance, f"CL2N (mean of {rows} base-class rows: {path})"


def calibration_features(settings: PredictSettings, log: Callable[[str], None]) -> Path | None:
    """The labelled feature file the temperature is fitted on; ``None`` (with a notice) where ``auto`` finds none."""
    choice = str(settings.calibration)
    if not (choice == "auto" or choice.startswith(BASE_SPLIT_PREFIX)):
        return Path(choice)
    if choice == "auto" and settings.timm_model is not None:
        log(f"notice: probabilities are the method's own (uncalibrated): a timm model records no validation classes; "
            f"pass calibration=<feature file of labelled classes outside your task, from timm:{settings.timm_model}> "
            f"(evaluate.py checkpoint=timm:{settings.timm_model} caches one per split in feature_cache_dir)")
        return None
    split = "val" if choice == "auto" else choice[len(BASE_SPLIT_PREFIX):]
    try:
        return checkpoint_split(settings, split, log, purpose="calibration features", use="to calibrate")
    except LightningPutmError as exc:
        if choice != "auto":
            raise
        log(f"notice: probabilities are the method's own (uncalibrated): the checkpoint's {split} split cannot be "
            f"read here ({exc}); pass data_root=<folder>, calibration=<labelled feature file> or calibration=<T>")
        return None


def resolve_calibration(settings: PredictSettings, method: FewShotMethod, ways: int, shots: int, queries: int,
                        normalisation: str, log: Callable[[str], None],
                        base: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> Calibration | None:
    """The temperature for this task: given, fitted on validation tasks (cached), or ``None`` (raw probabilities).

    A fit solves ``calibration_tasks`` tasks with the method, which can take far longer than the user's own task:
    before it starts, the console says so and how to make it cheaper or skip it (:func:`calibration_cost`); the
    time it will take follows its first chunk of tasks (:func:`~lightning_putm.evaluation.calibration.
    predict_in_chunks`).

    The fit depends on the features, the method, its settings and what it read from files, the base-class
    statistics it normalises with (``base``: mean, covariance), the task's shape and the seed; all of them make the
    cache key (by content), so a changed input never reuses a stale temperature.
    """
    if settings.calibration is None:
        return None
    if isinstance(settings.calibration, float):
        return Calibration(settings.calibration, 0, 0, float("nan"), float("nan"), float("nan"))
    path = calibration_features(settings, log)
    if path is None:
        return None
    key = {"version": CALIBRATION_CACHE_VERSION, "features": file_sha256(path), "method": settings.method,
           "params": settings.method_params, "learned": method.learned_inputs(), "normalisation": normalisation,
           "base_mean": tensor_digest(base[0]), "base_covariance": tensor_digest(base[1]), "ways": ways,
           "shots": shots, "queries": queries, "tasks": settings.calibration_tasks, "seed": settings.seed}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    cache = settings.feature_cache_dir / "calibration" / f"{settings.method}-{digest[:16]}.json"
    if cache.is_file():
        try:
            stored = json.loads(cache.read_text())
            if stored.get("key") == json.loads(json.dumps(key, sort_keys=True, default=str)):
                log(f"calibration: reusing {cache}")
                return usable(Calibration(**stored["calibration"]), path, log)
        except (OSError, ValueError, TypeError, KeyError):
            pass  # an unreadable entry is refitted and rewritten
    feature_set = load_features(path)
    if ways > len(feature_set.class_names):
        problem = (f"{path} has {len(feature_set.class_names)} classes but the task has {ways}; pass "
                   f"calibration=<feature file with at least {ways} classes>")
        if settings.calibration != "auto":
            raise DataError(f"calibration={settings.calibration}: {problem}")
        log(f"notice: probabilities are the method's own (uncalibrated): {problem}")
        return None
    log(f"calibration: {settings.method} on {settings.calibration_tasks} labelled tasks of {path.name} "
        f"({ways} classes × {shots} shot{'' if shots == 1 else 's'}); {calibration_cost(settings)}")
    try:
        calibration = fit_calibration(method, feature_set, ways, shots, queries, settings.calibration_tasks,
                                      settings.seed, settings.device, progress=True, log=log)
    except DataError as exc:  # e.g. validation classes with fewer images than the task's shots
        if settings.calibration != "auto":
            raise DataError(f"calibration={settings.calibration}: {exc}") from exc
        log(f"notice: probabilities are the method's own (uncalibrated): no {ways}-way {shots}-shot task can be drawn "
            f"from {path} ({exc}); pass calibration=<labelled feature file> or calibration=<T>")
        return None
    atomic_write_text(cache, json.dumps({"key": key, "calibration": calibration.__dict__}, sort_keys=True,
                                        default=str, indent=1))
    return usable(calibration, path, log)


def calibration_cost(settings: PredictSettings) -> str:
    """What the fit will cost, said before it starts: the tasks it solves (in chunks; the time it takes follows
    the first), that it is paid once, and how to spend less. The user's own single task is no guide to the time:
    a method solves a chunk of 25 tasks in a few times one task's time (measured: docs/predict.md, "What calibration
    costs")."""
    tasks = settings.calibration_tasks
    chunks = -(-tasks // CALIBRATION_CHUNK)
    return (f"{chunks} chunk{'' if chunks == 1 else 's'} of up to {CALIBRATION_CHUNK} tasks (the time they take "
            "follows the first), once per method, settings and task shape (the temperature is cached); fewer "
            "calibration_tasks cost less (a noisier temperature), calibration=<temperature> or calibration=null "
            "skip it (docs/predict.md)")


def usable(calibration: Calibration, path: Path, log: Callable[[str], None]) -> Calibration | None:
    """``calibration``, or ``None`` with a notice when its fit ran to the end of its range (no temperature)."""
    if calibration.fitted:
        return calibration
    if calibration.accuracy >= 100.0:
        why = (f"the method labelled every query of the {calibration.tasks} tasks of {path.name} correctly, so they "
               "cannot show how sure it should be (classes the backbone was trained on?)")
    else:
        why = f"no temperature fits the {calibration.tasks} tasks of {path.name} (accuracy {calibration.accuracy:.1f}%)"
    log(f"notice: probabilities are the method's own (uncalibrated): {why}; pass calibration=<feature file of "
        "classes the backbone did not train on> or calibration=<T>")
    return None
