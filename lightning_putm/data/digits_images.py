"""The built-in demo as images: scikit-learn's handwritten digits (1×8×8, 10 classes, 1797 images).

Classes 0–4 are the base (training) classes and 5–9 the novel (test) ones. Validation never uses the novel
classes, so choosing the best epoch (or any setting) on it cannot tune the demo on its test classes:

* by default ``val`` holds out ``val_fraction`` of each base class's images (a fixed, seeded draw) and ``train``
  keeps the rest: episodes of unseen images of the base classes;
* ``val_classes=[...]`` instead makes whole base classes the validation classes (e.g. ``base_classes=[0,1,2]``
  ``val_classes=[3,4]``: 2-way episodes on classes the backbone never saw, for selecting settings).

No files and no network: the images install with scikit-learn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.errors import ConfigError, DataError

BASE_CLASSES = [0, 1, 2, 3, 4]
NOVEL_CLASSES = [5, 6, 7, 8, 9]
HOLDOUT_SEED = 0  # the draw of held-out validation images; fixed so every run validates on the same images


def _classes(value: Sequence[int] | None, key: str) -> list[int]:
    items = list(value) if value is not None else []
    if (not items or len(set(items)) != len(items)
            or any(isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 9 for c in items)):
        raise ConfigError(f"data.options.{key} must be a list of distinct digits 0-9, e.g. [0,1,2,3,4]; got {value!r}")
    return items


def held_out_mask(targets: torch.Tensor, classes: list[int], fraction: float) -> torch.Tensor:
    """True for the ``fraction`` of each class's images (at least one, rounded) held out for validation."""
    mask = torch.zeros(len(targets), dtype=torch.bool)
    generator = torch.Generator().manual_seed(HOLDOUT_SEED)
    for c in classes:
        rows = torch.nonzero(targets == c).flatten()
        count = int(round(fraction * len(rows)))
        if fraction > 0:
            count = max(count, 1)
        mask[rows[torch.randperm(len(rows), generator=generator)[:count]]] = True
    return mask


def read_digits(root: str | Path | None = None, split: str = "train", base_classes: Sequence[int] = BASE_CLASSES,
                novel_classes: Sequence[int] = NOVEL_CLASSES, val_classes: Sequence[int] | None = None,
                val_fraction: float = 0.2) -> ImageSplit:
    """One split of the digits; labels are ``0..C-1`` in the order of the split's class list."""
    from sklearn.datasets import load_digits

    if split not in ("train", "val", "test"):
        raise DataError(f"digits: unknown split {split!r}; use train, val or test")
    base, novel = _classes(base_classes, "base_classes"), _classes(novel_classes, "novel_classes")
    held = None if val_classes is None else _classes(val_classes, "val_classes")
    groups = {"base_classes": base, "novel_classes": novel, **({"val_classes": held} if held is not None else {})}
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if set(groups[a]) & set(groups[b]):
                raise ConfigError(f"data.options.{a} and data.options.{b} share digits "
                                  f"{sorted(set(groups[a]) & set(groups[b]))}; give disjoint lists")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"data.options.val_fraction must be a number in [0, 1), got {val_fraction!r}")
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32) / 16.0  # pixel values 0..16 → [0, 1]
    targets = torch.as_tensor(bunch.target, dtype=torch.long)
    if split == "test":
        classes, keep = novel, torch.isin(targets, torch.tensor(novel))
    elif held is not None:  # whole base classes for validation; train keeps all its images
        classes = base if split == "train" else held
        keep = torch.isin(targets, torch.tensor(classes))
    else:  # held-out images of the base classes
        classes = base
        out = held_out_mask(targets, base, float(val_fraction))
        keep = torch.isin(targets, torch.tensor(base)) & (out if split == "val" else ~out)
    remap = torch.full((10,), -1, dtype=torch.long)
    remap[torch.tensor(classes)] = torch.arange(len(classes))
    metadata = {"source": "sklearn.datasets.load_digits", "classes": classes,
                "validation": ("held-out base images" if held is None else "held-out base classes")}
    return ImageSplit("digits", split, remap[targets[keep]], [f"digit_{c}" for c in classes], 1,
                      images=images[keep].unsqueeze(1), metadata=metadata)
