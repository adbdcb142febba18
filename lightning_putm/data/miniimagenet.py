"""miniImageNet (Vinyals et al., 2016) with the split of Ravi & Larochelle (ICLR 2017): 64 / 16 / 20 classes × 600.

Layout: ``root/{train,val,test}.csv`` (header ``filename,label``; label = WordNet id) and every image in
``root/images/``. Classes are numbered in sorted order of their ids.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from lightning_putm.data.imagesplit import ImageSplit, require_dir, require_file, require_root
from lightning_putm.errors import DataError

EXPECTED = "train.csv, val.csv, test.csv (Ravi & Larochelle split) and an images/ folder"


def read_miniimagenet(root: str | Path | None, split: str) -> ImageSplit:
    base = require_root(root, "miniimagenet", EXPECTED)
    csv_path = require_file(base / f"{split}.csv", "miniimagenet", f"the {split} split file {split}.csv")
    images = require_dir(base / "images", "miniimagenet", "the images/ folder")
    rows: list[tuple[str, str]] = []
    with open(csv_path, newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["filename", "label"]:
            raise DataError(f"miniimagenet: {csv_path} must start with the header `filename,label`, got {header}")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 2 or not row[0].strip() or not row[1].strip():
                raise DataError(f"miniimagenet: {csv_path} line {line} is malformed ({row!r}); expected filename,label")
            rows.append((row[0].strip(), row[1].strip()))
    if not rows:
        raise DataError(f"miniimagenet: {csv_path} lists no images")
    class_names = sorted({label for _, label in rows})
    index = {name: i for i, name in enumerate(class_names)}
    paths = [images / filename for filename, _ in rows]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"miniimagenet: {len(missing)} image(s) listed in {csv_path.name} are missing from {images} "
                        f"(first: {missing[0].name}); copy all images into that folder")
    labels = torch.tensor([index[label] for _, label in rows], dtype=torch.long)
    return ImageSplit("miniimagenet", split, labels, class_names, 3, paths=paths)
