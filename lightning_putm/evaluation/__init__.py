"""Few-shot evaluation on features: settings → episode banks and methods → report.

Modules, each importing only those above it in this list:

* :mod:`~lightning_putm.evaluation.settings` — ``conf/evaluate.yaml`` + overrides, validated;
* :mod:`~lightning_putm.evaluation.keywords` — the callback's keyword arguments → the same settings and checks;
* :mod:`~lightning_putm.evaluation.records` — typed result records (:class:`Summary`) and run provenance;
* :mod:`~lightning_putm.evaluation.sources` — the features: demo, feature file or checkpoint (+ CL2N base mean);
* :mod:`~lightning_putm.evaluation.runner` — every method on the same seeded bank per (shot, α);
* :mod:`~lightning_putm.evaluation.plots` and :mod:`~lightning_putm.evaluation.report` — figures, table, CSVs, W&B;
* :mod:`~lightning_putm.evaluation.callback` — the Lightning side: the PUTM test-time callback that runs all of
  the above at the end of a test (or validation) epoch of any LightningModule that returns features and labels
  (``from lightning_putm.evaluation.callback import FewShotEvaluationCallback``; docs/callback.md). Inside the
  package only the jobs and a training stage build it.

The ``evaluate.py`` job itself is :mod:`lightning_putm.jobs.evaluate`.
"""

from lightning_putm.evaluation.records import Provenance, Summary
from lightning_putm.evaluation.report import format_table, per_task_rows, write_report
from lightning_putm.evaluation.runner import SettingResult, evaluate_features, gather_shards, shard_range
from lightning_putm.evaluation.settings import EvaluationSettings, load_evaluate_config, settings_from_config

__all__ = ["EvaluationSettings", "Provenance", "SettingResult", "Summary", "evaluate_features", "format_table",
           "gather_shards", "load_evaluate_config", "per_task_rows", "settings_from_config", "shard_range",
           "write_report"]
