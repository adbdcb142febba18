"""What a pretraining run's episodes and loaders are, as configured: plain dataclasses checked on creation.

Apart from :mod:`~lightning_putm.data.datamodule` (which imports Lightning and torch) so that ``train_backbone.py``
checks its config and prints its errors without importing either.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_putm.errors import ConfigError


@dataclass(frozen=True)
class EpisodeSettings:
    """N-way K-shot tasks with Q queries in total; ``alpha=None`` is balanced, else Dirichlet(α)."""

    ways: int = 5
    shots: int = 1
    queries: int = 75
    alpha: float | None = None
    tasks: int = 500
    seed: int = 0


@dataclass(frozen=True)
class LoaderSettings:
    """DataLoader settings as configured (``loader.*``); ``"auto"`` is decided per device by :func:`resolve_loader`."""

    num_workers: int | str = "auto"
    pin_memory: bool | str = "auto"
    persistent_workers: bool | str = "auto"
    prefetch_factor: int | str = "auto"

    def __post_init__(self) -> None:
        for key in ("num_workers", "prefetch_factor"):
            value = getattr(self, key)
            low = 0 if key == "num_workers" else 1
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"`loader.{key}` must be auto or an integer >= {low}, got {value!r}")
        for key in ("pin_memory", "persistent_workers"):
            value = getattr(self, key)
            if value != "auto" and not isinstance(value, bool):
                raise ConfigError(f"`loader.{key}` must be auto, true or false, got {value!r}")
