"""The LightningDataModule of pretraining: augmented base-class batches, few-shot episodes for val and test.

Training iterates the base (train) split with augmentation, in an order fixed by (seed, epoch). Validation and test iterate every image of their
split once, unaugmented and in order, returning ``(image, label, index)``; the module turns the features into
few-shot accuracy on the seeded episode bank of :meth:`FewShotDataModule.episodes` (balanced or Dirichlet,
the episode protocol), so every epoch is scored on the same tasks.

How the loaders run (worker processes, pinned memory, prefetching) is :class:`LoaderSettings`, resolved for the
device the Trainer trains on by :func:`resolve_loader` (``auto`` keeps a CPU run exactly as it was and keeps a
GPU fed). Without settings the loaders are built as they always were (``num_workers`` only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_putm.data.episodes import EpisodeBank, sample_episode_bank
from lightning_putm.data.imagesplit import ImageSplit
from lightning_putm.data.registry import check_download_flag, dataset_info, prepare_dataset, read_split
from lightning_putm.data.samplers import EpochShuffleSampler
from lightning_putm.data.settings import EpisodeSettings, LoaderSettings
from lightning_putm.data.transforms import eval_transform, train_transform
from lightning_putm.errors import ConfigError, DataError

#: ``auto`` workers on CUDA: at most this many per GPU (more rarely helps one GPU and costs memory per worker).
MAX_AUTO_WORKERS = 8
#: ``auto`` prefetch on CUDA: batches each worker prepares ahead (PyTorch's default is 2).
CUDA_PREFETCH_FACTOR = 4


@dataclass(frozen=True)
class LoaderOptions:
    """Resolved DataLoader keyword arguments."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None  # None = PyTorch's default; always None without workers

    def kwargs(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                "persistent_workers": self.persistent_workers, "prefetch_factor": self.prefetch_factor}


def available_cpus() -> int:
    """CPU cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def resolve_loader(settings: LoaderSettings, recipe_workers: int, on_cuda: bool, devices: int = 1,
                   reads_files: bool = True, cpus: int | None = None) -> LoaderOptions:
    """The DataLoader options for one training process.

    ``auto`` values: workers = ``recipe_workers`` (``data.num_workers``), raised on CUDA for datasets decoded
    from image files to ``min(8, CPU cores / devices)`` so decoding and augmentation keep the GPU busy (each DDP
    process has its own loader, hence the division); pinned memory on CUDA only (page-locked batches are copied
    to the GPU asynchronously; on CPU it would only cost memory); persistent workers whenever there are workers;
    prefetch 4 batches per worker on CUDA, PyTorch's default otherwise. On CPU ``auto`` is exactly the loaders
    of before, so CPU results do not change.
    """
    workers = settings.num_workers
    if workers == "auto":
        workers = recipe_workers
        if on_cuda and reads_files:
            per_device = (available_cpus() if cpus is None else cpus) // max(1, devices)
            workers = max(recipe_workers, min(MAX_AUTO_WORKERS, per_device))
    pin = on_cuda if settings.pin_memory == "auto" else bool(settings.pin_memory)
    persistent = workers > 0 if settings.persistent_workers == "auto" else bool(settings.persistent_workers)
    prefetch = settings.prefetch_factor
    if prefetch == "auto":
        prefetch = CUDA_PREFETCH_FACTOR if on_cuda else None
    # PyTorch accepts neither persistent workers nor a prefetch factor without worker processes
    return LoaderOptions(int(workers), pin, persistent and workers > 0, prefetch if workers > 0 else None)


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
        loader: LoaderSettings | None = None,
        download: bool = False,
    ) -> None:
        """``loader=None`` builds the loaders with ``num_workers`` alone, as before; :class:`LoaderSettings` adds
        pinned memory, persistent workers and prefetching, resolved for the Trainer's device."""
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
        self.loader = loader
        check_download_flag(download)
        self.download = download  # data.download: build the dataset's layout under root first (if missing)
        self.episode_settings = {"val": val_episodes or EpisodeSettings(), "test": test_episodes or EpisodeSettings()}
        self._splits: dict[str, ImageSplit] = {}
        self._banks: dict[str, EpisodeBank] = {}
        # Check the augmentation and normalisation settings now (ConfigError), not at the first training batch.
        train_transform(self.image_size, self.in_channels, self.augment, self.normalize, not self.info.in_memory)

    # ------------------------------------------------------------------------------------- splits
    @property
    def in_channels(self) -> int:
        return self.info.channels

    def prepare_data(self) -> None:
        """``data.download=true``: download on one process (Lightning calls this on rank 0 only, before setup)."""
        if self.download:
            prepare_dataset(self.dataset_name, self.root, **self.options)

    def split(self, name: str) -> ImageSplit:
        """The ``train`` / ``val`` / ``test`` split, read once (with ``download``, once the layout is in place)."""
        if name not in self._splits:
            self._splits[name] = read_split(self.dataset_name, self.root, name, download=self.download,
                                            **self.options)
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
    def loader_options(self) -> LoaderOptions:
        """The loader options for the device of the attached Trainer (CPU when there is none)."""
        if self.loader is None:
            return LoaderOptions(self.num_workers, False, self.num_workers > 0, None)
        trainer = self.trainer
        on_cuda = trainer is not None and trainer.strategy.root_device.type == "cuda"
        devices = trainer.num_devices if trainer is not None else 1
        return resolve_loader(self.loader, self.num_workers, on_cuda, devices, reads_files=not self.info.in_memory)

    def train_dataloader(self) -> DataLoader:
        train = self.split("train")
        transform = train_transform(self.image_size, self.in_channels, self.augment, self.normalize,
                                    from_files=not self.info.in_memory)
        # Own generator: creating the iterator must not consume the global RNG (see samplers.py).
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            train.to_dataset(transform), batch_size=self.batch_size,
            sampler=EpochShuffleSampler(len(train), self.seed), drop_last=len(train) > self.batch_size,
            generator=generator, **self.loader_options().kwargs(),
        )

    def _eval_loader(self, split: str, transform: Callable[[Any], torch.Tensor] | None = None,
                     shard: tuple[int, int] | None = None) -> DataLoader | list:
        """Every image of ``split`` in order, through ``transform`` (default: the evaluation transform of the data
        settings; a pretrained model brings its own preprocessing). ``shard=(rank, world_size)``: that process's
        part, as Lightning's DistributedSampler would give it (equal parts, the last padded)."""
        data = self.split(split)
        if len(data) == 0:
            return []
        if transform is None:
            transform = eval_transform(self.image_size, self.in_channels, self.normalize,
                                       from_files=not self.info.in_memory, resize_factor=self.eval_resize)
        dataset = data.to_dataset(transform, with_index=True)
        sampler = None if shard is None else DistributedSampler(dataset, num_replicas=shard[1], rank=shard[0],
                                                                shuffle=False)
        return DataLoader(dataset, batch_size=self.eval_batch_size, shuffle=False, sampler=sampler,
                          **self.loader_options().kwargs())

    def eval_loader(self, split: str, shard: tuple[int, int] | None = None) -> DataLoader | list:
        """``split`` through the evaluation transform (no augmentation), in order; ``[]`` for an empty split."""
        return self._eval_loader(split, shard=shard)

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader | list:
        return self._eval_loader("test")
