"""ResNet-12 (Oreshkin et al., TADAM, NeurIPS 2018; Lee et al., MetaOptNet, CVPR 2019).

Four residual blocks, each three conv3×3 → BN (LeakyReLU 0.1 between them) plus a 1×1 conv + BN shortcut,
then LeakyReLU and 2×2 max pooling; widths 64 / 160 / 320 / 640. Global average pooling gives 640-d features
(as in most later transductive work). timm does not provide this few-shot variant, hence this file.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_putm.models.base import Backbone, GlobalPoolNeck, init_conv_bn


class ResNet12Block(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, dropout: float, slope: float = 0.1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, 1, 1, bias=False), nn.BatchNorm2d(out_channels),
            nn.LeakyReLU(slope),
            nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False), nn.BatchNorm2d(out_channels),
            nn.LeakyReLU(slope),
            nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False), nn.BatchNorm2d(out_channels),
        )
        self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.slope = slope
        self.dropout = float(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.leaky_relu(self.body(x) + self.shortcut(x), self.slope)
        if min(out.shape[-2:]) >= 2:
            out = F.max_pool2d(out, 2)
        if self.dropout > 0:
            out = F.dropout(out, p=self.dropout, training=self.training)
        return out


class ResNet12(Backbone):
    def __init__(self, widths: Sequence[int] = (64, 160, 320, 640), dropout: float = 0.0,
                 in_channels: int = 3) -> None:
        super().__init__()
        widths = [int(w) for w in widths]
        self.stem = nn.Identity()
        channels = [in_channels, *widths]
        self.blocks = nn.ModuleList(ResNet12Block(channels[i], channels[i + 1], dropout) for i in range(len(widths)))
        self.neck = GlobalPoolNeck()
        self.feature_dim = widths[-1]
        init_conv_bn(self)
