"""Tests that need a CUDA device (``@pytest.mark.cuda``; skipped with "needs a CUDA device" elsewhere).

Run them on a GPU machine with ``python -m pytest -m cuda -q`` (benchmarks/gpu_check.sh does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from conftest import make_clustered_features
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.jobs.train import run_train_backbone
from lightning_putm.methods.putm import PUTM
from lightning_putm.models import Mixup
from lightning_putm.pretraining.checkpoints import load_module
from lightning_putm.pretraining.module import S2M2Module

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda", 0)


def putm_tasks(seed: int, tasks: int = 8):
    features = make_clustered_features(classes=10, per_class=60, dim=32, spread=0.3, seed=seed)
    bank = sample_episode_bank(features.labels, 5, 1, 40, 2.0, tasks, seed)
    return bank.gather(features.features)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_putm_on_cuda_predicts_like_on_cpu_in_fp32(seed: int) -> None:
    """The same tasks solved on CPU and on the GPU in fp32 (no TF32): >= 99% of queries get the same class."""
    gathered = putm_tasks(seed)
    putm = PUTM(shots=1, balanced=False, em_steps=10, inner_steps=10, precision="fp32")
    on_cpu = putm.predict(gathered.batch).argmax(-1)
    on_gpu = putm.predict(gathered.batch.to(CUDA))
    assert on_gpu.device.type == "cuda"
    agreement = (on_gpu.argmax(-1).cpu() == on_cpu).double().mean().item()
    assert agreement >= 0.99, f"CPU/GPU argmax agreement {agreement:.4f}"


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.stem_layouts: list[tuple[str, bool]] = []  # (device, channels-last?) of the stem's weight, per step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        weight = module.backbone.stem.weight
        self.stem_layouts.append((weight.device.type, weight.is_contiguous(memory_format=torch.channels_last)))


def synthetic_loader(batch: int = 16, size: int = 32, classes: int = 10) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2 * batch, 3, size, size, generator=generator),
                                          torch.randint(classes, (2 * batch,), generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=batch, drop_last=True)


def test_one_s2m2r_step_on_cuda_in_bf16_mixed_with_channels_last_auto() -> None:
    """``channels_last=auto`` turns on for the CUDA Trainer; the bf16-mixed step's loss is finite and the
    weights move."""
    torch.manual_seed(0)
    module = S2M2Module(backbone="wrn28_10", backbone_options={"depth": 10, "widen": 2}, num_classes=10,
                        stage="s2m2r", channels_last="auto")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    recorder = LossRecorder()
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=2, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[recorder])
    trainer.fit(module, train_dataloaders=synthetic_loader())
    assert module.uses_channels_last
    # during training (Lightning moves the module back to the CPU when fit ends)
    assert recorder.stem_layouts == [("cuda", True), ("cuda", True)]
    assert len(recorder.losses) == 2 and all(torch.isfinite(torch.tensor(recorder.losses)))
    after = module.state_dict()
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before if before[k].is_floating_point())


def test_compiled_backbone_on_cuda_matches_eager_at_every_mix_point() -> None:
    """compile=true (inductor) on the GPU: the same features as the eager backbone, manifold mixup included."""
    torch.manual_seed(0)
    compiled = S2M2Module(backbone="conv4", backbone_options={"width": 16}, num_classes=10, stage="s2m2r",
                          compile=True, channels_last=False).to(CUDA)
    eager = S2M2Module(backbone="conv4", backbone_options={"width": 16}, num_classes=10, stage="s2m2r",
                       channels_last=False).to(CUDA)
    eager.load_state_dict(compiled.state_dict())
    compiled.prepare_for_device(CUDA)
    images = torch.randn(16, 3, 32, 32, device=CUDA)
    for layer in compiled.backbone.mix_points:
        mixup = Mixup(layer, 0.3 + 0.1 * layer, torch.randperm(16, device=CUDA))
        torch.testing.assert_close(compiled.backbone(images, mixup), eager.backbone(images, mixup),
                                   rtol=1e-4, atol=1e-4)


def test_train_backbone_job_on_cuda_bf16_mixed(tmp_path: Path) -> None:
    """The whole job on the GPU (digits demo, one epoch): bf16-mixed, channels-last and the CUDA loader
    defaults; the checkpoint loads back on the CPU."""
    results = run_train_backbone(["trainer.accelerator=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed",
                                  "backbone.width=8", "stages=[classifier]", "trainer.max_epochs=1",
                                  "val_episodes.tasks=20", "run_test=false", "logger=none",
                                  "trainer.enable_progress_bar=false", f"checkpoint_dir={tmp_path}"],
                                 log=lambda _: None)
    assert results[0].best_score is not None and 0.0 <= results[0].best_score <= 100.0
    module = load_module(results[0].last)
    assert all(torch.isfinite(t).all() for t in module.state_dict().values() if t.is_floating_point())


def test_feature_extraction_on_cuda_uses_channels_last_and_matches_the_cpu_features() -> None:
    """BackboneFeatures lays a conv backbone out NHWC on CUDA; its features stay those of the CPU's NCHW pass."""
    from lightning_putm.features.extraction import BackboneFeatures
    from lightning_putm.models import build_backbone

    torch.manual_seed(0)
    backbone = build_backbone("conv4", in_channels=1).eval()
    images = torch.rand(16, 1, 28, 28)
    expected = backbone(images).detach()
    module = BackboneFeatures(backbone).to(CUDA)
    module.on_test_start()
    assert next(p for p in module.backbone.parameters() if p.dim() == 4).is_contiguous(
        memory_format=torch.channels_last)
    out = module.test_step((images.to(CUDA), torch.zeros(16), torch.arange(16)), 0)["features"]
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-2, atol=1e-3)  # cuDNN may use TF32
