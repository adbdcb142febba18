"""S2M2 backbone pretraining as a LightningModule (Mangla et al., "Charting the Right Manifold", WACV 2020).

Stages (Mangla et al. 2020, §3), all with Adam (lr 1e-3) on a backbone + cosine classifier + 4-way rotation head:

* ``rotation``: every image of the batch in 4 rotations; loss ½·CE(class) + ½·CE(rotation) (Gidaris et al. 2018).
* ``s2m2r``: manifold mixup (Verma et al. 2019) with λ ~ Beta(α, α), α = 2, at a point drawn uniformly from
  ``mix_layers`` (input, after block 1, 2, 3), loss λ·CE(y) + (1 − λ)·CE(y[perm]); plus the rotation loss on a
  random quarter of the batch in 4 rotations; one optimiser step for the sum. Starts from a rotation checkpoint.
* ``classifier``: plain cross-entropy on the cosine classifier, a cheaper baseline (Chen et al. 2019, Baseline++).

Validation and test score few-shot accuracy on the datamodule's seeded episode bank with nearest class mean
on the backbone features, logged as ``val/acc`` / ``test/acc`` (percent) each epoch.

Randomness is reseeded from (seed, epoch, rank) at the start of every training epoch, so a run resumed from an
end-of-epoch checkpoint continues exactly like an uninterrupted one (deterministic CPU mode, ``num_workers=0``).

Speed options for a GPU (they change how the arithmetic runs, not the model; they are not saved as
hyper-parameters, so a checkpoint loads the same whatever they were): ``channels_last`` stores the backbone's
convolution weights and its input images in NHWC order, the layout cuDNN's tensor-core convolutions use
(``"auto"`` = on when training on CUDA), and ``compile`` runs the backbone's stem, blocks and neck through
``torch.compile``. Both are applied in :meth:`S2M2Module.setup`, once the Trainer has chosen the device.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Sequence

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from lightning_putm.data.episodes import EpisodeBank, bank_seed
from lightning_putm.errors import ConfigError
from lightning_putm.features.table import scatter_rows
from lightning_putm.metrics import mean_and_ci95
from lightning_putm.models import Backbone, CosineClassifier, Mixup, RotationHead, build_backbone, rotate_batch
from lightning_putm.pretraining.choices import (NCM_NORMALISATIONS, SCHEDULERS, STAGES, check_channels_last,
                                                check_compile)
from lightning_putm.validators import choice

#: Compiled variants torch may keep of the backbone's regions (see S2M2Module.prepare_for_device).
COMPILE_CACHE_SIZE = 64


# --------------------------------------------------------------------------------------------- scoring
@torch.no_grad()
def ncm_task_accuracy(features: torch.Tensor, bank: EpisodeBank, normalise: str = "none") -> torch.Tensor:
    """Per-task accuracy ``[T]`` of nearest class mean (squared Euclidean) on ``features [n, d]``.

    ``normalise="l2"`` L2-normalises every feature first (SimpleShot's L2N); ``"none"`` is ProtoNets' rule.
    """
    if normalise not in NCM_NORMALISATIONS:
        raise ConfigError(f"ncm normalisation must be one of {NCM_NORMALISATIONS}, got {normalise!r}")
    features = features.float()
    if normalise == "l2":
        features = F.normalize(features, dim=1)
    tasks = bank.gather(features)
    prototypes = tasks.batch.support_means()  # [T, N, d]
    predictions = torch.cdist(tasks.batch.query, prototypes).argmin(dim=2)  # [T, Q]
    return (predictions == tasks.query_labels).double().mean(dim=1).cpu()


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return bank_seed(seed, purpose="train-epoch", epoch=int(epoch), rank=int(rank)) % (2**63)


def reseed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_channels_last(option: bool | str, device: torch.device) -> bool:
    """``channels_last`` for training on ``device``: ``"auto"`` means on for CUDA only (NHWC convolutions are
    what cuDNN runs fastest with tensor cores; on CPU the default NCHW layout keeps results unchanged)."""
    return device.type == "cuda" if option == "auto" else bool(option)


# --------------------------------------------------------------------------------------------- module
class S2M2Module(pl.LightningModule):
    """Backbone + cosine classifier + rotation head, trained by one S2M2 stage."""

    def __init__(
        self,
        backbone: str = "conv4",
        backbone_options: dict[str, Any] | None = None,
        in_channels: int = 3,
        num_classes: int = 64,
        stage: str = "rotation",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        scheduler: str = "none",
        mixup_alpha: float = 2.0,
        mix_layers: Sequence[int] = (0, 1, 2, 3),
        head_scale: float | None = None,
        class_gain: bool = True,
        seed: int = 0,
        ncm_normalise: str = "none",
        data_config: dict[str, Any] | None = None,
        channels_last: bool | str = "auto",
        compile: bool | str = False,
    ) -> None:
        """``data_config`` records the data the backbone was trained on (dataset, root, reader options, image
        size, normalisation), so ``evaluate.py checkpoint=...`` evaluates it on the same kind of data.

        ``channels_last`` (true | false | auto) and ``compile`` (false | true | a torch.compile backend name) are
        speed options applied by :meth:`setup` on the Trainer's device; they are not hyper-parameters.
        """
        super().__init__()
        self.channels_last_option = check_channels_last(channels_last)
        self.compile_backend = check_compile(compile)
        if stage not in STAGES:
            raise ConfigError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
        choice(scheduler, "scheduler", SCHEDULERS)
        choice(ncm_normalise, "ncm", NCM_NORMALISATIONS)
        self.save_hyperparameters(ignore=["channels_last", "compile"])
        self.backbone: Backbone = build_backbone(backbone, in_channels=in_channels, **dict(backbone_options or {}))
        bad = [m for m in mix_layers if m not in self.backbone.mix_points]
        if bad or not mix_layers:
            raise ConfigError(f"mix_layers {list(mix_layers)} invalid for {backbone}: choose from "
                              f"{list(self.backbone.mix_points)} (0 = input, i = after block i)")
        self.classifier = CosineClassifier(self.backbone.feature_dim, num_classes, head_scale, class_gain)
        self.rotation_head = RotationHead(self.backbone.feature_dim)
        self._eval_outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.uses_channels_last = False
        self.compiled = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Backbone features ``[B, D]``."""
        return self.backbone(images)

    # ----------------------------------------------------------------------------------- speed options
    def setup(self, stage: str) -> None:
        """Apply the speed options on the device the Trainer chose (before it moves the model there)."""
        self.prepare_for_device(self.trainer.strategy.root_device)

    def prepare_for_device(self, device: torch.device | str) -> None:
        """Channels-last weights and the compiled backbone for training on ``device`` (idempotent).

        Compilation is regional (:meth:`Backbone.compile_regions`): the stem, every block and the neck are
        compiled one by one and the manifold-mixup point between them stays plain Python, so neither the mix
        point nor λ (new every step) can cause a recompilation or a graph break. The state_dict keys do not
        change, so checkpoints are the same either way.
        """
        device = torch.device(device)
        self.uses_channels_last = resolve_channels_last(self.channels_last_option, device)
        if self.uses_channels_last:
            self.backbone.to(memory_format=torch.channels_last)
        if self.compile_backend is not None and not self.compiled:
            import torch._dynamo.config as dynamo_config

            # all regions share nn.Module's call code, whose compiled variants torch caches together: one per
            # region, train/eval mode and static/dynamic batch size — more than the default limit of 8
            limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
            setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), COMPILE_CACHE_SIZE))
            self.backbone.compile_regions(self.compile_backend)
            self.compiled = True

    def _features(self, images: torch.Tensor, mixup: Mixup | None = None) -> torch.Tensor:
        """Backbone features of ``images``, in NHWC memory format when ``channels_last`` is on."""
        if self.uses_channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.backbone(images) if mixup is None else self.backbone(images, mixup)

    # ----------------------------------------------------------------------------------- training
    def on_train_epoch_start(self) -> None:
        reseed(epoch_seed(self.hparams.seed, self.current_epoch, self.global_rank))

    def _rotation_loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rotated, class_labels, rotation_labels = rotate_batch(images, labels)
        features = self._features(rotated)
        class_logits = self.classifier(features)
        rotation_logits = self.rotation_head(features)
        class_loss = F.cross_entropy(class_logits, class_labels)
        rotation_loss = F.cross_entropy(rotation_logits, rotation_labels)
        stats = {
            "class_loss": class_loss.detach(),
            "rotation_loss": rotation_loss.detach(),
            "acc": (class_logits.argmax(1) == class_labels).float().mean(),
            "rotation_acc": (rotation_logits.argmax(1) == rotation_labels).float().mean(),
        }
        return 0.5 * class_loss + 0.5 * rotation_loss, stats

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        stage = self.hparams.stage
        if stage == "classifier":
            logits = self.classifier(self._features(images))
            loss = F.cross_entropy(logits, labels)
            stats = {"acc": (logits.argmax(1) == labels).float().mean()}
        elif stage == "rotation":
            loss, stats = self._rotation_loss(images, labels)
        else:  # s2m2r
            batch_size = images.shape[0]
            alpha = float(self.hparams.mixup_alpha)
            lam = float(np.random.beta(alpha, alpha))
            layer = int(self.hparams.mix_layers[int(torch.randint(len(self.hparams.mix_layers), ()))])
            # drawn on the batch's device: no blocking host-to-GPU copy per step (on CPU the same draws as ever)
            permutation = torch.randperm(batch_size, device=images.device)
            logits = self.classifier(self._features(images, Mixup(layer, lam, permutation)))
            mix_loss = lam * F.cross_entropy(logits, labels) + (1 - lam) * F.cross_entropy(logits, labels[permutation])
            quarter = torch.randperm(batch_size, device=images.device)[: max(1, batch_size // 4)]
            rotation_loss, stats = self._rotation_loss(images[quarter], labels[quarter])
            loss = mix_loss + rotation_loss
            stats["mixup_loss"] = mix_loss.detach()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss {float(loss)} at step {self.global_step}; "
                                     "lower the learning rate or check the input data")
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True,
                 batch_size=images.shape[0])
        for key, value in stats.items():
            self.log(f"train/{key}", value, on_step=False, on_epoch=True, sync_dist=True, batch_size=images.shape[0])
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        if self.hparams.scheduler == "none":
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------- few-shot evaluation
    def on_validation_epoch_start(self) -> None:
        self._eval_outputs = []

    def on_test_epoch_start(self) -> None:
        self._eval_outputs = []

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return self._features_step(batch)

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return self._features_step(batch)

    def _features_step(self, batch: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Features of one evaluation batch, kept for NCM scoring and returned for callbacks
        (``FewShotEvaluationCallback`` collects them to run PUTM and its peers)."""
        features = self._features(batch[0]).float()
        self._eval_outputs.append((batch[2], features))
        return {"features": features, "labels": batch[1], "indices": batch[2]}

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._score("val")
        self._eval_outputs = []

    def on_test_epoch_end(self) -> None:
        self._score("test")
        self._eval_outputs = []

    def _gathered_features(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All processes' features placed at their dataset rows: ``[n, d]`` and a ``[n]`` coverage mask."""
        indices = torch.cat([i for i, _ in self._eval_outputs]).to(self.device)
        features = torch.cat([f for _, f in self._eval_outputs])
        gather = self.all_gather if self.trainer.world_size > 1 else None
        table, _, seen = scatter_rows(num_rows, indices, features, all_gather=gather)
        return table, seen

    def _score(self, split: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "episodes") or not self._eval_outputs:
            return
        bank: EpisodeBank = datamodule.episodes(split)
        num_rows = len(datamodule.split(split))
        features, seen = self._gathered_features(num_rows)
        needed = torch.cat([bank.support_indices.flatten(), bank.query_indices.flatten()]).unique().to(seen.device)
        if not seen[needed].all():
            effect = "; best.ckpt is not updated this epoch" if split == "val" else ""
            warnings.warn(f"{split}: only part of the split was evaluated (trainer.limit_{split}_batches or "
                          f"overfit_batches?), so {split}/acc is not computed{effect}", stacklevel=1)
            return
        accuracies = ncm_task_accuracy(features, bank, self.hparams.ncm_normalise)
        mean, ci = mean_and_ci95(accuracies)
        self.log(f"{split}/acc", 100.0 * mean, prog_bar=True, sync_dist=True)
        self.log(f"{split}/ci95", 100.0 * ci, sync_dist=True)
