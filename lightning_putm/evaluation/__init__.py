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

from typing import Any

__all__ = ["EvaluationSettings", "Provenance", "SettingResult", "Summary", "evaluate_features", "format_table",
           "gather_shards", "load_evaluate_config", "per_task_rows", "settings_from_config", "shard_range",
           "write_report"]

#: The names above load on first use: the settings import no torch (a job's config errors and ``--help`` are
#: found without it), the rest import torch, Lightning and matplotlib.
_LAZY = {"Provenance": "lightning_putm.evaluation.records", "Summary": "lightning_putm.evaluation.records",
         "format_table": "lightning_putm.evaluation.report", "per_task_rows": "lightning_putm.evaluation.report",
         "write_report": "lightning_putm.evaluation.report", "SettingResult": "lightning_putm.evaluation.runner",
         "evaluate_features": "lightning_putm.evaluation.runner", "gather_shards": "lightning_putm.evaluation.runner",
         "shard_range": "lightning_putm.evaluation.runner", "EvaluationSettings": "lightning_putm.evaluation.settings",
         "load_evaluate_config": "lightning_putm.evaluation.settings",
         "settings_from_config": "lightning_putm.evaluation.settings"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
