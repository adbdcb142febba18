"""The backbone interface: images ``[B, C, H, W]`` → features ``[B, D]``, with an optional manifold-mixup point.

Every architecture is a stem followed by a sequence of blocks and a neck (final normalisation, activation,
global average pooling). Writing them in this one shape lets a single forward implement manifold mixup
(Verma et al., ICML 2019) as used by S2M2 (Mangla et al., WACV 2020): hidden states are mixed at one chosen
point, ``h ← λ·h + (1 − λ)·h[perm]``, where point 0 is the input and point ``i`` is the output of block ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Mixup:
    """Mix a batch with a permutation of itself at one point of the network (manifold mixup)."""

    layer: int  # 0 = input, i = after block i
    lam: float
    permutation: torch.Tensor  # [B] long

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lam * hidden + (1.0 - self.lam) * hidden[self.permutation]


class Backbone(nn.Module):
    """Base class: subclasses set ``stem``, ``blocks`` (an ``nn.ModuleList``), ``neck`` and ``feature_dim``."""

    feature_dim: int
    stem: nn.Module
    blocks: nn.ModuleList
    neck: nn.Module

    @property
    def mix_points(self) -> range:
        """Valid mixup points: 0 (input) and the output of every block."""
        return range(len(self.blocks) + 1)

    def forward(self, x: torch.Tensor, mixup: Mixup | None = None) -> torch.Tensor:
        if mixup is not None and mixup.layer not in self.mix_points:
            raise ValueError(f"mixup layer {mixup.layer} is not a mix point of {type(self).__name__} "
                             f"(valid: {list(self.mix_points)})")
        if mixup is not None and mixup.layer == 0:
            x = mixup(x)
        x = self.stem(x)
        for index, block in enumerate(self.blocks, start=1):
            x = block(x)
            if mixup is not None and mixup.layer == index:
                x = mixup(x)
        return self.neck(x)

    def compile_regions(self, backend: str = "inductor") -> None:
        """``torch.compile`` the stem, every block and the neck, each in place (``nn.Module.compile``).

        Compiling region by region keeps the manifold-mixup step between them in plain Python: the mix point
        and λ change every step and would otherwise be traced into the graph and recompiled. The parameter
        names (state_dict keys) do not change.
        """
        for region in (self.stem, *self.blocks, self.neck):
            region.compile(backend=backend)


class GlobalPoolNeck(nn.Module):
    """Optional final BN + ReLU (pre-activation nets), then global average pooling to ``[B, C]``."""

    def __init__(self, channels: int | None = None) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels) if channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = torch.relu(self.norm(x))
        return x.mean(dim=(2, 3))


def init_conv_bn(module: nn.Module) -> None:
    """He-normal (fan-out) convolutions, BN weight 1 / bias 0: the usual init of ResNets and WRNs."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
