"""Backbones and heads (know no dataset): WRN-28-10, ResNet-12, ResNet-18 (timm), Conv-4; cosine and rotation heads.

The names below load on first use (they import torch, and the registry timm): a light module of this folder,
such as :mod:`~lightning_putm.models.timm_names`, imports without them.
"""

from typing import Any

__all__ = [
    "BACKBONE_REGISTRY",
    "Backbone",
    "CosineClassifier",
    "Mixup",
    "RotationHead",
    "available_backbones",
    "build_backbone",
    "default_cosine_scale",
    "register_backbone",
    "rotate_batch",
]

_LAZY = {"Backbone": "lightning_putm.models.base", "Mixup": "lightning_putm.models.base",
         "CosineClassifier": "lightning_putm.models.heads", "RotationHead": "lightning_putm.models.heads",
         "default_cosine_scale": "lightning_putm.models.heads", "rotate_batch": "lightning_putm.models.heads",
         "BACKBONE_REGISTRY": "lightning_putm.models.registry", "available_backbones": "lightning_putm.models.registry",
         "build_backbone": "lightning_putm.models.registry", "register_backbone": "lightning_putm.models.registry"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
