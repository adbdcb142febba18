"""Checkpoint files: atomic writes and safe reads.

* Lightning's own writer (``TorchCheckpointIO`` → ``_atomic_save``) goes through an fsspec transaction that
  writes a temporary file in the system temp folder and then *moves* it; when that folder is on another file
  system the move is a copy, so an interrupted save can leave a truncated ``last.ckpt``. :class:`AtomicCheckpointIO`
  writes local checkpoints to a temporary file in the destination folder, fsyncs and renames it instead.
* Every read uses ``torch.load(..., weights_only=True)``, which cannot run code. That includes Lightning's resume
  path (``trainer.fit(ckpt_path=...)``), whose checkpoints hold only tensors, numbers, strings and plain containers.
* :class:`BestCheckpoint` keeps the best checkpoint by a validation metric and skips an epoch that did not compute
  it, where Lightning's ``ModelCheckpoint`` would end the run with an exception.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Callable

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_putm.atomic import atomic_torch_save
from lightning_putm.errors import DataError
from lightning_putm.features import looks_like_torch_file, unsafe_load_reason


class AtomicCheckpointIO(TorchCheckpointIO):
    """Atomic local saves; loads restricted to ``weights_only=True``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint does not take storage_options")
        if "://" in str(path):  # remote file systems: keep Lightning's fsspec transaction
            super().save_checkpoint(checkpoint, path)
            return
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Callable | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)


class BestCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(monitor=...)`` that leaves the checkpoint alone in an epoch without the monitored metric.

    The module logs ``val/acc`` only when validation saw every image its episode bank needs; with
    ``trainer.limit_val_batches`` (or ``overfit_batches``) it cannot and says so. Lightning's ``ModelCheckpoint``
    then raises ``could not find the monitored key`` at the end of the epoch, after the training is done.
    """

    def _has_metric(self, trainer: pl.Trainer) -> bool:
        return self.monitor is None or self.monitor in trainer.callback_metrics

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._has_metric(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._has_metric(trainer):
            super().on_validation_end(trainer, pl_module)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint safely (``weights_only=True``) onto the CPU, with errors a user can act on."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}")
    if not looks_like_torch_file(path):
        raise DataError(f"cannot read checkpoint {path}: it is not a complete PyTorch checkpoint (truncated, "
                        "corrupt or another kind of file); use a .ckpt written by train_backbone.py")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise DataError(f"{path} cannot be loaded safely, so it is refused ({unsafe_load_reason(exc)}): it is "
                        "corrupt or needs code execution to load. Only checkpoints that hold tensors and plain values "
                        "can be read; use a .ckpt written by train_backbone.py") from exc
    except Exception as exc:  # truncated file, not a torch file
        raise DataError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(payload, dict) or "state_dict" not in payload:
        raise DataError(f"{path} is not a Lightning checkpoint (no state_dict); pass a checkpoint written by "
                        "train_backbone.py")
    return payload
