"""CUB-200-2011 (Wah et al., 2011) with the standard few-shot split (Hilliard et al. 2018; Chen et al. 2019).

Layout: ``root/images/<class folder>/<image>.jpg`` (``root`` = the ``CUB_200_2011`` folder or its parent).
Split rule on the 200 sorted class folders: index % 2 == 0 → base (100), % 4 == 1 → val (50), % 4 == 3 → novel (50).
"""

from __future__ import annotations

from pathlib import Path

from lightning_putm.data.imagesplit import ImageSplit, require_root, split_from_class_folders, subfolders
from lightning_putm.errors import DataError

EXPECTED = "images/<class>/<image>.jpg (the CUB_200_2011 folder)"


def cub_split_of(index: int) -> str:
    """The split of the class at position ``index`` among the sorted class folders."""
    if index % 2 == 0:
        return "train"
    return "val" if index % 4 == 1 else "test"


def read_cub(root: str | Path | None, split: str) -> ImageSplit:
    base = require_root(root, "cub", EXPECTED)
    images = base / "images"
    if not images.is_dir() and (base / "CUB_200_2011" / "images").is_dir():
        images = base / "CUB_200_2011" / "images"
    if not images.is_dir():
        raise DataError(f"cub: expected the images/ folder at {images}, but it is missing; point data.root at "
                        "the CUB_200_2011 folder that holds images/<class>/<image>.jpg")
    classes = subfolders(images)
    if not classes:
        raise DataError(f"cub: {images} has no class folders")
    chosen = [c for i, c in enumerate(classes) if cub_split_of(i) == split]
    if not chosen:
        raise DataError(f"cub: no class falls into the {split} split ({len(classes)} class folders in {images})")
    return split_from_class_folders("cub", split, chosen)
