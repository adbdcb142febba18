"""Dataset readers by name (``data=<name>``): each maps ``(root, split, **options)`` to an :class:`ImageSplit`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lightning_putm.data.cifarfs import read_cifarfs
from lightning_putm.data.cub import read_cub
from lightning_putm.data.digits_images import read_digits
from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.data.miniimagenet import read_miniimagenet
from lightning_putm.data.omniglot import read_omniglot
from lightning_putm.data.tieredimagenet import read_tieredimagenet
from lightning_putm.errors import ConfigError, DataError

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class DatasetInfo:
    reader: Callable[..., ImageSplit]
    channels: int
    in_memory: bool  # images decoded into a tensor (True) or read from files on access (False)


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(read_digits, 1, True),
    "omniglot": DatasetInfo(read_omniglot, 1, True),
    "miniimagenet": DatasetInfo(read_miniimagenet, 3, False),
    "tieredimagenet": DatasetInfo(read_tieredimagenet, 3, False),
    "cub": DatasetInfo(read_cub, 3, False),
    "cifarfs": DatasetInfo(read_cifarfs, 3, False),
}


def available_datasets() -> list[str]:
    return sorted(DATASETS)


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; available: {', '.join(available_datasets())}")
    return DATASETS[name]


def read_split(name: str, root: str | Path | None, split: str, **options: Any) -> ImageSplit:
    """Read one split (``train``, ``val`` or ``test``) of dataset ``name``."""
    info = dataset_info(name)
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    accepted = set(inspect.signature(info.reader).parameters) - {"root", "split"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ConfigError(f"dataset {name!r} has no option(s) {', '.join(unknown)}; "
                          f"its options: {', '.join(sorted(accepted)) or '(none)'}")
    return info.reader(root, split, **options)
