#!/usr/bin/env python
"""Training throughput of S2M2 pretraining (images/s), with the real S2M2Module training step in a Lightning Trainer.

Synthetic images (``--image-size``², 3 channels, default 84) and labels (64 classes) are prepared once as whole
batches (pinned on CUDA), so the number measures the training step — forward, losses, backward and the Adam
step through Lightning's precision plugin — and not image decoding. ``--warmup`` steps run first (cuDNN
autotuning, torch.compile), then ``--steps`` steps are timed between two CUDA synchronisations.

    python benchmarks/bench_pretrain.py                                   # WRN-28-10, s2m2r, fp32, current device
    python benchmarks/bench_pretrain.py --precision bf16-mixed --channels-last --compile
    python benchmarks/bench_pretrain.py --device cpu --backbone conv4 --image-size 16 --steps 3   # a quick check

Images/s counts the batch's input images. One ``s2m2r`` step (manifold mixup + rotation, Mangla et al. 2020)
runs the backbone on ``B`` mixed images and on a quarter of the batch in 4 rotations (``B`` more); a
``rotation`` step runs it on ``4B``; a ``classifier`` step on ``B``: "backbone passes/s" counts those. TFLOP/s
is passes/s times the backbone's forward + backward FLOPs for one image, counted by
``torch.utils.flop_counter`` on the meta device (WRN-28-10 at 84×84: ≈ 72 GFLOP forward, ≈ 217 GFLOP forward +
backward; the heads are negligible) — compare it with the GPU's dense bf16/tf32 peak. The last column is
``torch.cuda.max_memory_allocated`` (``-`` on CPU). One markdown table row per run (``--no-header``: the row alone,
for appending to a table).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch


import pytorch_lightning as pl

from lightning_putm.pretraining.module import S2M2Module

HEADER = ("| backbone | stage | device | precision | channels-last | compile | batch | image | timed steps | "
          "s/step | images/s | backbone passes/s | TFLOP/s | peak memory (GiB) |")
RULE = "|" + "---|" * HEADER.count(" |")


class BatchPool(torch.utils.data.Dataset):
    """``length`` ready-made batches cycling through a few distinct random ones (no collation per step)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[index % len(self.batches)]


class StepTimer(pl.Callback):
    """Wall time of the training steps after the warm-up, between two device synchronisations."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.start = self.stop = None

    @staticmethod
    def _sync(module: pl.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            self._sync(module)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.warmup + self.steps - 1:
            self._sync(module)
            self.stop = time.perf_counter()


def synthetic_batches(batch_size: int, image_size: int, classes: int, count: int, pin: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
        labels = torch.randint(classes, (batch_size,), generator=generator)
        batches.append((images.pin_memory(), labels.pin_memory()) if pin else (images, labels))
    return batches


def passes_per_step(stage: str, batch_size: int) -> int:
    """Images the backbone runs forward and backward in one training step of ``stage`` (see the module doc)."""
    if stage == "s2m2r":
        return batch_size + 4 * max(1, batch_size // 4)
    return 4 * batch_size if stage == "rotation" else batch_size


def flops_per_pass(backbone: str, image_size: int) -> float | None:
    """Forward + backward FLOPs of the backbone for one image (counted on the meta device: no arithmetic)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_putm.models import build_backbone

    try:
        with torch.device("meta"):
            network = build_backbone(backbone, in_channels=3)
            images = torch.zeros(1, 3, image_size, image_size)
        with FlopCounterMode(display=False) as counter:
            network(images).sum().backward()
        return float(counter.get_total_flops())
    except (RuntimeError, NotImplementedError, TypeError):  # an operation without a meta kernel or FLOP formula
        return None


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        raise SystemExit("bench_pretrain: --device cuda but torch sees no CUDA device")
    total = args.warmup + args.steps
    batches = synthetic_batches(args.batch_size, args.image_size, args.classes, min(total, 4), pin=on_cuda)
    loader = torch.utils.data.DataLoader(BatchPool(batches, total), batch_size=None, shuffle=False)
    pl.seed_everything(0, verbose=False)
    module = S2M2Module(backbone=args.backbone, in_channels=3, num_classes=args.classes, stage=args.stage,
                        channels_last=args.channels_last, compile=args.compile)
    timer = StepTimer(args.warmup, args.steps)
    trainer = pl.Trainer(accelerator="gpu" if on_cuda else "cpu", devices=[device.index or 0] if on_cuda else 1,
                         precision=args.precision, max_steps=total, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, benchmark=True if on_cuda else None, callbacks=[timer])
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(module, train_dataloaders=loader)
    if timer.start is None or timer.stop is None:
        raise SystemExit("bench_pretrain: the timed steps did not run (check --warmup and --steps)")
    seconds = timer.stop - timer.start
    passes = passes_per_step(args.stage, args.batch_size) * args.steps / seconds
    flops = flops_per_pass(args.backbone, args.image_size)
    return {
        "seconds_per_step": seconds / args.steps,
        "images_per_second": args.batch_size * args.steps / seconds,
        "passes_per_second": passes,
        "tflops": None if flops is None else passes * flops / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_cuda else None,
        "device_name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
    }


def rate(value: float) -> str:
    """One decimal for rates of 10 and more, three significant digits below (a CPU check runs < 1 image/s)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument("--channels-last", action="store_true", help="NHWC weights and inputs (channels_last=true)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the backbone (compile=true)")
    parser.add_argument("--backbone", default="wrn28_10", help="wrn28_10 | resnet12 | resnet18 | conv4")
    parser.add_argument("--stage", default="s2m2r", choices=["s2m2r", "rotation", "classifier"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=84)
    parser.add_argument("--classes", type=int, default=64, help="miniImageNet's 64 base classes")
    parser.add_argument("--steps", type=int, default=30, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (autotuning, compilation)")
    parser.add_argument("--no-header", action="store_true", help="print the table row only")
    parser.add_argument("--header-only", action="store_true", help="print the table header and stop")
    args = parser.parse_args(argv)
    for key in ("batch_size", "image_size", "classes", "steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.header_only:
        print(HEADER)
        print(RULE)
        return
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|isinstance\(treespec|no `val_dataloader`).*")
    result = run(args)
    if not args.no_header:
        print(f"device: {result['device_name']}; torch {torch.__version__}; {args.warmup} warm-up steps")
        print(HEADER)
        print(RULE)
    memory = "-" if result["peak_gib"] is None else f"{result['peak_gib']:.1f}"
    tflops = "-" if result["tflops"] is None else f"{result['tflops']:.3g}"
    print(f"| {args.backbone} | {args.stage} | {torch.device(args.device).type} | {args.precision} | "
          f"{'yes' if args.channels_last else 'no'} | {'yes' if args.compile else 'no'} | {args.batch_size} | "
          f"{args.image_size} | {args.steps} | {result['seconds_per_step']:.4g} | {rate(result['images_per_second'])} | "
          f"{rate(result['passes_per_second'])} | {tflops} | {memory} |")


if __name__ == "__main__":
    main()
