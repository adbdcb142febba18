"""tieredImageNet (Ren et al., ICLR 2018): 351 / 97 / 160 classes grouped by ImageNet super-category.

Layout: one folder per split, one folder per class inside it: ``root/{train,val,test}/<wnid>/<image>``.
Classes are numbered in sorted order of their folder names.
"""

from __future__ import annotations

from pathlib import Path

from lightning_putm.data.imagesplit import ImageSplit, require_dir, require_root, split_from_class_folders, subfolders
from lightning_putm.errors import DataError

EXPECTED = "train/, val/ and test/ folders with one sub-folder of images per class"


def read_tieredimagenet(root: str | Path | None, split: str) -> ImageSplit:
    base = require_root(root, "tieredimagenet", EXPECTED)
    folder = require_dir(base / split, "tieredimagenet", f"the {split}/ folder (one sub-folder per class)")
    classes = subfolders(folder)
    if not classes:
        raise DataError(f"tieredimagenet: {folder} has no class folders; expected {split}/<class>/<image>")
    return split_from_class_folders("tieredimagenet", split, classes)
