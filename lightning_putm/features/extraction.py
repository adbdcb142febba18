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


#: What a test or validation step must return for the few-shot callback to collect its features.
STEP_OUTPUTS = ("{'features': [B, d] float tensor, 'labels': [B] integer tensor} (optionally 'indices': [B] "
                "dataset row indices), or a (features, labels) tuple")


@dataclass
class StepRows:
    """One batch's rows as collected: detached and on the CPU (no autograd graph, no accelerator memory held)."""

    features: torch.Tensor  # [B, d]
    labels: torch.Tensor  # [B]
    indices: torch.Tensor | None  # [B] dataset rows, or None: rows are placed in the order they were collected


def _described(value: Any) -> str:
    """What a step returned, in a few words: ``a dict with keys ['loss']``, ``a tensor of shape [64, 10]``."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"


def step_rows(outputs: Any, where: str) -> StepRows:
    """The rows of one step's outputs: a dict with ``features`` and ``labels`` (and ``indices``), or a
    ``(features, labels[, indices])`` tuple; anything else is a one-line :class:`FeatureError` saying what to return."""
    if isinstance(outputs, dict) and {"features", "labels"} <= set(outputs):
        features, labels, indices = outputs["features"], outputs["labels"], outputs.get("indices")
    elif isinstance(outputs, (tuple, list)) and len(outputs) in (2, 3):
        features, labels, indices = outputs[0], outputs[1], (outputs[2] if len(outputs) == 3 else None)
    else:
        raise FeatureError(f"{where} must return {STEP_OUTPUTS} for the few-shot callback; it returned "
                           f"{_described(outputs)}")
    if not isinstance(features, torch.Tensor) or features.dim() != 2 or not features.dtype.is_floating_point:
        flatten = "; flatten it with features.flatten(1)" if isinstance(features, torch.Tensor) \
            and features.dim() > 2 else ""
        raise FeatureError(f"{where}: 'features' must be a [B, d] float tensor (one row per sample), got "
                           f"{_described(features)}{flatten}")
    for name, value in (("labels", labels), ("indices", indices)):
        if name == "indices" and value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point \
                or value.dtype == torch.bool or len(value) != len(features):
            raise FeatureError(f"{where}: '{name}' must be a [B] integer tensor with one entry per row of "
                               f"'features' ({len(features)} rows), got {_described(value)}")
    return StepRows(features.detach().cpu(), labels.detach().cpu(),
                    None if indices is None else indices.detach().cpu())


@dataclass
class SplitInfo:
    """What a datamodule says about a split: its size and class names (``None`` for a datamodule without
    ``split(name)``, or no datamodule: rows and class names then come from the collected batches)."""

    size: int
    class_names: list[str]
    metadata: dict[str, Any]


def split_info(trainer: pl.Trainer, split: str) -> SplitInfo | None:
    """The split as the Trainer's datamodule describes it (``split(name)`` with ``len`` and ``class_names``, as
    :class:`~lightning_putm.data.datamodule.FewShotDataModule` has), else ``None``."""
    datamodule = getattr(trainer, "datamodule", None)
    describe = getattr(datamodule, "split", None)
    if not callable(describe):
        return None
    info = describe(split)
    if not hasattr(info, "__len__") or not hasattr(info, "class_names"):
        return None
    return SplitInfo(len(info), list(info.class_names), dict(getattr(info, "metadata", {}) or {}))


class FeatureCollector(pl.Callback):
    """Collects each batch's ``features``, ``labels`` (and ``indices``) of the test loop; :attr:`feature_set` is
    the assembled split (``split`` names the split the loop runs over, as the datamodule calls it).

    Rows with ``indices`` are placed at their dataset row, so the table does not depend on the batch order or the
    number of processes. Without ``indices`` the table's row ``i`` is the ``i``-th row collected (the loader's
    order: a shuffled loader gives another order, and so other seeded tasks, at every pass); under several
    processes that is ambiguous (each sees a padded shard) and refused.
    """

    def __init__(self, split: str = "test") -> None:
        super().__init__()
        self.split = split
        self._outputs: list[StepRows] = []
        self.feature_set: FeatureSet | None = None

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._outputs = []

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._outputs = []

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self.collect(trainer, pl_module, outputs, "test", dataloader_idx)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.feature_set = self.assemble(trainer, pl_module, self.split)
        self._outputs = []

    def collect(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, loop: str = "test",
                dataloader_idx: int = 0) -> None:
        """Keep one batch's rows; a step output the callback cannot use is an error at the first batch."""
        where = f"{type(pl_module).__name__}.{loop}_step"
        if dataloader_idx:
            raise FeatureError(f"{where}: the few-shot callback evaluates one {loop} dataloader, but this loop has "
                               f"several (dataloader_idx={dataloader_idx}); give the {loop} loop one dataloader")
        rows = step_rows(outputs, where)
        if rows.indices is None and trainer.world_size > 1:
            raise FeatureError(f"{where} returns no 'indices' but runs on {trainer.world_size} processes, each on "
                               "a padded shard of the data: return 'indices' (each row's index in the dataset) so "
                               "every row is placed once")
        if self._outputs and (self._outputs[0].indices is None) != (rows.indices is None):
            raise FeatureError(f"{where} returned 'indices' for some batches and not for others; return them for "
                               "every batch or for none")
        self._outputs.append(rows)

    def assemble(self, trainer: pl.Trainer, pl_module: pl.LightningModule, split: str) -> FeatureSet:
        """The split's feature table ``[n, d]`` from every process's batches.

        With a datamodule that describes the split (``split(name)``), every one of its rows must have been
        evaluated and its class names are used; otherwise the table holds the rows seen (by index, each once; or in
        the order collected) and the class names are the label values."""
        if not self._outputs:
            raise FeatureError(f"the {split} loop produced no batches; check the data split and limit_{split}_batches")
        labels = torch.cat([o.labels for o in self._outputs]).long()
        features = torch.cat([o.features for o in self._outputs]).float()
        info = split_info(trainer, split)
        if self._outputs[0].indices is not None:
            indices = torch.cat([o.indices for o in self._outputs if o.indices is not None]).long()
            features, labels = self._placed(trainer, pl_module, split, info, indices, features, labels)
        if info is not None:
            class_names = info.class_names
        else:  # class names are the label values; labels become their positions 0..C-1
            values = labels.unique(sorted=True)
            labels = torch.searchsorted(values, labels)
            class_names = [str(v) for v in values.tolist()]
        datamodule = getattr(trainer, "datamodule", None)
        metadata = dict(info.metadata) if info is not None else {}
        name = getattr(datamodule, "dataset_name", "features") if datamodule is not None else type(pl_module).__name__
        metadata.setdefault("source", f"{name}/{split}")
        # clone: tensors made under inference mode cannot take part in autograd (PUTM's navigators)
        return FeatureSet(features.cpu().clone(), labels.cpu().clone(), class_names, metadata)

    @staticmethod
    def _placed(trainer: pl.Trainer, pl_module: pl.LightningModule, split: str, info: SplitInfo | None,
                indices: torch.Tensor, features: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every process's rows at their dataset index (DistributedSampler: equal shards, padding lands twice)."""
        gather = None
        if trainer.world_size > 1:  # the collective runs on the module's device (NCCL needs CUDA tensors)
            gather = pl_module.all_gather
            indices, features, labels = (t.to(pl_module.device) for t in (indices, features, labels))
        if info is not None:
            num_rows = info.size
        else:
            top = indices.max() if len(indices) else indices.new_tensor(-1)
            num_rows = int((gather(top).max() if gather is not None else top)) + 1
        table, label_table, seen = scatter_rows(num_rows, indices, features, labels, all_gather=gather)
        if info is None:
            return table[seen], label_table[seen]
        missing = int((label_table < 0).sum())
        if missing:
            raise FeatureError(f"{missing} of {num_rows} rows of the {split} split were not evaluated "
                               f"(limit_{split}_batches?); few-shot evaluation needs every row")
        return table, label_table
