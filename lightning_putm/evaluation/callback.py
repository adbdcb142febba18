"""The PUTM test-time callback: features → Dirichlet episode banks → PUTM and its peers → logs, CSVs, plots.

:class:`FewShotEvaluationCallback` turns any Lightning loop that yields ``{"features", "labels", "indices"}``
per batch into a few-shot evaluation (Tian et al., ICCV 2023, §5: accuracy over Dirichlet α):

* at test time (``Trainer.test``, as ``evaluate.py`` does) on the test split, and optionally
* every ``every_n_val_epochs`` validation epochs during pretraining (``S2M2Module`` yields the same dict).

At the end of the epoch it assembles the split's feature table (gathered over processes, placed by row index),
optionally stores it in the feature cache, runs every configured method over shots × α on one seeded episode
bank per (shot, α), and reports through the trainer's loggers: per (method, shot, α) the mean
accuracy and 95% CI as metrics; with W&B also a ``wandb.Table`` of all results, a line plot of accuracy vs α
per method and shot, and the figures of :mod:`lightning_putm.plots`. The summary and per-task CSVs, the
effective config and the PNGs go to ``output_dir``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
import yaml

from lightning_putm.evaluation.records import Provenance
from lightning_putm.evaluation.report import (format_table, log_to_loggers, make_plots, precision_note, write_report,
                                              wrote_line)
from lightning_putm.evaluation.runner import SettingResult, evaluate_features, shard_range
from lightning_putm.evaluation.settings import EvaluationSettings
from lightning_putm.evaluation.store import SettingStore
from lightning_putm.features.cache import FeatureCache
from lightning_putm.features.extraction import FeatureCollector
from lightning_putm.runs import remove_stale

#: What an evaluation writes into its folder (a re-run into the same folder removes what it did not rewrite).
MANAGED_FILES = ("results.csv", "per_task.csv", "config.yaml", "plots/*.png", "plots/*.pdf", "plots/*.svg",
                 "settings/*.pt")


class FewShotEvaluationCallback(FeatureCollector):
    """Run few-shot methods on the features produced by a test (or validation) loop and log the results."""

    def __init__(
        self,
        settings: EvaluationSettings,
        *,
        every_n_val_epochs: int | None = None,
        feature_cache: FeatureCache | None = None,
        config_yaml: str | None = None,
        plots: bool = True,
        plot_task: int = 0,
        run_at_test: bool = True,
        log: Callable[[str], None] = print,
    ) -> None:
        super().__init__()
        if every_n_val_epochs is not None and every_n_val_epochs < 1:
            raise ValueError("every_n_val_epochs must be >= 1 (or None to evaluate only at test time)")
        self.settings = settings
        self.every_n_val_epochs = every_n_val_epochs
        self.feature_cache = feature_cache
        self.config_yaml = config_yaml
        self.plots = plots
        self.plot_task = plot_task
        self.run_at_test = run_at_test  # False during pretraining: Trainer.test there scores the test split by NCM
        self.say = log
        self.results: list[SettingResult] = []  # of the last evaluation
        self.paths: dict[str, Path] = {}  # files written by the last evaluation

    # ------------------------------------------------------------------------------------------- hooks
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.run_at_test:
            self.collect(outputs)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.run_at_test:
            return
        self._evaluate(trainer, pl_module, split=self.settings.split, prefix="fewshot",
                       output_dir=self.settings.output_dir, cache=self.feature_cache)

    def _val_epoch_due(self, trainer: pl.Trainer) -> bool:
        k = self.every_n_val_epochs
        return k is not None and not trainer.sanity_checking and (trainer.current_epoch + 1) % k == 0

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._val_epoch_due(trainer):
            self.collect(outputs)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_epoch_due(trainer) and self._outputs:
            folder = self.settings.output_dir / f"val_epoch_{trainer.current_epoch:04d}"
            self._evaluate(trainer, pl_module, split="val", prefix="val_fewshot", output_dir=folder, cache=None)
        self._outputs = []

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
        for summary in summaries:
            key = f"{prefix}/{summary.method}/{summary.shots}shot/alpha_{summary.alpha_label}"
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
        block = yaml.safe_dump({"provenance": {**self.provenance.as_dict(), "precision": precisions}}, sort_keys=False)
        return self.config_yaml.rstrip("\n") + "\n" + block
