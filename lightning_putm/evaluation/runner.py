"""The evaluation core: every method on the same seeded episode bank per (shot, K_eff, α), one result per setting.

The protocol of the realistic-imbalance benchmark (Veilleux et al., NeurIPS 2021) that PUTM's Table 1 uses:
per (shot, α) one bank of tasks with Dirichlet(α) query proportions (or balanced), drawn once from the seed and
shared by every method, so methods are compared on identical tasks. ``query_classes`` adds PADDLE's protocol
(Martin et al., NeurIPS 2022): one bank per K_eff as well, whose query sets hold K_eff of the N classes.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from lightning_putm.data.episodes import EpisodeBank, sample_episode_bank
from lightning_putm.evaluation.progress import Eta, Heartbeat, format_duration, on_terminal
from lightning_putm.evaluation.records import Summary
from lightning_putm.evaluation.settings import EvaluationSettings
from lightning_putm.evaluation.sources import load_base_statistics
from lightning_putm.evaluation.store import SettingStore, tensor_digest
from lightning_putm.features.files import FeatureSet
from lightning_putm.methods import build_method, method_uses_class_prior
from lightning_putm.metrics import mean_and_ci95, task_accuracy
from lightning_putm.signals import stop_on_signals
from lightning_putm.validators import alpha_label, query_classes_label


@dataclass
class SettingResult:
    """Per-task accuracies of one method on one (shot, K_eff, α) bank, with the bank itself (for per-task files)."""

    method: str
    shots: int
    alpha: float | str | None
    accuracies: torch.Tensor  # [T] float64
    seconds: float
    bank: EpisodeBank
    oracle_prior: bool = False  # the method received the true query counts
    precision: str = ""  # what the method computed in (PUTM: ``auto`` resolved for the device)
    learned: dict[str, Any] = field(default_factory=dict)  # what it read or fitted (UNEM's parameters and source)

    @property
    def alpha_label(self) -> str:
        return alpha_label(self.alpha)

    @property
    def query_classes(self) -> int | None:
        """K_eff of the bank (None: all N classes in every query set)."""
        return self.bank.query_classes

    @property
    def setting_name(self) -> str:
        """``1-shot alpha=2`` or, with K_eff, ``1-shot K_eff=5 alpha=uniform``: how lines and bars name it."""
        return setting_name(self.shots, self.query_classes, self.alpha)

    def summary(self) -> Summary:
        mean, ci = mean_and_ci95(self.accuracies)
        return Summary(method=self.method, shots=self.shots, alpha=self.alpha, accuracy=100 * mean, ci95=100 * ci,
                       tasks=int(self.accuracies.numel()), seconds=self.seconds, oracle_prior=self.oracle_prior,
                       precision=self.precision, query_classes=self.query_classes)


def setting_name(shots: int, query_classes: int | None, alpha: float | str | None) -> str:
    """``1-shot alpha=2``, ``1-shot K_eff=5 alpha=uniform``."""
    keff = "" if query_classes is None else f" K_eff={query_classes_label(query_classes)}"
    return f"{shots}-shot{keff} alpha={alpha_label(alpha)}"


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
    store: SettingStore | None = None,
) -> list[SettingResult]:
    """Run every method on the same episode bank for each (shot, K_eff, α); returns one result per setting.

    With ``world_size > 1`` every process samples the same banks, solves its contiguous block of tasks and
    ``gather`` (an all-gather) assembles the per-task accuracies, so the table equals a single process's.
    ``should_stop`` is polled after every chunk of tasks (e.g. SIGTERM received): the run then stops early. Within
    a chunk, Ctrl-C and SIGTERM stop the solver between two of its steps, in its worker threads too
    (:func:`~lightning_putm.signals.stop_on_signals`); the setting in progress is solved again on resume.
    With a ``store`` every finished setting is saved at once, and a setting already stored with the same inputs
    is read back instead of solved (:mod:`~lightning_putm.evaluation.store`): an interrupted run resumes.
    """
    if world_size > 1 and gather is None:
        raise ValueError("evaluate_features with world_size > 1 needs a gather function (all_gather)")
    base = load_base_statistics(settings, feature_set.dim, log)
    base_mean = None if base.mean is None else base.mean.to(settings.device)
    base_covariance = None if base.covariance is None else base.covariance.to(settings.device)
    wanted = settings.progress if progress is None else progress
    show = wanted and on_terminal()  # a bar in a pipe or a log file is fragments: plain lines there instead
    start_task, stop_task = shard_range(settings.tasks, rank, world_size)
    banks = len(settings.shots) * len(settings.query_classes) * len(settings.alphas)
    count = banks * len(settings.methods)
    total = count * (stop_task - start_task)
    bar = tqdm(total=total, desc="tasks", unit="task", disable=not show, dynamic_ncols=True, bar_format=BAR_FORMAT)
    order = [(shots, keff, alpha, name) for shots in settings.shots for keff in settings.query_classes
             for alpha in settings.alphas for name in settings.methods]
    eta = Eta(count, kinds=[name for *_, name in order],  # a stored setting is expected to be read back: no time
              stored=[store is not None and store.path(name, shots, alpha, keff).is_file()
                      for shots, keff, alpha, name in order])
    report = (lambda line: log(line)) if wanted and not show else (lambda line: None)
    results: list[SettingResult] = []
    common = _common_inputs(feature_set, settings, base_mean, base_covariance) if store is not None else {}
    try:
        for shots in settings.shots:
            for keff, alpha in [(keff, alpha) for keff in settings.query_classes for alpha in settings.alphas]:
                bank = sample_episode_bank(
                    feature_set.labels, settings.ways, shots, settings.queries, alpha, settings.tasks,
                    settings.seed, class_names=feature_set.class_names, query_classes=keff,
                )
                gathered = bank.gather(feature_set.features, settings.device)
                batch = gathered.batch.slice(start_task, stop_task)
                query_labels = gathered.query_labels[start_task:stop_task]
                for name in settings.methods:
                    oracle = settings.oracle_prior and method_uses_class_prior(name)
                    method = build_method(
                        name, settings.method_params.get(name, {}), shots=shots, balanced=bank.balanced,
                        show_progress=show, memory_budget_mb=settings.memory_budget_mb, base_mean=base_mean,
                        base_covariance=base_covariance,
                        query_counts=bank.query_counts[start_task:stop_task] if oracle else None,
                    )
                    inputs = {**common, "method": name, "params": settings.method_params.get(name, {}),
                              "shots": shots, "alpha": bank.alpha_label, "oracle_prior": oracle}
                    if keff is not None:  # only then: a default run's stored settings keep their fingerprints
                        inputs["query_classes"] = keff
                    if learned := method.learned_inputs():  # e.g. UNEM's fitted parameters file
                        inputs["learned"] = learned
                    stored = store.load(name, shots, alpha, inputs, keff) if store is not None else None
                    if stored is not None:
                        bar.update(stop_task - start_task)
                        results.append(SettingResult(name, shots, alpha, stored.accuracies, stored.seconds, bank,
                                                     stored.oracle_prior, stored.precision, learned))
                        eta.advance(1, solved=False)
                        report(setting_line(results[-1], len(results), count, eta, resumed=True))
                        continue
                    setting = BarSetting(bar, eta, f"{name} {setting_name(shots, keff, alpha)}",
                                         stop_task - start_task)
                    start = time.perf_counter()
                    beat = (Heartbeat(f"setting {len(results) + 1}/{count} {setting.name}", log, setting.tasks,
                                      lambda: setting.done) if wanted and not show else contextlib.nullcontext())
                    with stop_on_signals(), beat:  # Ctrl-C, SIGTERM: the solver stops within a step, its threads too
                        probabilities = method.predict(batch, on_chunk=lambda n: _advance(setting, n, should_stop,
                                                                                          settings))
                    seconds = time.perf_counter() - start
                    accuracies = task_accuracy(probabilities, query_labels)
                    if world_size > 1:
                        accuracies = gather_shards(accuracies, settings.tasks, world_size, gather)
                    accuracies = accuracies.cpu()
                    results.append(SettingResult(name, shots, alpha, accuracies, seconds, bank, method.oracle_prior,
                                                 method.resolved_precision, learned))
                    if store is not None:
                        store.save(name, shots, alpha, inputs, accuracies, seconds, method.resolved_precision,
                                   method.oracle_prior, keff)
                    eta.advance(1)
                    report(setting_line(results[-1], len(results), count, eta))
    finally:
        bar.close()
    return results


def setting_line(result: SettingResult, index: int, count: int, eta: Eta, resumed: bool = False) -> str:
    """One finished setting as a plain console line (where no bar is drawn), e.g.
    ``setting 3/8 putm 1-shot alpha=2: 71.20% (100 tasks, 12.3 s); elapsed 0:40, ETA 1:20``."""
    summary = result.summary()
    how = "read back from settings/" if resumed else f"{summary.tasks} tasks, {summary.seconds:.1f} s"
    return (f"setting {index}/{count} {result.method} {result.setting_name}: "
            f"{summary.accuracy:.2f}% ({how}); {eta.text()}")


def _common_inputs(feature_set: FeatureSet, settings: EvaluationSettings, base_mean: torch.Tensor | None,
                   base_covariance: torch.Tensor | None) -> dict[str, Any]:
    """What every setting's numbers depend on besides the method, shot, K_eff and α (for :class:`SettingStore`)."""
    return {"features": tensor_digest(feature_set.features), "labels": tensor_digest(feature_set.labels),
            "base_mean": tensor_digest(base_mean), "base_covariance": tensor_digest(base_covariance),
            "ways": settings.ways, "queries": settings.queries, "tasks": settings.tasks, "seed": settings.seed,
            "device": settings.device.type}


#: tqdm's bar without its own time left (one rate for all methods: PUTM's tasks are hundreds of times slower than
#: SimpleShot's), which the postfix gives instead, paced method by method (:meth:`Eta.left_in_unit`)
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


class BarSetting:
    """The setting the bar is solving: its name and the time left in the bar's postfix, updated chunk by chunk."""

    def __init__(self, bar: Any, eta: Eta, name: str, tasks: int) -> None:
        self.bar, self.eta, self.name, self.tasks, self.done = bar, eta, name, tasks, 0
        self.show(refresh=True)  # the new setting's name at once: a GPU may solve it in one chunk

    def show(self, refresh: bool = False) -> None:
        left = self.eta.left_in_unit(self.done / self.tasks if self.tasks else 0.0)
        self.bar.set_postfix_str(f"{self.name}, ETA " + ("unknown" if left is None else format_duration(left)),
                                 refresh=refresh)

    def update(self, tasks: int) -> None:
        self.done += tasks
        self.show()
        self.bar.update(tasks)


def _advance(setting: BarSetting, tasks: int, should_stop: Callable[[], bool] | None,
             settings: EvaluationSettings) -> None:
    setting.update(tasks)
    if should_stop is not None and should_stop():
        folder = settings.output_dir if settings.output_dir is not None else "<output_dir>"
        raise InterruptedError("evaluation stopped: the process received a termination signal (SIGTERM); the "
                               f"settings finished so far are kept in {folder}/settings: run the same command with "
                               f"output_dir={folder} to resume")
