"""Backbones by name: ``backbone=<name>`` in the config maps to a constructor here.

Constructors take ``in_channels`` (from the dataset) plus the keys of ``conf/backbone/<name>.yaml``; an
unknown name or keyword raises :class:`~lightning_putm.errors.ConfigError` listing what exists.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from lightning_putm.errors import ConfigError
from lightning_putm.models.base import Backbone
from lightning_putm.models.conv4 import Conv4
from lightning_putm.models.resnet12 import ResNet12
from lightning_putm.models.resnet18 import TimmResNet
from lightning_putm.models.wrn import WideResNet

BACKBONE_REGISTRY: dict[str, Callable[..., Backbone]] = {}


def register_backbone(name: str) -> Callable[[Callable[..., Backbone]], Callable[..., Backbone]]:
    def decorator(factory: Callable[..., Backbone]) -> Callable[..., Backbone]:
        BACKBONE_REGISTRY[name] = factory
        return factory

    return decorator


@register_backbone("wrn28_10")
def wrn28_10(in_channels: int = 3, dropout: float = 0.5, depth: int = 28, widen: int = 10,
             first_stride: int = 1) -> Backbone:
    return WideResNet(depth=depth, widen=widen, dropout=dropout, in_channels=in_channels, first_stride=first_stride)


@register_backbone("resnet12")
def resnet12(in_channels: int = 3, widths: Sequence[int] = (64, 160, 320, 640), dropout: float = 0.0) -> Backbone:
    return ResNet12(widths=widths, dropout=dropout, in_channels=in_channels)


@register_backbone("resnet18")
def resnet18(in_channels: int = 3, small_input: bool = False, drop_rate: float = 0.0) -> Backbone:
    return TimmResNet("resnet18", in_channels=in_channels, small_input=small_input, drop_rate=drop_rate)


@register_backbone("conv4")
def conv4(in_channels: int = 3, width: int = 64, depth: int = 4) -> Backbone:
    return Conv4(width=width, depth=depth, in_channels=in_channels)


def available_backbones() -> list[str]:
    return sorted(BACKBONE_REGISTRY)


def build_backbone(name: str, in_channels: int = 3, **kwargs: Any) -> Backbone:
    """Build backbone ``name`` for ``in_channels``-channel images with the given keyword options."""
    if name not in BACKBONE_REGISTRY:
        raise ConfigError(f"unknown backbone {name!r}; available: {', '.join(available_backbones())}")
    factory = BACKBONE_REGISTRY[name]
    accepted = set(inspect.signature(factory).parameters)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ConfigError(f"backbone {name!r} has no option(s) {', '.join(unknown)}; "
                          f"its options: {', '.join(sorted(accepted - {'in_channels'}))}")
    return factory(in_channels=in_channels, **kwargs)
