"""The test loop of ``evaluate.py``: one pass that yields ``{features, labels, indices}`` per batch.

``Trainer.test`` drives evaluation, so device placement, progress bars, loggers and distributed sharding are
Lightning's. The test loop's only job is to produce the features of the evaluated split; the
:class:`~lightning_putm.evaluation.callback.FewShotEvaluationCallback` collects them and runs the few-shot methods.

* :class:`BackboneFeatures`: images → features of a pretrained backbone (eval mode, no gradients).
* :class:`FeatureRows` with :class:`FeatureRowsDataModule`: replays an existing feature set (a feature file,
  the built-in demo, or a cache hit) through the same loop, so every source takes the same path.
* :class:`FeatureCollector`: the callback that collects a loop's outputs and assembles the split's feature
  table (over every process); the few-shot callback is one, and base-class features are extracted with one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_putm.errors import FeatureError
from lightning_putm.features.files import FeatureSet
from lightning_putm.features.table import scatter_rows
from lightning_putm.models import Backbone
from lightning_putm.models.batching import MemoryAdaptedForward


class BackboneFeatures(pl.LightningModule):
    """Feature extraction with a pretrained backbone: ``test_step`` returns the batch's features.

    On CUDA the weights and images are laid out channels-last (NHWC), the layout cuDNN's tensor-core
    convolutions run fastest with, as in pretraining; on CPU the default layout keeps features bit-for-bit as
    they were. ``trainer.precision=bf16-mixed`` adds bf16 autocast (and its own feature-cache entry). A batch that
    does not fit in device memory is split (:class:`~lightning_putm.models.batching.MemoryAdaptedForward`).
    """

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone.eval()
        self.forward_adapted = MemoryAdaptedForward(self.backbone)  # halves the batch on out-of-memory

    def on_test_start(self) -> None:
        if self.device.type == "cuda":
            self.backbone.to(memory_format=torch.channels_last)

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        images, labels, indices = batch[0], batch[1], batch[2]
        if images.is_cuda and images.dim() == 4:
            images = images.contiguous(memory_format=torch.channels_last)
        return {"features": self.forward_adapted(images).float(), "labels": labels, "indices": indices}


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


class FeatureCollector(pl.Callback):
    """Collects ``{features, labels, indices}`` of the test loop; :attr:`feature_set` is the assembled split
    (``split`` names the datamodule's split that the test loop runs over)."""

    def __init__(self, split: str = "test") -> None:
        super().__init__()
        self.split = split
        self._outputs: list[dict[str, torch.Tensor]] = []
        self.feature_set: FeatureSet | None = None

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._outputs = []

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._outputs = []

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self.collect(outputs)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.feature_set = self.assemble(trainer, pl_module, self.split)
        self._outputs = []

    def collect(self, outputs: Any) -> None:
        if not isinstance(outputs, dict) or not {"features", "labels", "indices"} <= set(outputs):
            raise TypeError("the loop's step must return a dict with 'features', 'labels' and 'indices' to collect "
                            "features (BackboneFeatures, FeatureRows and S2M2Module do)")
        self._outputs.append({k: outputs[k].detach() for k in ("features", "labels", "indices")})

    def assemble(self, trainer: pl.Trainer, pl_module: pl.LightningModule, split: str) -> FeatureSet:
        """The split's feature table ``[n, d]`` from every process's batches, rows placed by dataset index."""
        if not self._outputs:
            raise FeatureError(f"the {split} loop produced no batches; check the data split and limit_{split}_batches")
        indices = torch.cat([o["indices"] for o in self._outputs]).long()
        labels = torch.cat([o["labels"] for o in self._outputs]).long()
        features = torch.cat([o["features"] for o in self._outputs]).float()
        datamodule = trainer.datamodule
        info = datamodule.split(split)
        num_rows = len(info)
        gather = pl_module.all_gather if trainer.world_size > 1 else None  # DistributedSampler: equal shards
        table, label_table, _ = scatter_rows(num_rows, indices, features, labels, all_gather=gather)
        missing = int((label_table < 0).sum())
        if missing:
            raise FeatureError(f"{missing} of {num_rows} rows of the {split} split were not evaluated "
                               f"(limit_{split}_batches?); few-shot evaluation needs every row")
        metadata = dict(getattr(info, "metadata", {}) or {})
        metadata.setdefault("source", f"{getattr(datamodule, 'dataset_name', 'features')}/{split}")
        # clone: tensors made under inference mode cannot take part in autograd (PUTM's navigators)
        return FeatureSet(table.cpu().clone(), label_table.cpu().clone(), list(info.class_names), metadata)
