"""Image transforms (torchvision ``transforms.v2``) for base-class training and for evaluation.

Training augmentation follows the S2M2 / CloserLook recipe for natural images (Mangla et al. 2020; Chen et al.
2019): random resized crop, colour jitter, horizontal flip. Small images (CIFAR-FS, Omniglot, digits) use
pad-and-random-crop instead of resized crops when configured. Evaluation resizes to ``1.15 × size`` and takes
the centre crop (file images) or only resizes when needed (in-memory images already at their final size).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torchvision.transforms import v2

from lightning_putm.errors import ConfigError

AUGMENT_KEYS = {"random_resized_crop", "crop_padding", "color_jitter", "horizontal_flip"}


def _to_float_tensor(from_files: bool) -> list[Callable]:
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)] if from_files else []


def _flag(augment: dict[str, Any], key: str) -> bool:
    value = augment.get(key) or False
    if not isinstance(value, bool):
        raise ConfigError(f"data.augment.{key} must be true or false, got {value!r}")
    return value


def _amount(augment: dict[str, Any], key: str, integer: bool) -> float:
    value = augment.get(key) or 0
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"data.augment.{key} must be {'an integer' if integer else 'a number'} >= 0, got {value!r}")
    return value


def _normalise(normalize: dict[str, Any] | None, channels: int) -> list[Callable]:
    if not normalize:
        return []
    try:
        mean, std = [float(m) for m in normalize["mean"]], [float(s) for s in normalize["std"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"data.normalize needs `mean` and `std` lists of numbers (e.g. mean: [0.485, 0.456, 0.406]), "
                          f"got {normalize!r}") from exc
    if not all(math.isfinite(v) for v in mean + std) or any(v <= 0 for v in std):
        raise ConfigError(f"data.normalize: mean must be finite and std finite and > 0, got mean={mean} std={std}")
    if len(mean) != channels or len(std) != channels:
        raise ConfigError(f"data.normalize needs {channels} mean and std value(s) for {channels}-channel images, "
                          f"got mean={mean} std={std}")
    return [v2.Normalize(mean, std)]


def train_transform(image_size: int, channels: int, augment: dict[str, Any], normalize: dict[str, Any] | None,
                    from_files: bool) -> Callable:
    """Augmentation for base-class training."""
    unknown = set(augment) - AUGMENT_KEYS
    if unknown:
        raise ConfigError(f"unknown data.augment key(s) {sorted(unknown)}; valid: {sorted(AUGMENT_KEYS)}")
    ops: list[Callable] = _to_float_tensor(from_files)
    if _flag(augment, "random_resized_crop"):
        ops.append(v2.RandomResizedCrop(image_size, antialias=True))
    else:
        ops.append(v2.Resize((image_size, image_size), antialias=True))
        padding = int(_amount(augment, "crop_padding", integer=True))
        if padding > 0:
            ops.append(v2.RandomCrop(image_size, padding=padding))
    jitter = float(_amount(augment, "color_jitter", integer=False))
    if jitter > 0:
        ops.append(v2.ColorJitter(brightness=jitter, contrast=jitter, saturation=jitter if channels == 3 else 0.0))
    if _flag(augment, "horizontal_flip"):
        ops.append(v2.RandomHorizontalFlip())
    return v2.Compose(ops + _normalise(normalize, channels))


def eval_transform(image_size: int, channels: int, normalize: dict[str, Any] | None, from_files: bool,
                   resize_factor: float = 1.15) -> Callable:
    """Deterministic transform for validation and test images."""
    ops: list[Callable] = _to_float_tensor(from_files)
    if from_files and resize_factor and resize_factor != 1.0:
        ops += [v2.Resize(int(round(image_size * resize_factor)), antialias=True), v2.CenterCrop(image_size)]
    else:
        ops.append(v2.Resize((image_size, image_size), antialias=True))
    return v2.Compose(ops + _normalise(normalize, channels))
