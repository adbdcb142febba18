"""Backbones and heads (know no dataset): WRN-28-10, ResNet-12, ResNet-18 (timm), Conv-4; cosine and rotation heads."""

from lightning_putm.models.base import Backbone, Mixup
from lightning_putm.models.heads import CosineClassifier, RotationHead, default_cosine_scale, rotate_batch
from lightning_putm.models.registry import BACKBONE_REGISTRY, available_backbones, build_backbone, register_backbone

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
