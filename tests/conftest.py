"""Shared fixtures: small synthetic feature sets with clear class structure (built in memory, no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_putm.features.files import FeatureSet

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
#: The environment variable that points the real-data tests at an Omniglot copy: the folder you would pass as
#: ``data.root=`` (it holds ``omniglot-py/images_background`` and ``omniglot-py/images_evaluation``).
OMNIGLOT_ENV = "LIGHTNING_PUTM_OMNIGLOT"


def real_omniglot_root() -> Path:
    """``$LIGHTNING_PUTM_OMNIGLOT``, else ``<checkout's parent>/shared/data/omniglot``; tests skip when absent."""
    configured = os.environ.get(OMNIGLOT_ENV)
    return Path(configured).expanduser() if configured else SHARED_DATA / "omniglot"


def omniglot_skip_reason(root: Path) -> str:
    return (f"real Omniglot not found at {root} (optional: set {OMNIGLOT_ENV} to the folder that holds "
            "omniglot-py/, the one you would pass as data.root=)")


def make_clustered_features(classes: int = 10, per_class: int = 40, dim: int = 32, spread: float = 0.15,
                            seed: int = 0) -> FeatureSet:
    """Non-negative (post-ReLU-like) features: one well-separated cluster per class."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.rand(classes, dim, generator=generator) * 2.0
    labels = torch.arange(classes).repeat_interleave(per_class)
    noise = spread * torch.randn(classes * per_class, dim, generator=generator)
    features = (centres[labels] + noise).clamp_min(0.0)
    return FeatureSet(features, labels, [f"class_{c}" for c in range(classes)], {"source": "synthetic"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.cuda`` tests are skipped, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def clustered() -> FeatureSet:
    return make_clustered_features()


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors: one thread avoids OpenMP spin-waits, which cost seconds on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A Conv-4 of width 8 trained for one epoch (classifier stage) on the base digits: a real checkpoint in seconds."""
    from lightning_putm.jobs.train import run_train_backbone

    folder = tmp_path_factory.mktemp("tiny_checkpoint")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train_backbone(["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                            "trainer.accelerator=cpu", "backbone.width=8", "stages=[classifier]", "trainer.max_epochs=1",
                            "val_episodes.tasks=5", "run_test=false", f"checkpoint_dir={folder}"], log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    return folder / "digits" / "conv4" / "latest" / "classifier" / "last.ckpt"
