"""Pretraining stopped mid-epoch: Ctrl-C or SIGTERM leaves ``interrupted.ckpt``, and ``resume=true`` continues
from that point instead of from the last finished epoch.

A stop in the middle of a training step could leave the weights updated and Adam's moments not, which no
checkpoint can resume. So during training a first signal only requests the stop (:func:`~lightning_putm.signals.
hold_stops`) and :class:`InterruptionCheckpoint` raises it where the training state is whole: at the end of a
training batch (after its optimizer step), or anywhere in validation, whose solvers check between their steps (the
in-training few-shot check stops within seconds). Lightning then calls :meth:`on_exception`, which writes the
checkpoint (atomically, through the Trainer's checkpoint IO) with what Lightning does not keep itself:

* the random number generators' states (torch, CUDA, NumPy, Python): the augmentation and mixup draws of the
  rest of the epoch are those an uninterrupted run makes;
* where the epoch was, so that :class:`~lightning_putm.data.samplers.EpochShuffleSampler` continues with the
  batches not yet trained instead of the epoch's first ones (Lightning restarts a plain DataLoader's epoch).

Lightning restores the weights, optimizer, scheduler, callbacks and loop progress (a checkpoint taken at the end of
a training batch is one its loops resume from). With ``data.num_workers=0`` (the CPU default) the resumed run
ends with exactly an uninterrupted run's weights (tests/test_checkpoint_interrupts.py). What still differs: the
epoch-averaged training metrics of the interrupted epoch are averaged over the batches after the resume only, and
with DataLoader worker processes the augmentations drawn in the workers differ, as after any resume. Not under
DDP (``trainer.devices > 1``): the ranks could stop at different batches, so a stop there is immediate, as before,
and leaves no such checkpoint. A second signal stops at once; in the middle of a training batch it leaves none
either (``last.ckpt``, the last finished epoch, stays).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.exceptions import SIGTERMException

from lightning_putm.data.samplers import EpochShuffleSampler
from lightning_putm.signals import check_stop, hold_stops, stop_requested

#: The checkpoint an interruption leaves in the stage folder (beside ``last.ckpt`` and ``best.ckpt``).
INTERRUPTED = "interrupted.ckpt"


def rng_states() -> dict[str, Any]:
    """The global generators' states as tensors and plain values (a ``weights_only`` load reads them)."""
    _, keys, position, has_gauss, gauss = np.random.get_state()
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                              "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                                        "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`rng_states` took."""
    torch.set_rng_state(states["torch"])
    random.setstate(tuple(item if not isinstance(item, list) else tuple(item) for item in states["python"]))
    numpy = states["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["position"], numpy["has_gauss"],
                         numpy["gauss"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class InterruptionCheckpoint(pl.Callback):
    """Holds a Ctrl-C or SIGTERM until the training state is whole, then saves ``interrupted.ckpt`` (see the module
    docstring). :attr:`point` is ``(epoch, batches trained in it)`` once the checkpoint is written."""

    def __init__(self, dirpath: str | Path) -> None:
        super().__init__()
        self.path = Path(dirpath) / INTERRUPTED
        self.point: tuple[int, int] | None = None
        self._saving: dict[str, Any] | None = None  # this callback's part of the checkpoint being written
        self._restored: dict[str, Any] | None = None  # read from the checkpoint resumed from
        self._at_batch_end = False

    @staticmethod
    def _single_process(trainer: pl.Trainer) -> bool:
        return trainer.world_size == 1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._single_process(trainer):
            return
        hold_stops(True)
        restored, self._restored = self._restored, None
        if restored:  # resumed from interrupted.ckpt: the generators and the batches left, as they were
            set_rng_states(restored["rng"])
            loader = trainer.train_dataloader
            sampler = getattr(loader, "sampler", None)
            if isinstance(sampler, EpochShuffleSampler):
                sampler.resume_at(int(restored["epoch"]), int(restored["batches"]) * int(loader.batch_size))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hold_stops(False)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # not while gradients accumulate (no checkpoint holds them) nor after an epoch's last batch (its
        # validation and end-of-epoch checkpoints come first; the stop then comes from validation or the next batch)
        if not self._single_process(trainer) or not stop_requested() or trainer.fit_loop._should_accumulate():
            return
        if trainer.fit_loop.epoch_loop.batch_progress.current.processed >= trainer.num_training_batches:
            return
        self._at_batch_end = True
        check_stop()

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        check_stop()  # validation changes no training state: it may stop anywhere

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        hold_stops(False)
        interrupted = isinstance(exception, (KeyboardInterrupt, SIGTERMException))
        whole = self._at_batch_end or trainer.validating or isinstance(exception, SIGTERMException)
        if not (interrupted and whole and trainer.state.fn == TrainerFn.FITTING and self._single_process(trainer)):
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        point = (int(trainer.current_epoch), int(progress.processed))
        if trainer.validating:
            validation_from_its_start(trainer)
        self._saving = {"rng": rng_states(), "epoch": point[0], "batches": point[1]}
        try:
            trainer.save_checkpoint(self.path)
        finally:
            self._saving = None
        self.point = point

    def state_dict(self) -> dict[str, Any]:
        return dict(self._saving) if self._saving is not None else {}  # empty: last.ckpt and best.ckpt carry none

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls this only when fit finished (not after an exception): the stage's last.ckpt is newer
        if stage == "fit":
            self.path.unlink(missing_ok=True)


def validation_from_its_start(trainer: pl.Trainer) -> None:
    """Mark the validation in progress as stopped inside its first batch, so that the resume runs it whole.

    Lightning resumes a validation only from a checkpoint taken inside a ``validation_step`` (batch started, not
    processed); a stop elsewhere in it (a batch hook, the few-shot check at the epoch's end) reads as a finished
    validation, and the resumed epoch would log no validation metrics and never judge ``best.ckpt``. The counters
    are per epoch (Lightning resets them when an epoch starts) and this process is ending, so nothing else reads
    them; validation changes no training state, so running it again from its start is exact."""
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    for tracker in (progress.total, progress.current):
        tracker.ready, tracker.started, tracker.processed, tracker.completed = 1, 1, 0, 0


def resume_point(stage_dir: Path) -> Path | None:
    """The checkpoint ``resume=true`` continues a stage from: ``interrupted.ckpt`` when it holds a later point than
    ``last.ckpt`` (more optimizer steps: a stop in the middle of an epoch after it), else ``last.ckpt``; ``None``
    when neither exists. A stale ``interrupted.ckpt`` (a later epoch finished, then the process was killed) loses."""
    last, interrupted = stage_dir / "last.ckpt", stage_dir / INTERRUPTED
    if not interrupted.is_file():
        return last if last.is_file() else None
    if not last.is_file():
        return interrupted
    return interrupted if checkpoint_step(interrupted) > checkpoint_step(last) else last


def checkpoint_step(path: Path) -> int:
    """A checkpoint's ``global_step`` (its tensors are mapped, not read; -1 where the file cannot be read)."""
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step", -1))
    except Exception:  # noqa: BLE001 - a torn or foreign file: the resume check names the problem
        return -1
