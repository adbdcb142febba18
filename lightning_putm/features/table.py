"""One split's feature table from the batches of an evaluation loop, over every process.

Both the S2M2 module (nearest-class-mean scores during pretraining) and the few-shot evaluation callback collect
``(indices, features, labels)`` per batch; under DDP each process sees a shard (``DistributedSampler`` pads
shards to equal length, so all-gather works and a padded row simply lands twice at its own index). This module
places the rows at their dataset index, so a table never depends on the number of processes or the batch order.
"""

from __future__ import annotations

from typing import Callable

import torch

AllGather = Callable[[torch.Tensor], torch.Tensor]


def scatter_rows(num_rows: int, indices: torch.Tensor, features: torch.Tensor, labels: torch.Tensor | None = None,
                 all_gather: AllGather | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(table [n, d], labels [n] (−1 where unseen) or None, seen [n] bool)`` from this process's rows.

    ``all_gather`` (e.g. ``LightningModule.all_gather``) collects every process's rows first.
    """
    indices = indices.long()
    if all_gather is not None:
        indices = all_gather(indices).reshape(-1)
        features = all_gather(features).reshape(-1, features.shape[-1])
        if labels is not None:
            labels = all_gather(labels).reshape(-1)
    indices = indices.to(features.device)
    table = features.new_zeros((num_rows, features.shape[1]))
    seen = torch.zeros(num_rows, dtype=torch.bool, device=features.device)
    table[indices] = features
    seen[indices] = True
    label_table = None
    if labels is not None:
        label_table = labels.new_full((num_rows,), -1)
        label_table[indices.to(labels.device)] = labels
    return table, label_table, seen
