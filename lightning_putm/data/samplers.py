"""A shuffling sampler whose order is a pure function of (seed, epoch).

``RandomSampler`` draws its seed from the global RNG when its iterator starts. Lightning creates the first
iterator of a resumed run at a different point than in an uninterrupted run, so the order of the resumed epoch
would differ. Here the permutation depends only on the seed and the epoch (set by Lightning through
``set_epoch`` before the first batch is drawn), so resuming from an end-of-epoch checkpoint reproduces the run.
Under DDP, Lightning wraps this sampler in its distributed sampler, which reshuffles by epoch itself.

A training resumed in the middle of an epoch (``interrupted.ckpt``, :mod:`lightning_putm.pretraining.interruption`)
continues that epoch's permutation where it stopped (:meth:`EpochShuffleSampler.resume_at`).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

from lightning_putm.data.episodes import bank_seed


class EpochShuffleSampler(Sampler[int]):
    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = int(size)
        self.seed = int(seed)
        self.epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, position) where the next iteration starts

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.size

    def resume_at(self, epoch: int, position: int) -> None:
        """The next iteration, if it is over ``epoch``, starts at ``position`` of that epoch's permutation (the
        indices before it were trained before an interruption); any later iteration is whole."""
        self._resume = (int(epoch), int(position))

    def __iter__(self) -> Iterator[int]:
        # A generator: the permutation is drawn on the first ``next``, after ``set_epoch`` of this epoch.
        generator = torch.Generator().manual_seed(bank_seed(self.seed, purpose="shuffle", epoch=self.epoch) % 2**63)
        resume, self._resume = self._resume, None
        start = resume[1] if resume is not None and resume[0] == self.epoch else 0
        yield from torch.randperm(self.size, generator=generator).tolist()[start:]
