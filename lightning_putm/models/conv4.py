"""Conv-4 (Vinyals et al., NeurIPS 2016; Snell et al., NeurIPS 2017): four conv3×3 → BN → ReLU → 2×2 max-pool blocks.

Pooling is skipped once a map is 1×1, so the same network takes 28×28 Omniglot (28 → 14 → 7 → 3 → 1) and the
8×8 digits of the demo (8 → 4 → 2 → 1 → 1); global average pooling then gives ``width``-d non-negative features
(equal to ProtoNets' flattened output wherever the last map is 1×1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_putm.models.base import Backbone, GlobalPoolNeck, init_conv_bn


class ConvBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return F.max_pool2d(x, 2) if min(x.shape[-2:]) >= 2 else x


class Conv4(Backbone):
    def __init__(self, width: int = 64, depth: int = 4, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Identity()
        self.blocks = nn.ModuleList(ConvBlock(in_channels if i == 0 else width, width) for i in range(depth))
        self.neck = GlobalPoolNeck()
        self.feature_dim = int(width)
        init_conv_bn(self)
