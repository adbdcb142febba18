"""The built-in demo as images: scikit-learn's handwritten digits (1×8×8, 10 classes, 1797 images).

Classes 0–4 are the base (training) classes and 5–9 the novel ones. The demo has no third group of classes,
so its validation split is the novel split too (model selection on the classes it is tested on: fine for a
demo, never for reported numbers). No files and no network: the images install with scikit-learn.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.errors import DataError

BASE_CLASSES = [0, 1, 2, 3, 4]
NOVEL_CLASSES = [5, 6, 7, 8, 9]


def read_digits(root: str | Path | None = None, split: str = "train") -> ImageSplit:
    from sklearn.datasets import load_digits

    if split not in ("train", "val", "test"):
        raise DataError(f"digits: unknown split {split!r}; use train, val or test")
    bunch = load_digits()
    classes = BASE_CLASSES if split == "train" else NOVEL_CLASSES
    images = torch.as_tensor(bunch.images, dtype=torch.float32) / 16.0  # pixel values 0..16 → [0, 1]
    targets = torch.as_tensor(bunch.target, dtype=torch.long)
    keep = torch.isin(targets, torch.tensor(classes))
    labels = targets[keep] - classes[0]
    return ImageSplit("digits", split, labels, [f"digit_{c}" for c in classes], 1, images=images[keep].unsqueeze(1),
                      metadata={"source": "sklearn.datasets.load_digits", "classes": classes})
