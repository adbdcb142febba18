"""The keys of ``conf/predict.yaml``, declared once (:mod:`lightning_putm.job_options`): default, the type
``--help`` shows and the help; the yaml is written from these fields by ``tools/sync_options.py``.
:mod:`lightning_putm.prediction.settings` checks the values a run is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_putm.job_options import MEMORY_BUDGET, job_option


@dataclass(frozen=True)
class PredictOptions:
    checkpoint: str | None = job_option(
        None, type="path", help="required: a backbone checkpoint written by train_backbone.py (.ckpt, read "
        "weights-only), or timm:<model name>: a pretrained timm model, images through its own preprocessing "
        "(docs/timm.md)")
    pretrained_file: str | None = job_option(
        None, type="path", help="with checkpoint=timm:<name>: its weights file (.safetensors/.pth; no network); null "
        "= hub cache")
    support: str | None = job_option(None, type="path", help="required: folder with one sub-folder of images per "
                                     "class (the sub-folder name is the class)")
    query: str | None = job_option(None, type="path", help="required: folder of unlabelled images (searched "
                                   "recursively)")
    method: str = job_option(
        "putm", type="str", help="any registered method (python evaluate.py --help lists them with their options); "
        "its settings: method.<name>.<key>=value (conf/method/<name>.yaml)")
    output: str = job_option("predictions.csv", type="path", help="one row per query image: file, predicted_class, "
                             "probability, prob_<class> ...")
    counts_output: str | None = job_option(None, type="path", help="estimated number of queries per class; null = "
                                           "<output name>_counts.csv beside output")
    base_features: str | None = job_option(
        "auto", type="str", help="base-class mean for CL2N (simpleshot, bdcspn, laplacianshot, bavardage): auto = "
        "the train split of the data the checkpoint records when it can be read, else plain L2 normalisation with a "
        "notice (always with a timm model); split:train (error when unreadable); a feature file; null = L2N")
    calibration: Any = job_option(
        "auto", type="str", help="the probability column: auto = each method's temperature fitted on labelled tasks "
        "of the checkpoint's validation classes (its val split, extracted and cached once), or the method's own "
        "probabilities with a notice where that split cannot be read (always with a timm model); split:<name>; a "
        "labelled feature file of classes outside your task; a temperature; null = raw")
    calibration_tasks: int = job_option(200, type="int", help="validation tasks the temperature is fitted on "
                                        "(shaped like your task); the fit's cost: docs/predict.md", low=1)
    data_root: str | None = job_option(None, type="path", help="where the checkpoint's data lives (base_features, "
                                       "calibration); null = the root it records")
    feature_cache_dir: str = job_option("outputs/feature_cache", type="path", help="cached base and validation "
                                        "features, fitted temperatures (keyed by content)")
    batch_size: int = job_option(256, type="int", help="images per backbone forward pass", low=1)
    seed: int = job_option(0, type="int", help="the task's seed (PUTM's navigator initialisation)", low=0)
    device: str = job_option("auto", type="str", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    memory_budget_mb: float | str = job_option(2048, **MEMORY_BUDGET, help="working memory of the method (MB; on "
                                               "CUDA a cap under free memory; auto: see evaluate.yaml)")
    debug: bool = job_option(False, type="bool", help="show full tracebacks instead of one-line errors")
