"""Backbones, manifold mixup, heads and the registry (lightning_putm.models)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_putm.errors import ConfigError
from lightning_putm.models import (CosineClassifier, Mixup, RotationHead, available_backbones, build_backbone,
                                   default_cosine_scale, rotate_batch)
from lightning_putm.models.wrn import PreActBasicBlock, WideResNet

# Small but structurally faithful variants, so every test stays fast on a 2-core CPU.
SMALL = {
    "conv4": ({"width": 8}, 1, 16),
    "resnet12": ({"widths": [4, 8, 8, 16]}, 3, 16),
    "resnet18": ({"small_input": True}, 3, 8),
    "wrn28_10": ({"depth": 10, "widen": 1}, 3, 16),
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


pytestmark = pytest.mark.usefixtures("single_thread")


def test_registry_lists_every_backbone() -> None:
    assert available_backbones() == sorted(SMALL)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_features_have_the_declared_dimension(name: str) -> None:
    options, channels, size = SMALL[name]
    net = build_backbone(name, in_channels=channels, **options)
    out = net(torch.randn(3, channels, size, size))
    assert out.shape == (3, net.feature_dim)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_mixup_at_every_layer_keeps_shapes(name: str) -> None:
    options, channels, size = SMALL[name]
    net = build_backbone(name, in_channels=channels, **options).eval()
    x = torch.randn(4, channels, size, size)
    plain = net(x)
    permutation = torch.tensor([1, 0, 3, 2])
    assert len(net.mix_points) == len(net.blocks) + 1
    for layer in net.mix_points:
        mixed = net(x, Mixup(layer, 0.3, permutation))
        assert mixed.shape == plain.shape
        # lambda = 1 leaves the batch untouched; lambda = 0 at the input equals the permuted batch.
        torch.testing.assert_close(net(x, Mixup(layer, 1.0, permutation)), plain)
    torch.testing.assert_close(net(x, Mixup(0, 0.0, permutation)), net(x[permutation]))


def test_mixup_rejects_a_point_that_does_not_exist() -> None:
    net = build_backbone("conv4", in_channels=1, width=4)
    with pytest.raises(ValueError, match="not a mix point"):
        net(torch.randn(2, 1, 8, 8), Mixup(len(net.blocks) + 1, 0.5, torch.tensor([1, 0])))


def test_wrn_28_10_matches_s2m2() -> None:
    net = build_backbone("wrn28_10")  # the real WRN-28-10 (36.5M parameters)
    assert isinstance(net, WideResNet) and net.feature_dim == 640
    assert [len(group) for group in net.blocks] == [4, 4, 4]
    widths = [group[0].conv1.out_channels for group in net.blocks]
    strides = [group[0].conv1.stride[0] for group in net.blocks]
    assert widths == [160, 320, 640] and strides == [1, 2, 2]
    assert net.stem.stride == (1, 1)
    blocks = [b for b in net.modules() if isinstance(b, PreActBasicBlock)]
    assert len(blocks) == 12 and all(b.dropout == 0.5 for b in blocks)
    # Pre-activation: each block normalises its input before the first convolution.
    assert all(b.bn1.num_features == b.conv1.in_channels for b in blocks)
    assert net.neck.norm is not None and net.neck.norm.num_features == 640
    assert 36_000_000 < sum(p.numel() for p in net.parameters()) < 37_000_000


def test_dropout_only_in_training_mode() -> None:
    net = build_backbone("wrn28_10", depth=10, widen=1, dropout=0.5)
    x = torch.randn(2, 3, 8, 8)
    net.eval()
    torch.testing.assert_close(net(x), net(x))
    net.train()
    assert not torch.equal(net(x), net(x))


def test_features_are_non_negative_where_the_net_ends_in_relu() -> None:
    for name in ("conv4", "wrn28_10", "resnet18"):
        options, channels, size = SMALL[name]
        out = build_backbone(name, in_channels=channels, **options)(torch.randn(3, channels, size, size))
        assert (out >= 0).all(), name


def test_conv4_accepts_tiny_images() -> None:
    net = build_backbone("conv4", in_channels=1)
    assert net(torch.randn(2, 1, 8, 8)).shape == (2, 64)  # 8 -> 4 -> 2 -> 1 -> 1
    assert net(torch.randn(2, 1, 28, 28)).shape == (2, 64)


def test_timm_resnet18_is_built_without_downloads() -> None:
    net = build_backbone("resnet18", in_channels=3)
    assert net.feature_dim == 512 and len(net.blocks) == 4


def test_registry_errors_name_what_exists() -> None:
    with pytest.raises(ConfigError, match="available: conv4"):
        build_backbone("vgg")
    with pytest.raises(ConfigError, match="no option.*colour.*width"):
        build_backbone("conv4", colour=True)


def test_cosine_classifier_scale_and_invariance() -> None:
    assert default_cosine_scale(64) == 2.0 and default_cosine_scale(4800) == 10.0
    head = CosineClassifier(6, 4)
    x = torch.rand(5, 6)
    logits = head(x)
    assert logits.shape == (5, 4) and head.scale == 2.0
    torch.testing.assert_close(head(7.0 * x), logits)  # only the direction of a feature matters
    assert logits.abs().max() <= head.scale * head.gain.abs().max() + 1e-5
    fixed = CosineClassifier(6, 4, scale=10.0, class_gain=False)
    assert fixed.gain is None and fixed(x).abs().max() <= 10.0 + 1e-5


def test_rotation_head_and_rotate_batch() -> None:
    assert isinstance(RotationHead(8), nn.Linear) and RotationHead(8).out_features == 4
    images = torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).reshape(2, 1, 3, 3)
    labels = torch.tensor([7, 9])
    rotated, class_labels, rotation_labels = rotate_batch(images, labels)
    assert rotated.shape == (8, 1, 3, 3)
    assert class_labels.tolist() == [7, 9] * 4
    assert rotation_labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    torch.testing.assert_close(rotated[:2], images)
    torch.testing.assert_close(rotated[2], torch.rot90(images[0], 1, dims=(-2, -1)))
    torch.testing.assert_close(rotated[7], torch.rot90(images[1], 3, dims=(-2, -1)))
    with pytest.raises(ValueError, match="square"):
        rotate_batch(torch.zeros(1, 1, 2, 3), torch.tensor([0]))
