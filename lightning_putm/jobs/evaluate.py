"""The ``evaluate.py`` job: config → features (file, demo or checkpoint) → ``Trainer.test`` with the few-shot
callback → table, CSV files, plots and logger entries."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from pytorch_lightning.utilities import rank_zero_only

from lightning_putm.callbacks import FewShotEvaluationCallback
from lightning_putm.config import build_trainer, to_yaml
from lightning_putm.evaluation.runner import SettingResult
from lightning_putm.evaluation.settings import EvaluationSettings, load_evaluate_config, settings_from_config
from lightning_putm.evaluation.sources import build_feature_source
from lightning_putm.loggers import build_logger, finish_logger


def build_evaluation_trainer(settings: EvaluationSettings, logger: Any, callback: FewShotEvaluationCallback) -> Any:
    """A Trainer for the test loop: ``trainer.*`` options plus what evaluation fixes itself."""
    return build_trainer(settings.trainer, logger=logger, callbacks=[callback], enable_checkpointing=False,
                         inference_mode=False, enable_progress_bar=settings.progress, enable_model_summary=False,
                         default_root_dir=str(settings.output_dir))


def run_evaluate(overrides: Sequence[str], log: Callable[[str], None] = print) -> list[SettingResult]:
    """Run ``evaluate.py`` with ``key=value`` overrides; returns one result per (method, shot, α)."""
    cfg = load_evaluate_config(overrides)
    settings = settings_from_config(cfg)
    cfg.tasks = settings.tasks  # show the resolved value, not `auto`
    cfg.queries = settings.queries
    config_yaml = to_yaml(cfg)
    rank_zero = getattr(rank_zero_only, "rank", 0) == 0
    say = log if rank_zero else (lambda _: None)
    say("effective config:\n" + config_yaml)
    module, datamodule, cache = build_feature_source(cfg, settings, say)
    source = settings.checkpoint.stem if settings.checkpoint else Path(settings.features).stem
    logger = build_logger(settings.logger, settings.output_dir, settings.wandb, f"evaluate-{source}", say)
    callback = FewShotEvaluationCallback(settings, feature_cache=cache, config_yaml=config_yaml, plots=settings.plots,
                                         plot_task=settings.plot_task, log=say)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)  # "GPU available: ..." banners
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=Warning)  # Lightning internals
    try:
        trainer = build_evaluation_trainer(settings, logger, callback)
        trainer.test(module, datamodule=datamodule, verbose=False)
    finally:  # also after an error: a W&B run left open would swallow the next run's logs in this process
        finish_logger(logger, rank_zero)
    return callback.results
