"""ResNet-18 (He et al., CVPR 2016) built by timm (``pretrained=False``: no downloads), split into mix points.

timm's network is used as is; this wrapper only exposes its stem (conv1, BN, ReLU, max-pool) and its four
stages so manifold mixup can act between them. ``small_input=True`` swaps the stem for a stride-1 conv3×3
without max-pooling, the usual adaptation for 32×32 images such as CIFAR-FS.
"""

from __future__ import annotations

import timm
from torch import nn

from lightning_putm.models.base import Backbone, GlobalPoolNeck


class TimmResNet(Backbone):
    def __init__(self, variant: str = "resnet18", in_channels: int = 3, small_input: bool = False,
                 drop_rate: float = 0.0) -> None:
        super().__init__()
        net = timm.create_model(variant, pretrained=False, num_classes=0, in_chans=in_channels, drop_rate=drop_rate)
        if small_input:
            net.conv1 = nn.Conv2d(in_channels, net.conv1.out_channels, 3, 1, 1, bias=False)
            net.maxpool = nn.Identity()
        self.stem = nn.Sequential(net.conv1, net.bn1, net.act1, net.maxpool)
        self.blocks = nn.ModuleList([net.layer1, net.layer2, net.layer3, net.layer4])
        self.neck = GlobalPoolNeck()
        self.feature_dim = int(net.num_features)
