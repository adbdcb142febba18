"""The PUTM test-time callback: features → Dirichlet episode banks → PUTM and its peers → logs, CSVs, plots.

:class:`FewShotEvaluationCallback` turns the test loop (and, when asked, the validation loop) of any
LightningModule whose step returns ``{"features", "labels"}`` (``indices`` optional) or a ``(features, labels)``
tuple into a few-shot evaluation (Tian et al., ICCV 2023, §5: accuracy over Dirichlet α):

* at test time (``Trainer.test``, as ``evaluate.py`` does) on the test loop's rows, and optionally
* every ``every_n_val_epochs`` validation epochs during ``Trainer.fit`` (pretraining's ``S2M2Module`` yields the
  same dict; ``docs/callback.md`` shows a user's own module).

Its settings are ``conf/evaluate.yaml``'s, as keyword arguments (:mod:`~lightning_putm.evaluation.keywords`) or
as :class:`EvaluationSettings`. At the end of the epoch it assembles the split's feature table (gathered over
processes, placed by row index when the step gives one), optionally stores it in the feature cache, runs every
configured method over shots × α on one seeded episode bank per (shot, α), and reports through the trainer's
loggers: per (method, shot, α) the mean accuracy and 95% CI as metrics; with W&B also a ``wandb.Table`` of all
results, a line plot of accuracy vs α per method and shot, and the figures of :mod:`lightning_putm.plots`. The
summary and per-task CSVs, the effective config and the PNGs go to ``output_dir``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
import yaml

from lightning_putm.config import command_line_value
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.keywords import WHO, callback_settings, settings_yaml
from lightning_putm.evaluation.progress import format_duration
from lightning_putm.evaluation.records import Provenance
from lightning_putm.evaluation.report import (format_table, log_to_loggers, make_plots, precision_note, write_report,
                                              wrote_line)
from lightning_putm.evaluation.runner import SettingResult, evaluate_features, shard_range
from lightning_putm.evaluation.settings import EvaluationSettings
from lightning_putm.evaluation.store import SettingStore
from lightning_putm.features.cache import FeatureCache
from lightning_putm.features.extraction import FeatureCollector
from lightning_putm.methods import method_uses_base_mean
from lightning_putm.runs import remove_stale
from lightning_putm.validators import alpha_label, query_classes_label

#: What an evaluation writes into its folder (a re-run into the same folder removes what it did not rewrite).
MANAGED_FILES = ("results.csv", "per_task.csv", "config.yaml", "plots/*.png", "plots/*.pdf", "plots/*.svg",
                 "settings/*.pt")
#: The callback's own arguments (the others are ``conf/evaluate.yaml``'s evaluation settings).
OWN_ARGUMENTS = ("settings", "every_n_val_epochs", "run_at_test", "plots", "plot_task", "feature_cache", "config_yaml",
                 "base_features_from", "log")
#: Where ``output_dir=auto`` puts the files: this folder under the Trainer's ``log_dir``.
AUTO_FOLDER = "fewshot"

BaseFeaturesHook = Callable[[pl.Trainer, pl.LightningModule], "Path | None"]


class FewShotEvaluationCallback(FeatureCollector):
    """Run few-shot methods on the features produced by a test (or validation) loop and log the results.

    ``FewShotEvaluationCallback(methods=["putm", "simpleshot"], shots=[1, 5], tasks=500, every_n_val_epochs=1)``:
    every keyword of ``conf/evaluate.yaml``'s evaluation settings, same names and defaults (``method_params`` is
    its ``method`` section), checked as ``evaluate.py`` checks them; or ``FewShotEvaluationCallback(settings)``
    with settings already validated (what ``evaluate.py`` and pretraining pass).

    * ``every_n_val_epochs``: ``None`` = only at test time; ``k`` = also after the validation of epochs k, 2k, ...
    * ``run_at_test``: evaluate the test loop (pretraining turns it off: its test scores nearest class mean).
    * ``base_features_from``: called at each evaluation (all processes) for a feature file of the base classes
      when a method subtracts their mean (pretraining extracts its train split with the current weights).
    * ``log``: where the console lines go (rank zero only).
    """

    def __init__(
        self,
        settings: EvaluationSettings | None = None,
        *,
        every_n_val_epochs: int | None = None,
        run_at_test: bool = True,
        plots: bool | None = None,
        plot_task: int | None = None,
        feature_cache: FeatureCache | None = None,
        config_yaml: str | None = None,
        base_features_from: BaseFeaturesHook | None = None,
        log: Callable[[str], None] = print,
        **evaluation: Any,
    ) -> None:
        k = every_n_val_epochs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"{WHO}: `every_n_val_epochs` must be an integer >= 1 (or None: only at test time), "
                              f"got {k!r}")
        if not isinstance(run_at_test, bool):
            raise ConfigError(f"{WHO}: `run_at_test` must be True or False, got {run_at_test!r}")
        if settings is None:
            given = {"plots": plots, "plot_task": plot_task}
            settings = callback_settings({**evaluation, **{k: v for k, v in given.items() if v is not None}},
                                         own=OWN_ARGUMENTS)
            config_yaml = settings_yaml(settings) if config_yaml is None else config_yaml
        elif not isinstance(settings, EvaluationSettings):
            raise ConfigError(f"{WHO}: `settings` must be an EvaluationSettings, got {type(settings).__name__}; or "
                              "give the evaluation settings as keyword arguments (methods=..., tasks=...)")
        elif evaluation:
            raise ConfigError(f"{WHO}: give the evaluation settings as an EvaluationSettings or as keyword "
                              f"arguments, not both (got settings and {', '.join(sorted(evaluation))})")
        super().__init__(settings.split)
        self.settings = settings
        self.every_n_val_epochs = every_n_val_epochs
        self.feature_cache = feature_cache
        self.config_yaml = config_yaml
        self.plots = settings.plots if plots is None else plots
        self.plot_task = settings.plot_task if plot_task is None else plot_task
        self.run_at_test = run_at_test  # False during pretraining: Trainer.test there scores the test split by NCM
        self.base_features_from = base_features_from
        self.say = log
        self.results: list[SettingResult] = []  # of the last evaluation
        self.paths: dict[str, Path] = {}  # files written by the last evaluation
        self.checks = 0  # validation checks run in this process (the first one's time is reported)
        self._epoch_start: float | None = None

    # ------------------------------------------------------------------------------------------- hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_val_epochs is not None and trainer.is_global_zero:
            self.say(self.plan_line())

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.run_at_test:
            self.collect(trainer, pl_module, outputs, "test", dataloader_idx)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.run_at_test:
            return
        self._evaluate(trainer, pl_module, split=self.settings.split, prefix="fewshot",
                       output_dir=self.output_dir(trainer), cache=self.feature_cache)

    def _val_epoch_due(self, trainer: pl.Trainer) -> bool:
        k = self.every_n_val_epochs
        return k is not None and not trainer.sanity_checking and (trainer.current_epoch + 1) % k == 0

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._val_epoch_due(trainer):
            self.collect(trainer, pl_module, outputs, "validation", dataloader_idx)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_epoch_due(trainer) and self._outputs:
            started = time.perf_counter()
            epoch = None if self._epoch_start is None else started - self._epoch_start
            folder = self.output_dir(trainer) / f"val_epoch_{trainer.current_epoch:04d}"
            self._evaluate(trainer, pl_module, split="val", prefix="val_fewshot", output_dir=folder, cache=None)
            self.checks += 1
            if self.checks == 1 and trainer.is_global_zero:
                self.say(self.timing_line(trainer, time.perf_counter() - started, epoch))
        self._outputs = []

    def output_dir(self, trainer: pl.Trainer) -> Path:
        """``output_dir``, or with ``auto`` the ``fewshot`` folder in the Trainer's ``log_dir`` (a CSV or
        TensorBoard logger's version folder, another logger's ``save_dir``, else ``default_root_dir``)."""
        if self.settings.output_dir is None:
            self.settings = replace(self.settings, output_dir=Path(trainer.log_dir or trainer.default_root_dir)
                                    / AUTO_FOLDER)
        assert self.settings.output_dir is not None
        return self.settings.output_dir

    # ------------------------------------------------------------------------------------------- costs
    def plan_line(self) -> str:
        """What each in-training check will do, said before the first one (its time follows the first one)."""
        s, k = self.settings, self.every_n_val_epochs
        when = "after every validation epoch" if k == 1 else \
            f"after the validation of every {k} epochs (epochs {k}, {2 * (k or 1)}, ...)"
        per_method = len(s.shots) * len(s.query_classes) * len(s.alphas) * s.tasks
        keff = "" if s.query_classes == [None] else \
            f" x query_classes {command_line_value([query_classes_label(k) for k in s.query_classes])}"
        base = " (and the base features for CL2N)" if self.base_features_from is not None and any(
            method_uses_base_mean(m) for m in s.methods) else ""
        return (f"few-shot check {when}: {', '.join(s.methods)} on shots {command_line_value(s.shots)}{keff} x alphas "
                f"{command_line_value([alpha_label(a) for a in s.alphas])} x {s.tasks} tasks "
                f"= {per_method} tasks per method on the validation features{base}; its time is printed after the "
                "first check")

    def timing_line(self, trainer: pl.Trainer, seconds: float, epoch: float | None) -> str:
        """The first check's measured time, by method, beside the epoch before it, and what the later ones add."""
        by_method: dict[str, float] = {}
        for result in self.results:
            by_method[result.method] = by_method.get(result.method, 0.0) + result.seconds
        methods = ", ".join(f"{name} {value:.1f} s" for name, value in by_method.items())
        rest = seconds - sum(by_method.values())
        line = f"few-shot check took {seconds:.1f} s ({methods}; features, files and figures {rest:.1f} s)"
        if epoch is not None:
            line += f"; the epoch before it (training and validation) {epoch:.1f} s"
        later = self._later_checks(trainer)
        if later:
            line += f"; {later} more check(s) in this fit: about {format_duration(later * seconds)} in all"
        return line

    def _later_checks(self, trainer: pl.Trainer) -> int:
        last = trainer.max_epochs
        k = self.every_n_val_epochs or 1
        if last is None or last < 0:
            return 0
        every = trainer.check_val_every_n_epoch or 1
        return sum(1 for epoch in range(trainer.current_epoch + 1, last) if (epoch + 1) % k == 0
                   and (epoch + 1) % every == 0)

    # ------------------------------------------------------------------------------------------- steps
    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, split: str, prefix: str,
                  output_dir: Path, cache: FeatureCache | None) -> None:
        # Lightning may run evaluation loops under inference mode; PUTM trains its navigators with autograd.
        with torch.inference_mode(False), torch.no_grad():
            self._evaluate_with_grad_allowed(trainer, pl_module, split, prefix, output_dir, cache)

    def _evaluate_with_grad_allowed(self, trainer: pl.Trainer, pl_module: pl.LightningModule, split: str,
                                    prefix: str, output_dir: Path, cache: FeatureCache | None) -> None:
        feature_set = self.assemble(trainer, pl_module, split)
        self._outputs = []
        rank_zero = trainer.is_global_zero
        say = self.say if rank_zero else (lambda _: None)
        feature_set.check_finite(f"features of the {split} split")  # before caching: NaN features are never reused
        if cache is not None and rank_zero:
            cache.store(feature_set)
            say(f"feature cache written: {cache.path}")
        say(f"features: {len(feature_set)} rows x {feature_set.dim} dims, {feature_set.num_classes} classes "
            f"({feature_set.metadata.get('source', split)})")
        device = self.settings.device
        if device.type == pl_module.device.type:  # one process per GPU: each rank uses its own
            device = pl_module.device
        settings = replace(self.settings, output_dir=output_dir, device=device)
        if self.base_features_from is not None and any(method_uses_base_mean(m) for m in settings.methods):
            base = self.base_features_from(trainer, pl_module)  # every process: it may gather across them
            if base is not None:
                settings = replace(settings, base_features=str(base))
        if trainer.world_size > 1:
            start, stop = shard_range(settings.tasks, trainer.global_rank, trainer.world_size)
            print(f"rank {trainer.global_rank} of {trainer.world_size}: solving tasks {start}-{stop - 1} of each bank",
                  flush=True)
        # test-time runs keep every finished setting, so the same command resumes an interrupted run
        store = SettingStore(output_dir, writable=rank_zero) if prefix == "fewshot" else None
        results = evaluate_features(feature_set, settings, say, rank=trainer.global_rank, world_size=trainer.world_size,
                                    gather=(lambda t: pl_module.all_gather(t)) if trainer.world_size > 1 else None,
                                    progress=settings.progress and rank_zero,
                                    should_stop=lambda: bool(getattr(trainer, "received_sigterm", False)),
                                    store=store)
        if store is not None and (notice := store.notice()):
            say(notice)
        self.results = results
        summaries = [r.summary() for r in results]
        for summary in summaries:  # K_eff, when set, between the shot and α: a default run's keys are as before
            keff = "" if summary.query_classes is None else f"/keff_{summary.query_classes}"
            key = f"{prefix}/{summary.method}/{summary.shots}shot{keff}/alpha_{summary.alpha_label}"
            pl_module.log(f"{key}/acc", round(summary.accuracy, 4), rank_zero_only=True)
            pl_module.log(f"{key}/ci95", round(summary.ci95, 4), rank_zero_only=True)
        if not rank_zero:
            return
        self.provenance = Provenance.of(settings.device)
        self.paths = write_report(results, output_dir, self.config_yaml_with_provenance(results), self.provenance)
        figures = make_plots(results, feature_set, settings, output_dir / "plots", self.plot_task, say) if self.plots else {}
        self.paths.update({f"plot_{k}": v for k, v in figures.items()})
        # the results of this run replace a previous run's in the same folder whole
        remove_stale(output_dir, [*self.paths.values(), *(store.written if store is not None else [])], MANAGED_FILES)
        log_to_loggers(trainer.loggers, summaries, figures, prefix)
        say(format_table(summaries))
        note = precision_note(summaries)
        if note:
            say(note)
        if any(r.oracle_prior for r in results):
            say("WARNING: rows with oracle_prior=true were given the TRUE query counts of every task "
                "(oracle_prior=true); they are not comparable with fair results")
        say(wrote_line(self.paths, output_dir))

    def config_yaml_with_provenance(self, results: list[SettingResult]) -> str | None:
        """The run's config followed by a ``provenance`` block: what besides the config changed the numbers."""
        if self.config_yaml is None:
            return None
        precisions = {r.method: r.precision for r in results}
        learned: dict[str, dict[str, str]] = {}  # where learned parameters came from (UNEM's), per shot count
        for result in results:
            if result.learned.get("source"):
                learned.setdefault(result.method, {})[f"{result.shots}-shot"] = str(result.learned["source"])
        block = yaml.safe_dump({"provenance": {**self.provenance.as_dict(), "precision": precisions,
                                               **({"learned": learned} if learned else {})}}, sort_keys=False)
        return self.config_yaml.rstrip("\n") + "\n" + block
