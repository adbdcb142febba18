"""CIFAR-FS (Bertinetto et al., ICLR 2019): CIFAR-100 classes split 64 / 16 / 20, 600 images of 32×32 each.

Layout of the authors' release: ``root/data/<class name>/<image>.png`` and the split lists
``root/splits/bertinetto/{train,val,test}.txt`` (one class name per line). The lists are read, not built in.
"""

from __future__ import annotations

from pathlib import Path

from lightning_putm.data.imagesplit import ImageSplit, require_dir, require_file, require_root, split_from_class_folders
from lightning_putm.errors import DataError

EXPECTED = "data/<class>/<image>.png and splits/bertinetto/{train,val,test}.txt"


def read_cifarfs(root: str | Path | None, split: str) -> ImageSplit:
    base = require_root(root, "cifarfs", EXPECTED)
    data = require_dir(base / "data", "cifarfs", "the data/ folder (one sub-folder per CIFAR-100 class)")
    split_file = require_file(base / "splits" / "bertinetto" / f"{split}.txt", "cifarfs",
                              f"the Bertinetto split list splits/bertinetto/{split}.txt")
    names = [line.strip() for line in split_file.read_text().splitlines() if line.strip()]
    if not names:
        raise DataError(f"cifarfs: {split_file} lists no classes")
    if len(set(names)) != len(names):
        raise DataError(f"cifarfs: {split_file} lists a class twice")
    missing = [n for n in names if not (data / n).is_dir()]
    if missing:
        raise DataError(f"cifarfs: class folder(s) {', '.join(missing[:5])} listed in {split_file.name} are missing "
                        f"from {data}")
    return split_from_class_folders("cifarfs", split, [data / n for n in names])
