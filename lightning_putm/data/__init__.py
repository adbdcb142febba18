"""Data: image datasets in their on-disk layouts, transforms, the DataModule, feature sources and the episode bank.

Knows no model and no solver. The DataModule (which imports Lightning and torchvision) loads on first use, so
feature-only users such as ``evaluate.py`` do not pay for those imports.
"""

from typing import Any


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


#: Every name loads on first use (PEP 562), so that importing a light submodule (``data.settings``) imports no torch.
_LAZY = {"DATASETS": "lightning_putm.data.registry", "EpisodeBank": "lightning_putm.data.episodes",
         "EpisodeSettings": "lightning_putm.data.settings", "FewShotDataModule": "lightning_putm.data.datamodule",
         "ImageSplit": "lightning_putm.data.imagesplit", "TaskTensors": "lightning_putm.data.episodes",
         "available_datasets": "lightning_putm.data.registry", "dataset_info": "lightning_putm.data.registry",
         "digits_feature_set": "lightning_putm.data.digits", "dirichlet_query_counts": "lightning_putm.data.episodes",
         "read_split": "lightning_putm.data.registry", "round_counts_to_total": "lightning_putm.data.episodes",
         "sample_episode_bank": "lightning_putm.data.episodes"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
