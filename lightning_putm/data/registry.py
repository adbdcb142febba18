"""Dataset readers by name (``data=<name>``): each maps ``(root, split, **options)`` to an :class:`ImageSplit`.

Datasets with a ``prepare`` function can be downloaded (``data.download=true``): it builds the reader's layout under
``data.root`` (a no-op once it is there), then the same reader reads it. Offline (the default) nothing is fetched.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lightning_putm.data.cifarfs import EXPECTED as CIFARFS_EXPECTED
from lightning_putm.data.cifarfs import cifarfs_present, prepare_cifarfs, read_cifarfs
from lightning_putm.data.cub import read_cub
from lightning_putm.data.digits_images import read_digits
from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.data.miniimagenet import read_miniimagenet
from lightning_putm.data.omniglot import EXPECTED as OMNIGLOT_EXPECTED
from lightning_putm.data.omniglot import omniglot_present, prepare_omniglot, read_omniglot
from lightning_putm.data.tieredimagenet import read_tieredimagenet
from lightning_putm.errors import ConfigError, DataError

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class DatasetInfo:
    reader: Callable[..., ImageSplit]
    channels: int
    in_memory: bool  # images decoded into a tensor (True) or read from files on access (False)
    prepare: Callable[..., None] | None = None  # builds the layout under root (data.download=true)
    present: Callable[[Path], bool] | None = None  # whether root holds the layout's top folder
    expected: str = ""  # what root must hold, for error messages


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo(read_digits, 1, True),
    "omniglot": DatasetInfo(read_omniglot, 1, True, prepare_omniglot, omniglot_present, OMNIGLOT_EXPECTED),
    "miniimagenet": DatasetInfo(read_miniimagenet, 3, False),
    "tieredimagenet": DatasetInfo(read_tieredimagenet, 3, False),
    "cub": DatasetInfo(read_cub, 3, False),
    "cifarfs": DatasetInfo(read_cifarfs, 3, False, prepare_cifarfs, cifarfs_present, CIFARFS_EXPECTED),
}


def available_datasets() -> list[str]:
    return sorted(DATASETS)


def dataset_info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; available: {', '.join(available_datasets())}")
    return DATASETS[name]


def downloadable_datasets() -> list[str]:
    return sorted(name for name, info in DATASETS.items() if info.prepare is not None)


def _parameters(function: Callable[..., Any] | None, own: set[str]) -> set[str]:
    return set(inspect.signature(function).parameters) - own if function is not None else set()


def _split_options(info: DatasetInfo, name: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` as (reader options, preparation options); an option neither takes is a ConfigError."""
    accepted = _parameters(info.reader, {"root", "split"})
    prepare_options = _parameters(info.prepare, {"root"})
    unknown = sorted(set(options) - accepted - prepare_options)
    if unknown:
        raise ConfigError(f"dataset {name!r} has no option(s) {', '.join(unknown)}; "
                          f"its options: {', '.join(sorted(accepted | prepare_options)) or '(none)'}")
    return ({k: v for k, v in options.items() if k in accepted},
            {k: v for k, v in options.items() if k in prepare_options})


def check_download_flag(download: Any) -> None:
    if not isinstance(download, bool):
        raise ConfigError(f"data.download must be true or false, got {download!r}")


def _root_given(root: str | Path | None) -> bool:
    return root is not None and str(root).strip() not in ("", "None", "null")


def prepare_dataset(name: str, root: str | Path | None, **options: Any) -> None:
    """Build dataset ``name``'s layout under ``root``, downloading what is missing (``data.download=true``).

    A no-op when the layout is in place, so it is safe to call before every read (and from each process: the
    final moves are atomic renames). Options the preparation does not take are ignored here.
    """
    info = dataset_info(name)
    if info.prepare is None:
        raise ConfigError(f"data.download=true: {name} cannot be downloaded (downloadable: "
                          f"{', '.join(downloadable_datasets())}); set data.download=false and point data.root at "
                          "your copy")
    if not _root_given(root):
        raise ConfigError(f"data.download=true needs data.root=PATH, the folder to download {name} into")
    _, prepare_options = _split_options(info, name, options)
    path = Path(str(root)).expanduser()
    if path.exists() and not path.is_dir():
        raise DataError(f"{name}: data.root {path} is a file, not a folder; point data.root at the folder to "
                        f"download {name} into")
    info.prepare(path, **prepare_options)


def read_split(name: str, root: str | Path | None, split: str, download: bool = False, **options: Any) -> ImageSplit:
    """Read one split (``train``, ``val`` or ``test``) of dataset ``name``.

    ``download=True`` first builds the dataset's layout under ``root`` (:func:`prepare_dataset`); options the
    preparation takes (e.g. ``allow_pickle``) go to it, the others to the reader.
    """
    info = dataset_info(name)
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    check_download_flag(download)
    reader_options, _ = _split_options(info, name, options)
    if download:
        prepare_dataset(name, root, **options)
    elif info.prepare is not None and info.present is not None:
        hint = f"or set data.download=true to download {name} into it"
        if not _root_given(root):
            raise DataError(f"{name}: no data root given; pass data.root=PATH, the folder that holds "
                            f"{info.expected}, {hint}")
        path = Path(str(root)).expanduser()
        if not path.is_dir() or not info.present(path):
            state = "does not exist" if not path.is_dir() else "does not hold the dataset"
            raise DataError(f"{name}: data root {path} {state}; point data.root at the folder that holds "
                            f"{info.expected}, {hint}")
    return info.reader(root, split, **reader_options)
