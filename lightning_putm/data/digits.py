"""Built-in demo data: scikit-learn's bundled handwritten digits (8x8 pixels, 10 classes, 1797 images).

It installs with the package and needs no network, so ``python evaluate.py`` works on a fresh machine.
Raw pixel intensities (0..16) are non-negative, as the power transform of PUTM and PT-MAP requires.
"""

from __future__ import annotations

import torch

from lightning_putm.features.files import FeatureSet


def digits_feature_set(classes: list[int] | None = None) -> FeatureSet:
    """Digits as 64-d raw-pixel features; ``classes`` keeps a subset (relabelled 0..len-1 in that order)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = torch.as_tensor(bunch.data, dtype=torch.float32)
    labels = torch.as_tensor(bunch.target, dtype=torch.long)
    keep = list(range(10)) if classes is None else list(classes)
    mask = torch.isin(labels, torch.tensor(keep))
    remap = torch.full((10,), -1, dtype=torch.long)
    remap[torch.tensor(keep)] = torch.arange(len(keep))
    return FeatureSet(
        features[mask],
        remap[labels[mask]],
        [f"digit_{c}" for c in keep],
        {"source": "sklearn.datasets.load_digits", "representation": "raw 8x8 pixels (0..16)", "classes": keep},
    )
