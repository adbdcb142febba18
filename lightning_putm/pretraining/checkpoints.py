"""Checkpoint files: atomic writes, safe reads, and the model or backbone a checkpoint holds.

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
from lightning_putm.features.files import looks_like_torch_file, unsafe_load_reason
from lightning_putm.models import Backbone
from lightning_putm.pretraining.module import S2M2Module
from lightning_putm.validators import alternatives, path_hint


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


def missing_checkpoint_hint(path: Path) -> str:
    """What to do about a checkpoint path that is not a file: its near matches first (a typo: ``bets.ckpt`` →
    ``best.ckpt``, :func:`~lightning_putm.validators.path_hint`), then where checkpoints come from."""
    if path.is_dir():  # a run or stage folder: the checkpoints in it
        held = sorted(path.glob("*.ckpt"))[:3]
        hint = f"did you mean {alternatives([str(p) for p in held])}? " if held else ""
    else:
        hint = path_hint(path)
    example = "" if hint.startswith("did you mean") else " (e.g. checkpoints/digits/conv4/latest/s2m2r/best.ckpt)"
    return f"{hint}pass checkpoint=PATH to a .ckpt written by train_backbone.py{example}"


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint safely (``weights_only=True``) onto the CPU, with errors a user can act on."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}; {missing_checkpoint_hint(path)}")
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


def load_module(path: str | Path, **overrides: Any) -> S2M2Module:
    """Rebuild the module stored in a checkpoint (safe load), optionally changing hyper-parameters.

    Every problem with the file is a :class:`DataError` naming it: unreadable or unsafe (see
    :func:`read_checkpoint`), no or unusable hyper-parameters, or weights that do not fit them.
    """
    checkpoint = read_checkpoint(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    if not isinstance(hparams, dict) or "backbone" not in hparams:
        raise DataError(f"{path} has no S2M2Module hyper-parameters; pass a checkpoint written by train_backbone.py")
    hparams = {**hparams, **overrides}
    try:
        module = S2M2Module(**hparams)
    except (TypeError, ValueError, KeyError, RuntimeError) as exc:  # includes ConfigError (a ValueError)
        raise DataError(f"{path}: cannot rebuild the model from its hyper-parameters ({exc}); pass a checkpoint "
                        "written by train_backbone.py") from exc
    try:
        module.load_state_dict(checkpoint["state_dict"])
    except (RuntimeError, TypeError, AttributeError) as exc:  # missing/unexpected keys, shape mismatch, not tensors
        first = " ".join(str(exc).strip().splitlines()[:2])[:300]
        raise DataError(f"{path}: its weights do not match the backbone it records ({first}); the file was edited "
                        "or comes from another backbone — use a checkpoint written by train_backbone.py") from exc
    return module


def load_backbone(path: str | Path) -> Backbone:
    """The pretrained backbone of a checkpoint, in eval mode (for feature extraction)."""
    return load_module(path).backbone.eval()


def _matching_state(module: S2M2Module, checkpoint: dict[str, Any], path: str | Path, action: str,
                    strict: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint's weights for ``module``, or a :class:`DataError` when they do not fit it."""
    state = checkpoint["state_dict"]
    if not isinstance(state, dict):
        raise DataError(f"cannot {action} {path}: its state_dict is not a mapping of tensors; "
                        "use a checkpoint written by train_backbone.py")
    own = module.state_dict()
    mismatched = [k for k in own if k in state and (not isinstance(state[k], torch.Tensor)
                                                   or state[k].shape != own[k].shape)]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own] if strict else []
    if mismatched or missing or unexpected:
        detail = (f"shape differs for {mismatched[:3]}" if mismatched else
                  f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}")
        raise DataError(f"cannot {action} {path}: it does not match this backbone/dataset ({detail}); "
                        "use a checkpoint of the same backbone, options and training classes")
    return {k: state[k] for k in own}


def init_from_checkpoint(module: S2M2Module, path: str | Path) -> None:
    """Start ``module`` from the weights of another stage's checkpoint (e.g. stage 2 from stage 1)."""
    module.load_state_dict(_matching_state(module, read_checkpoint(path), path, "start from"))


def check_init_from(module: S2M2Module, path: str | Path) -> None:
    """What :func:`init_from_checkpoint` would refuse (unreadable, unsafe, another model's weights), refused before
    the run folder exists; nothing is loaded into ``module``."""
    _matching_state(module, read_checkpoint(path), path, "start from")


RESUME_KEYS = ("epoch", "global_step", "state_dict", "optimizer_states", "loops")


def check_resume_checkpoint(module: S2M2Module, path: str | Path) -> None:
    """Check (safely) that Lightning can resume ``module`` from ``path`` before handing it to ``Trainer.fit``.

    A corrupt, unsafe or foreign ``last.ckpt`` (or one written with other backbone options) would otherwise
    surface as a raw traceback from deep inside Lightning.
    """
    checkpoint = read_checkpoint(path)
    missing = [k for k in RESUME_KEYS if k not in checkpoint]
    advice = "delete it to start this stage over, or run without resume=true"
    if missing:
        raise DataError(f"cannot resume from {path}: it is not a training checkpoint (no {', '.join(missing)}); "
                        f"{advice}")
    try:
        _matching_state(module, checkpoint, path, "resume from", strict=True)
    except DataError as exc:
        raise DataError(f"{exc}; or {advice}") from exc


def check_checkpoint_backbone(path: str | Path, expected_backbone: str | None) -> None:
    """The backbone check of :func:`load_checkpoint_backbone` without building the model (e.g. when the
    checkpoint's features come from the cache)."""
    if expected_backbone not in (None, "auto"):
        hparams = read_checkpoint(path).get("hyper_parameters") or {}
        _check_backbone(path, str(hparams.get("backbone")), expected_backbone)


def _check_backbone(path: str | Path, backbone_name: str, expected_backbone: str | None) -> None:
    if expected_backbone not in (None, "auto") and expected_backbone != backbone_name:
        raise DataError(f"{path} holds a {backbone_name} backbone but backbone={expected_backbone} was asked for; "
                        f"use a {expected_backbone} checkpoint or backbone=auto")


def load_checkpoint_backbone(path: str | Path, in_channels: int | None = None,
                             expected_backbone: str | None = None) -> tuple[Backbone, dict[str, Any]]:
    """The backbone of a ``train_backbone.py`` checkpoint (safe load, eval mode) and its hyper-parameters.

    Errors name the problem: missing or corrupt file, a file that is not one of our checkpoints, weights that
    do not fit the recorded architecture, or a backbone/channel count that differs from what is asked for.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}; {missing_checkpoint_hint(path)}")
    module = load_module(path)  # every problem with the file is already a DataError naming it
    hparams = dict(module.hparams)
    _check_backbone(path, str(hparams.get("backbone")), expected_backbone)
    channels = int(hparams.get("in_channels", 3))
    if in_channels is not None and channels != in_channels:
        raise DataError(f"{path} was trained on {channels}-channel images but the dataset has {in_channels} "
                        "channel(s); evaluate it on the kind of data it was trained on (check data=)")
    return module.backbone.eval(), hparams
