"""Data: image datasets in their on-disk layouts, transforms, the DataModule, feature sources and the episode bank.

Knows no model and no solver. The DataModule (which imports Lightning and torchvision) loads on first use, so
feature-only users such as ``evaluate.py`` do not pay for those imports.
"""

from typing import Any

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import EpisodeBank, TaskTensors, dirichlet_query_counts, round_counts_to_total, sample_episode_bank
from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.data.registry import DATASETS, available_datasets, dataset_info, read_split

__all__ = [
    "DATASETS",
    "EpisodeBank",
    "EpisodeSettings",
    "FewShotDataModule",
    "ImageSplit",
    "TaskTensors",
    "available_datasets",
    "dataset_info",
    "digits_feature_set",
    "dirichlet_query_counts",
    "read_split",
    "round_counts_to_total",
    "sample_episode_bank",
]


_LAZY = {"EpisodeSettings": "lightning_putm.data.datamodule", "FewShotDataModule": "lightning_putm.data.datamodule"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
