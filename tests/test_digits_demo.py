"""The digits demo's splits: validation never touches the novel (test) classes."""

from __future__ import annotations

import pytest
import torch

from lightning_putm.data.registry import read_split
from lightning_putm.errors import ConfigError


def test_default_validation_is_held_out_images_of_the_base_classes() -> None:
    train, val, test = (read_split("digits", None, s) for s in ("train", "val", "test"))
    assert train.class_names == val.class_names == [f"digit_{d}" for d in range(5)]
    assert test.class_names == [f"digit_{d}" for d in range(5, 10)]
    assert len(train) + len(val) + len(test) == 1797  # every image in exactly one split
    # no validation image is also a training image (the 8x8 digits have few exact duplicates: compare rows)
    train_rows = {tuple(row.tolist()) for row in train.images.flatten(1)}
    overlap = sum(tuple(row.tolist()) in train_rows for row in val.images.flatten(1))
    assert overlap <= 2
    sizes = val.class_sizes() / (train.class_sizes() + val.class_sizes())
    assert torch.allclose(sizes, torch.full((5,), 0.2), atol=0.01)  # val_fraction=0.2 of each base class
    again = read_split("digits", None, "val")
    assert torch.equal(again.images, val.images)  # a fixed draw: every run validates on the same images


def test_validation_classes_option_holds_out_whole_base_classes() -> None:
    options = {"base_classes": [2, 3, 4], "val_classes": [0, 1]}
    train = read_split("digits", None, "train", **options)
    val = read_split("digits", None, "val", **options)
    assert train.class_names == ["digit_2", "digit_3", "digit_4"] and val.class_names == ["digit_0", "digit_1"]
    assert set(train.labels.tolist()) == {0, 1, 2} and set(val.labels.tolist()) == {0, 1}
    assert len(train) + len(val) == len(read_split("digits", None, "train", val_fraction=0.0))  # digits 0-4 in all


@pytest.mark.parametrize("options, message", [
    ({"val_classes": [4, 5]}, r"share digits \[4\]"),
    ({"novel_classes": [4, 5, 6]}, r"base_classes and data.options.novel_classes share digits \[4\]"),
    ({"base_classes": [0, 0, 1]}, "base_classes must be a list of distinct digits"),
    ({"val_fraction": 1.0}, r"val_fraction must be a number in \[0, 1\)"),
])
def test_bad_digits_options_are_clear_errors(options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        read_split("digits", None, "val", **options)
