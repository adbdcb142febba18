"""What a training stage prints: a progress bar on a terminal, one plain line per epoch elsewhere."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar

from lightning_putm.evaluation.progress import format_duration


class StageProgressBar(TQDMProgressBar):
    """Lightning's progress bar with the stage and epoch (``[classifier] epoch 3/40``) and without ``v_num``:
    the logger's version, which here is the stage name cut to its last four letters (``v_num=fier``)."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        epoch = f"[{self.stage}] epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"
        self.train_progress_bar.set_description(epoch)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class EpochLines(pl.Callback):
    """One plain line per finished epoch where the output is not a terminal (a pipe, ``| tee``, a job log), instead
    of a progress bar whose carriage-return redraws would leave fragments there:
    ``[classifier] epoch 3/40: train/loss 1.0700, val/acc 99.60 (4 s; stage 0:12, ETA 2:28)``."""

    def __init__(self, stage: str, say: Callable[[str], None] = print) -> None:
        self.stage, self.say = stage, say
        self.started = self.epoch_started = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_started = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        now, done = time.perf_counter(), trainer.current_epoch + 1
        metrics = trainer.callback_metrics
        shown = [f"{name.removesuffix('_epoch')} {float(metrics[name]):.{2 if 'acc' in name else 4}f}"
                 for name in ("train/loss_epoch", "val/acc") if name in metrics]
        elapsed = now - self.started
        left = elapsed / done * max(0, trainer.max_epochs - done) if trainer.max_epochs and trainer.max_epochs > 0 else 0
        self.say(f"[{self.stage}] epoch {done}/{trainer.max_epochs}: {', '.join(shown) or 'done'} "
                 f"({now - self.epoch_started:.0f} s; stage {format_duration(elapsed)}, ETA {format_duration(left)})")
