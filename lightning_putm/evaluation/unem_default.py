"""UNEM's default parameters (``method.unem.learned: auto``): fitted on the validation classes of the evaluated
checkpoint's data, once and cached; else the untrained start, with one notice that says why.

UNEM's 21 parameters belong to the features they were learned on (Zhou et al., CVPR 2025, learn them on each
dataset's validation classes). On other features the authors' published values (``learned=mini_resnet18``) put
UNEM far below its own untrained start (docs/methods/unem.md). So ``auto`` means:

* ``evaluate.py checkpoint=...`` (a file or a timm model) whose data has a ``val`` split, evaluated on another
  split: that split's features are extracted with the same backbone (``evaluate.py``'s feature cache), and per
  shot count the parameters are fitted on ``method.unem.fit_tasks`` seeded validation tasks (1000, the
  reference's) with the reference trainer's settings (:func:`~lightning_putm.methods.unem_fit.fit_params`). They
  are kept only if they are at least as accurate as the untrained start on as many other validation tasks per α
  of :data:`HELD_OUT_ALPHAS` (another seed): a fit can then not make the default worse than its start on the
  validation classes.
  The choice is written atomically as a parameter file keyed by the validation features' content (so by the
  checkpoint's content, the data and the split), the task shape, the seed, the device and every setting of the
  fit, and read back on the next run instead of fitting again;
* anything else (a feature file, the demo, a dataset without validation classes, the val split evaluated itself)
  is the untrained start ``t1 = gamma = t2 = 1``, which :class:`~lightning_putm.methods.unem.UNEM` gives ``auto``.

The fitted file reaches the method as ``params_file`` (``{shots}`` in its name), so the stored-setting key, the
console and the run's provenance name the parameters that were used.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig

from lightning_putm.data.episodes import TooManyQueries, check_episodes_possible, sample_episode_bank, workable_queries
from lightning_putm.errors import DataError, LightningPutmError
from lightning_putm.evaluation.progress import format_duration
from lightning_putm.evaluation.settings import EvaluationSettings
from lightning_putm.evaluation.sources import FeatureSource, base_split_features
from lightning_putm.features.files import FeatureSet, load_features
from lightning_putm.methods.peer_settings import AUTO, FitSettings
from lightning_putm.methods.unem import UNEM, UNEMParams, load_params
from lightning_putm.methods.unem_fit import fit_params, save_params
from lightning_putm.validators import alpha_label

#: Dirichlet α of the fit's tasks (``fit-unem``'s default: the evaluation's default imbalanced setting).
FIT_ALPHA = 2.0
#: The α values of the check against the untrained start (Dirichlet 2 and balanced: the evaluation's defaults).
HELD_OUT_ALPHAS: tuple[float | None, ...] = (2.0, None)
#: Bump when a change to the fit, its tasks or the check changes what a cache entry holds.
CACHE_VERSION = 1
#: The cache's folder under ``feature_cache_dir``.
CACHE_FOLDER = "unem"
VAL_SPLIT = "val"


@dataclass(frozen=True)
class DefaultFit:
    """The parameters ``auto`` chose for one shot count, and why (for the console and the provenance)."""

    shots: int
    path: Path
    params: UNEMParams
    fitted: bool  # False: the fit was less accurate than the untrained start on held-out validation tasks
    fitted_accuracy: float  # %, on the held-out validation tasks (mean over HELD_OUT_ALPHAS)
    initial_accuracy: float
    queries: int
    seconds: float  # the fit's
    reused: bool  # read from the cache


def wants_default(settings: EvaluationSettings) -> bool:
    """The run evaluates UNEM with ``learned=auto`` and no ``params_file``."""
    params = settings.method_params.get("unem", {})
    return "unem" in settings.methods and params.get("learned", AUTO) == AUTO and not params.get("params_file")


def fit_queries(labels: torch.Tensor, ways: int, shots: int, queries: int, alphas: list[float | None], tasks: int,
                seed: int) -> int:
    """``queries`` when every α's tasks can be drawn with them, else the largest count that can
    (:func:`~lightning_putm.data.episodes.workable_queries`); a :class:`DataError` when none can (a class with
    fewer images than ``shots``). With a balanced α the count is first rounded down to a multiple of ``ways``."""
    if None in alphas:
        queries = max(ways, queries // ways * ways)
    try:
        check_episodes_possible(labels, ways, [shots], queries, alphas, tasks, seed)
        return queries
    except TooManyQueries:
        fewer = workable_queries(labels, ways, [shots], queries, alphas, tasks, seed)
        if fewer is None:
            raise
        return fewer


def resolve_unem_default(settings: EvaluationSettings, data: DictConfig, source: FeatureSource,
                         log: Callable[[str], None] = print) -> list[DefaultFit]:
    """Give UNEM's ``learned=auto`` its parameters for this run: a fitted (cached) file per shot count set as
    ``settings.method_params["unem"]["params_file"]``, or, with one notice, nothing (the untrained start)."""
    if not wants_default(settings):
        return []
    reason = _why_no_validation_classes(settings, data, source)
    path = None
    if reason is None:
        assert source.extraction is not None
        try:
            path = base_split_features(data, source.extraction, VAL_SPLIT, source.checkpoint_sha256, log,
                                       purpose="validation features", use="to fit UNEM's parameters (learned=auto)")
        except LightningPutmError as exc:
            reason = f"the val split of {data.name} cannot be read ({exc})"
    fits: list[DefaultFit] = []
    if path is not None:
        validation = load_features(path)
        options = settings.method_params["unem"]
        normalise, tasks = str(options.get("normalise", "none")), int(options.get("fit_tasks", 1000))
        log(f"unem: learned=auto fits UNEM's parameters on the {len(validation.class_names)} validation classes of "
            f"{data.name} for shots {', '.join(map(str, settings.shots))} ({tasks} tasks x {FitSettings.iterations} "
            f"iterations per shot count, once: cached in {Path(settings.feature_cache_dir) / CACHE_FOLDER}); "
            "method.unem.fit_tasks=300 costs less, method.unem.learned=initial skips it (untrained start), "
            "learned=mini_resnet18 takes the authors' published values")
        try:
            fits = [fit_default(validation, shots, settings.ways, settings.queries, settings.seed, normalise,
                                Path(settings.feature_cache_dir) / CACHE_FOLDER, settings.device, log, tasks)
                    for shots in settings.shots]
        except DataError as exc:
            reason = f"no validation task can be drawn from the val split of {data.name} ({exc})"
            fits = []
    if not fits:
        log(untrained_notice(str(reason)))
        return []
    template = str(fits[0].path).replace(f"-{fits[0].shots}shot.json", "-{shots}shot.json")
    settings.method_params["unem"] = {**settings.method_params["unem"], "params_file": template}
    return fits


def untrained_notice(reason: str) -> str:
    """The one line of a run whose ``learned=auto`` stays the untrained start: why, and the alternatives."""
    return (f"notice: unem uses its untrained start t1 = gamma = t2 = 1 (learned=auto): {reason}; to fit it, run "
            "`python -m lightning_putm fit-unem --features <validation features>` and pass method.unem.params_file="
            "<the file it writes>; method.unem.learned=mini_resnet18 takes the authors' published values")


def _why_no_validation_classes(settings: EvaluationSettings, data: DictConfig, source: FeatureSource) -> str | None:
    """Why this run has no validation classes to fit on, or ``None`` when it has (a checkpoint's val split)."""
    if settings.checkpoint is None or source.extraction is None:
        what = "the demo's digits pixels" if settings.features == "demo" else f"the feature file {settings.features}"
        return f"{what} come with no validation classes to fit it on"
    if settings.split == VAL_SPLIT:
        return "the evaluated split is the val split itself (a fit there would see the evaluated classes)"
    return None


def fit_default(validation: FeatureSet, shots: int, ways: int, queries: int, seed: int, normalise: str,
                cache_dir: Path, device: torch.device | str = "cpu", log: Callable[[str], None] = print,
                tasks: int = 1000) -> DefaultFit:
    """The parameters ``auto`` uses at ``shots`` shots: read from ``cache_dir`` when its key matches, else fitted
    on ``tasks`` tasks of ``validation``, checked against the untrained start on ``tasks`` other validation tasks
    per α of :data:`HELD_OUT_ALPHAS`, and written."""
    device = torch.device(device)
    settings = FitSettings(normalise=normalise)
    labels = validation.labels
    fit_count = fit_queries(labels, ways, shots, queries, [FIT_ALPHA], tasks, seed)
    check_count = fit_queries(labels, ways, shots, queries, list(HELD_OUT_ALPHAS), tasks, seed + 1)
    digest = _digest(validation, {"version": CACHE_VERSION, "ways": ways, "queries": queries, "seed": seed,
                                  "fit_alpha": FIT_ALPHA, "tasks": tasks,
                                  "held_out_alphas": [alpha_label(a) for a in HELD_OUT_ALPHAS],
                                  "device": device.type, "fit": asdict(settings)})
    path = cache_dir / f"auto-{digest[:16]}-{shots}shot.json"
    cached = _read_cached(path, digest, shots)
    if cached is not None:
        log(f"unem: {shots}-shot: reusing {path} ({cached.get('summary', '')})")
        return DefaultFit(shots, path, load_params(path), cached["chosen"] == "fitted", *cached["held_out_accuracy"],
                          fit_count, float(cached["fit"]["seconds"]), reused=True)
    if fit_count < queries:
        log(f"unem: {shots}-shot: {queries} queries per task cannot be drawn from the validation classes; the fit "
            f"uses {fit_count}, the held-out check {check_count} (the largest that can)")
    bank = sample_episode_bank(labels, ways, shots, fit_count, FIT_ALPHA, tasks, seed)
    drawn = bank.gather(validation.features.float(), device)
    started = time.perf_counter()

    def first_iteration(index: int, _loss: float) -> None:
        if index == 1 and settings.iterations > 1:
            took = time.perf_counter() - started
            log(f"unem: {shots}-shot fit: the first of {settings.iterations} iterations took {took:.2f} s: about "
                f"{format_duration(took * settings.iterations)} in all")

    fitted, history = fit_params(drawn.batch, drawn.query_labels, settings, on_iteration=first_iteration)
    seconds = time.perf_counter() - started
    fitted_accuracy, initial_accuracy = (held_out_accuracy(params, validation, ways, shots, check_count, tasks,
                                                           seed + 1, normalise, device)
                                         for params in (fitted, UNEMParams.initial(settings.layers,
                                                                                   settings.initial)))
    keep = sum(fitted_accuracy) >= sum(initial_accuracy)
    chosen = fitted if keep else UNEMParams.initial(settings.layers, settings.initial)
    means = (sum(fitted_accuracy) / len(fitted_accuracy), sum(initial_accuracy) / len(initial_accuracy))
    summary = (f"learned=auto: {'fitted' if keep else 'the untrained start'}; fitted on {tasks} {ways}-way "
               f"{shots}-shot tasks (alpha={FIT_ALPHA:g}, {fit_count} queries) of "
               f"{validation.metadata.get('source', 'the validation classes')}; on {tasks} other validation tasks "
               f"per alpha (2, balanced) fitted {means[0]:.2f}%, untrained start {means[1]:.2f}%")
    meta = {"key": digest, "shots": shots, "chosen": "fitted" if keep else "initial", "summary": summary,
            "fitted": fitted.to_dict(), "held_out_accuracy": list(means),
            "held_out": {"tasks": tasks, "queries": check_count, "seed": seed + 1,
                         "alphas": [alpha_label(a) for a in HELD_OUT_ALPHAS], "fitted": fitted_accuracy,
                         "initial": initial_accuracy},
            "fit": {"tasks": tasks, "queries": fit_count, "alpha": FIT_ALPHA, "seed": seed, "ways": ways,
                    **asdict(settings), "loss_first": history[0] if history else None,
                    "loss_last": history[-1] if history else None, "seconds": seconds},
            "source": validation.metadata.get("source", "")}
    save_params(path, chosen, meta)
    log(f"unem: {shots}-shot: fitted in {format_duration(seconds)} (loss {meta['fit']['loss_first']:.4f} -> "
        f"{meta['fit']['loss_last']:.4f}); held-out validation accuracy {means[0]:.2f}% fitted, {means[1]:.2f}% "
        f"untrained start: {'the fitted parameters' if keep else 'the untrained start'} ({path})")
    return DefaultFit(shots, path, chosen, keep, means[0], means[1], fit_count, seconds, reused=False)


def held_out_accuracy(params: UNEMParams, validation: FeatureSet, ways: int, shots: int, queries: int, tasks: int,
                      seed: int, normalise: str, device: torch.device) -> list[float]:
    """UNEM's accuracy (%) with ``params`` on ``tasks`` validation tasks per α of :data:`HELD_OUT_ALPHAS` (drawn
    with ``seed``: other tasks than the fit's)."""
    method = UNEM(params=params, normalise=normalise)
    accuracies = []
    for alpha in HELD_OUT_ALPHAS:
        bank = sample_episode_bank(validation.labels, ways, shots, queries, alpha, tasks, seed)
        drawn = bank.gather(validation.features.float(), device)
        predicted = method.predict(drawn.batch).argmax(-1)
        accuracies.append(100.0 * float((predicted == drawn.query_labels).double().mean()))
    return accuracies


def _digest(validation: FeatureSet, settings: dict) -> str:
    """SHA-256 of the validation features and labels and the fit's settings (the cache key, hex)."""
    digest = hashlib.sha256()
    digest.update(validation.features.detach().cpu().float().contiguous().numpy().tobytes())
    digest.update(validation.labels.detach().cpu().long().contiguous().numpy().tobytes())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


def _read_cached(path: Path, digest: str, shots: int) -> dict | None:
    """The cache entry's ``meta`` when ``path`` holds parameters for this key and shot count, else ``None``."""
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text()).get("meta", {})
        if meta.get("key") == digest and meta.get("shots") == shots and len(meta["held_out_accuracy"]) == 2:
            return meta
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass  # an unreadable entry is fitted and written again
    return None
