"""The test loop of ``evaluate.py``: one pass that yields ``{features, labels, indices}`` per batch.

``Trainer.test`` drives evaluation, so device placement, progress bars, loggers and distributed sharding are
Lightning's. The test loop's only job is to produce the features of the evaluated split; the
:class:`~lightning_putm.callbacks.FewShotEvaluationCallback` collects them and runs the few-shot methods.

* :class:`BackboneFeatures`: images → features of a pretrained backbone (eval mode, no gradients).
* :class:`FeatureRows` with :class:`FeatureRowsDataModule`: replays an existing feature set (a feature file,
  the built-in demo, or a cache hit) through the same loop, so every source takes the same path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_putm.features import FeatureSet
from lightning_putm.models import Backbone


class BackboneFeatures(pl.LightningModule):
    """Feature extraction with a pretrained backbone: ``test_step`` returns the batch's features."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone.eval()

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        images, labels, indices = batch[0], batch[1], batch[2]
        return {"features": self.backbone(images).float(), "labels": labels, "indices": indices}


class FeatureRows(pl.LightningModule):
    """Replays feature rows unchanged: ``test_step`` returns the batch as features."""

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return {"features": batch[0].float(), "labels": batch[1], "indices": batch[2]}


@dataclass
class FeatureSplit:
    """What the callback needs to know about a split besides its rows: class names and provenance."""

    class_names: list[str]
    size: int
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.size


class FeatureRowsDataModule(pl.LightningDataModule):
    """A feature set as a test split of ``(features, label, index)`` batches."""

    def __init__(self, feature_set: FeatureSet, batch_size: int = 4096, split_name: str = "test") -> None:
        super().__init__()
        self.feature_set = feature_set
        self.batch_size = int(batch_size)
        self.split_name = split_name

    def split(self, name: str) -> FeatureSplit:
        return FeatureSplit(list(self.feature_set.class_names), len(self.feature_set), dict(self.feature_set.metadata))

    def test_dataloader(self) -> DataLoader:
        rows = self.feature_set
        dataset = TensorDataset(rows.features, rows.labels, torch.arange(len(rows)))
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False)
