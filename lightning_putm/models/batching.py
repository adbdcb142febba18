"""A backbone's forward pass over a batch that may not fit in the device's memory: halve the batch and go on.

Feature extraction picks one batch size for every backbone and device (``data.eval_batch_size``, predict's
``batch_size``). A large model on a small GPU would stop with an out-of-memory error partway through a split;
instead the batch is cut in halves until it fits, and later batches keep the size that fitted. Backbones run in
eval mode, so an image's features do not depend on the other images of its batch: the result is the same.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

#: What a device raises when an allocation fails (``torch.cuda.OutOfMemoryError`` is the same class).
OUT_OF_MEMORY: type[BaseException] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


class MemoryAdaptedForward:
    """Calls ``backbone`` on slices of at most :attr:`rows` images (all of them until memory runs out)."""

    def __init__(self, backbone: Callable[[torch.Tensor], torch.Tensor],
                 notify: Callable[[str], None] | None = None) -> None:
        self.backbone = backbone
        self.rows: int | None = None  # None: whole batches have fitted so far
        self.notify = notify or (lambda text: warnings.warn(text, stacklevel=3))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        rows = self.rows or int(images.shape[0])
        while True:
            try:
                return torch.cat([self.backbone(part) for part in images.split(max(1, rows))])
            except OUT_OF_MEMORY:
                if rows <= 1:
                    raise
                rows = rows // 2
                self.rows = rows
                if images.is_cuda:
                    torch.cuda.empty_cache()
                self.notify(f"feature extraction ran out of device memory; going on with batches of {rows} images "
                            "(a smaller data.eval_batch_size, or batch_size for predict, avoids the retries)")
