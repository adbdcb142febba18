"""Feature extraction that adapts its batch to the device's memory (lightning_putm.models.batching)."""

from __future__ import annotations

import pytest
import torch

from lightning_putm.features.extraction import BackboneFeatures
from lightning_putm.models.batching import OUT_OF_MEMORY, MemoryAdaptedForward
from lightning_putm.prediction.images import extract_features


class SmallDevice(torch.nn.Module):
    """A linear 'backbone' whose device holds at most ``capacity`` images per call; records the calls."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(6, 3)
        self.capacity = capacity
        self.calls: list[int] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls.append(int(images.shape[0]))
        if images.shape[0] > self.capacity:
            raise OUT_OF_MEMORY("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.linear(images.flatten(1))


def test_a_batch_too_large_is_halved_until_it_fits_and_stays_that_size() -> None:
    device = SmallDevice(capacity=5)
    notices: list[str] = []
    forward = MemoryAdaptedForward(device, notices.append)
    images = torch.rand(16, 6)
    out = forward(images)
    torch.testing.assert_close(out, device.linear(images))  # the same features as one pass
    assert device.calls == [16, 8, 4, 4, 4, 4] and forward.rows == 4
    assert len(notices) == 2 and "batches of 4 images" in notices[-1]
    device.calls.clear()
    forward(torch.rand(10, 6))  # the next batch starts at the size that fitted
    assert device.calls == [4, 4, 2] and len(notices) == 2


def test_a_single_image_that_does_not_fit_is_the_error() -> None:
    forward = MemoryAdaptedForward(SmallDevice(capacity=0), lambda _: None)
    with pytest.raises(OUT_OF_MEMORY):
        forward(torch.rand(4, 6))


def test_the_extraction_step_and_predict_use_it() -> None:
    """BackboneFeatures.test_step (evaluate.py) and extract_features (predict) both survive a small device."""
    device = SmallDevice(capacity=3)
    images = torch.rand(7, 6)
    with pytest.warns(UserWarning, match="ran out of device memory"):
        step = BackboneFeatures(device).test_step((images, torch.zeros(7), torch.arange(7)), 0)["features"]
    torch.testing.assert_close(step, device.linear(images))
    device = SmallDevice(capacity=3)
    paths = [f"image{i}.png" for i in range(7)]
    with pytest.warns(UserWarning, match="ran out of device memory"):
        rows = extract_features(device, paths, lambda path: images[int(path[5:-4])], torch.device("cpu"), batch_size=7)
    torch.testing.assert_close(rows, device.linear(images))
