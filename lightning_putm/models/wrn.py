"""Wide residual network WRN-28-10 (Zagoruyko & Komodakis, BMVC 2016) as used by S2M2 (Mangla et al., 2020).

Pre-activation basic blocks (BN → ReLU → conv3×3 → BN → ReLU → dropout → conv3×3, plus the identity or a
1×1 projection of the activated input), three groups of ``(depth − 4) / 6`` blocks with widths
16k / 32k / 64k (160 / 320 / 640 for k = 10) and strides 1 / 2 / 2, then BN → ReLU → global average pooling:
640-d non-negative features. S2M2 keeps the first convolution at stride 1 and uses dropout 0.5 in every block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_putm.models.base import Backbone, GlobalPoolNeck, init_conv_bn


class PreActBasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.dropout = float(dropout)
        needs_projection = in_channels != out_channels or stride != 1
        self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride, 0, bias=False) if needs_projection else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = F.relu(self.bn1(x))
        residual = x if self.shortcut is None else self.shortcut(activated)
        out = F.relu(self.bn2(self.conv1(activated)))
        if self.dropout > 0:
            out = F.dropout(out, p=self.dropout, training=self.training)
        return self.conv2(out) + residual


class WideResNet(Backbone):
    """WRN-``depth``-``widen``; features of dimension ``64·widen``."""

    def __init__(self, depth: int = 28, widen: int = 10, dropout: float = 0.5, in_channels: int = 3,
                 first_stride: int = 1) -> None:
        super().__init__()
        if (depth - 4) % 6 != 0:
            raise ValueError(f"WRN depth must be 6n + 4 (e.g. 28), got {depth}")
        per_group = (depth - 4) // 6
        widths = [16, 16 * widen, 32 * widen, 64 * widen]
        self.stem = nn.Conv2d(in_channels, widths[0], 3, first_stride, 1, bias=False)
        groups = []
        for g, stride in enumerate((1, 2, 2)):
            layers = [PreActBasicBlock(widths[g] if i == 0 else widths[g + 1], widths[g + 1],
                                       stride if i == 0 else 1, dropout) for i in range(per_group)]
            groups.append(nn.Sequential(*layers))
        self.blocks = nn.ModuleList(groups)
        self.neck = GlobalPoolNeck(widths[3])
        self.feature_dim = widths[3]
        init_conv_bn(self)
