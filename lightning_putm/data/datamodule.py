"""The LightningDataModule of pretraining: augmented base-class batches, few-shot episodes for val and test.

Training iterates the base (train) split with augmentation, in an order fixed by (seed, epoch). Validation and test iterate every image of their
split once, unaugmented and in order, returning ``(image, label, index)``; the module turns the features into
few-shot accuracy on the seeded episode bank of :meth:`FewShotDataModule.episodes` (balanced or Dirichlet,
the episode protocol), so every epoch is scored on the same tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_putm.data.episodes import EpisodeBank, sample_episode_bank
from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.data.registry import dataset_info, read_split
from lightning_putm.data.samplers import EpochShuffleSampler
from lightning_putm.data.transforms import eval_transform, train_transform
from lightning_putm.errors import DataError


@dataclass(frozen=True)
class EpisodeSettings:
    """N-way K-shot tasks with Q queries in total; ``alpha=None`` is balanced, else Dirichlet(α)."""

    ways: int = 5
    shots: int = 1
    queries: int = 75
    alpha: float | None = None
    tasks: int = 500
    seed: int = 0


class FewShotDataModule(pl.LightningDataModule):
    def __init__(
        self,
        dataset: str,
        root: str | Path | None = None,
        image_size: int = 84,
        batch_size: int = 64,
        eval_batch_size: int = 256,
        num_workers: int = 0,
        augment: dict[str, Any] | None = None,
        normalize: dict[str, Any] | None = None,
        eval_resize: float = 1.15,
        options: dict[str, Any] | None = None,
        val_episodes: EpisodeSettings | None = None,
        test_episodes: EpisodeSettings | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.info = dataset_info(dataset)
        self.dataset_name = dataset
        self.root = root
        self.image_size = int(image_size)
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size)
        self.num_workers = int(num_workers)
        self.augment = dict(augment or {})
        self.normalize = dict(normalize) if normalize else None
        self.eval_resize = float(eval_resize)
        self.options = dict(options or {})
        self.seed = int(seed)
        self.episode_settings = {"val": val_episodes or EpisodeSettings(), "test": test_episodes or EpisodeSettings()}
        self._splits: dict[str, ImageSplit] = {}
        self._banks: dict[str, EpisodeBank] = {}
        # Check the augmentation and normalisation settings now (ConfigError), not at the first training batch.
        train_transform(self.image_size, self.in_channels, self.augment, self.normalize, not self.info.in_memory)

    # ------------------------------------------------------------------------------------- splits
    @property
    def in_channels(self) -> int:
        return self.info.channels

    def split(self, name: str) -> ImageSplit:
        """The ``train`` / ``val`` / ``test`` split, read once."""
        if name not in self._splits:
            self._splits[name] = read_split(self.dataset_name, self.root, name, **self.options)
        return self._splits[name]

    @property
    def num_classes(self) -> int:
        return self.split("train").num_classes

    def has_split(self, name: str) -> bool:
        return len(self.split(name)) > 0

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            train = self.split("train")
            if len(train) == 0:
                raise DataError(f"{self.dataset_name}: the training split is empty; check data.root and the split")
            self.split("val")
        if stage in (None, "test"):
            self.split("test")

    # ------------------------------------------------------------------------------------- episodes
    def episodes(self, split: str) -> EpisodeBank:
        """The seeded episode bank of ``split`` (``val`` or ``test``), drawn once."""
        if split not in self._banks:
            settings = self.episode_settings[split]
            data = self.split(split)
            self._banks[split] = sample_episode_bank(
                data.labels, settings.ways, settings.shots, settings.queries, settings.alpha, settings.tasks,
                settings.seed, class_names=data.class_names,
            )
        return self._banks[split]

    # ------------------------------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        train = self.split("train")
        transform = train_transform(self.image_size, self.in_channels, self.augment, self.normalize,
                                    from_files=not self.info.in_memory)
        # Own generator: creating the iterator must not consume the global RNG (see samplers.py).
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            train.to_dataset(transform), batch_size=self.batch_size,
            sampler=EpochShuffleSampler(len(train), self.seed), drop_last=len(train) > self.batch_size,
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0, generator=generator,
        )

    def _eval_loader(self, split: str) -> DataLoader | list:
        data = self.split(split)
        if len(data) == 0:
            return []
        transform = eval_transform(self.image_size, self.in_channels, self.normalize,
                                   from_files=not self.info.in_memory, resize_factor=self.eval_resize)
        return DataLoader(data.to_dataset(transform, with_index=True), batch_size=self.eval_batch_size,
                          shuffle=False, num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader("test")
