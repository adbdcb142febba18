#!/usr/bin/env python
"""Acceptance benchmark: a Conv-4 pretrained on real Omniglot with the S2M2 module, scored by nearest class mean.

Protocol (Vinyals et al. 2016; Snell et al. 2017): the 1200 training characters of the Vinyals split,
each rotation 0/90/180/270° a class (4800 classes), 28×28 images. Pretraining runs through the library's own
path (``lightning_putm.jobs.train.run_train_backbone``, the code behind ``train_backbone.py``), by default the
``classifier`` stage: a cosine classifier over the 4800 classes, Adam lr 1e-3 with cosine decay. The rotation
stages do not fit this protocol: rotated copies are separate classes here, so a rotation label would contradict
the class label. Evaluation: the 423 test characters × 4 rotations (1692 classes), 1000 balanced tasks per
setting drawn by the seeded episode bank, 15 queries per class (ProtoNets' test protocol; 20 images per
character leave at most 19 after one shot), nearest class mean on the backbone features, Euclidean (ProtoNets'
rule) and on L2-normalised features. The headline is 5-way 1-shot.

Usage (from the repository root; ``--root`` is the folder holding omniglot-py/):
    python benchmarks/omniglot_conv4.py --root /path/to/omniglot   # the acceptance run (train ≤ 27 min, then evaluate)
    python benchmarks/omniglot_conv4.py --root /path/to/omniglot --epochs 1 --max-minutes 4 --tasks 200    # a short sanity run
Extra ``key=value`` arguments are passed to train_backbone (e.g. ``data.batch_size=256 trainer.precision=bf16-mixed``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import torch

from lightning_putm.data import FewShotDataModule, sample_episode_bank
from lightning_putm.jobs.train import run_train_backbone
from lightning_putm.metrics import mean_and_ci95
from lightning_putm.pretraining.checkpoints import load_backbone
from lightning_putm.pretraining.module import ncm_task_accuracy

SETTINGS = [(5, 1), (5, 5), (20, 1), (20, 5)]  # (ways, shots); 5-way 1-shot is the acceptance number


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="folder holding omniglot-py/ (e.g. /path/to/omniglot)")
    parser.add_argument("--stage", default="classifier", choices=["classifier", "rotation", "s2m2r"])
    parser.add_argument("--epochs", type=int, default=13, help="training epochs (cosine lr decay over them)")
    parser.add_argument("--max-minutes", type=float, default=27.0,
                        help="hard cap on training time (Trainer max_time); data loading and evaluation come on top")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per setting")
    parser.add_argument("--queries-per-class", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the target machine has 2 cores)")
    parser.add_argument("--checkpoint-dir", default=str(REPO / "checkpoints"))
    parser.add_argument("--skip-training", action="store_true", help="only evaluate the existing last.ckpt")
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> int:
    args, extra = parse_args(argv)
    torch.set_num_threads(args.threads)
    root = Path(args.root)
    if not (root / "omniglot-py").is_dir():
        print(f"error: no Omniglot at {root} (expected {root / 'omniglot-py'}); pass --root", file=sys.stderr)
        return 2
    overrides = [
        "data=omniglot", f"data.root={root}", f"stages=[{args.stage}]", f"trainer.max_epochs={args.epochs}",
        f"trainer.max_time={{minutes: {args.max_minutes}}}", f"data.batch_size={args.batch_size}", f"lr={args.lr}",
        "scheduler=cosine", f"seed={args.seed}", f"checkpoint_dir={args.checkpoint_dir}", "run_test=false",
        "logger=csv", "trainer.accelerator=cpu", "trainer.devices=1", "data.options.scheme=vinyals", *extra,
    ]
    start = time.perf_counter()
    checkpoint = Path(args.checkpoint_dir) / "omniglot" / "conv4" / "latest" / args.stage / "last.ckpt"
    train_seconds = 0.0
    if not args.skip_training:
        print("train_backbone overrides: " + " ".join(overrides), flush=True)
        results = run_train_backbone(overrides, log=lambda text: print(text, flush=True))
        train_seconds = sum(r.seconds for r in results)
        checkpoint = results[-1].last
    # The stopping epoch and step, from the checkpoint itself (max_time may stop early).
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    epoch, step = int(payload["epoch"]), int(payload["global_step"])

    eval_start = time.perf_counter()
    datamodule = FewShotDataModule("omniglot", root=root, image_size=28, eval_batch_size=1024,
                                   options={"scheme": "vinyals", "rotations": [0, 90, 180, 270], "image_size": 28})
    test = datamodule.split("test")
    backbone = load_backbone(checkpoint)
    features = []
    with torch.no_grad():
        for images, _, _ in datamodule.test_dataloader():
            features.append(backbone(images))
    features = torch.cat(features)
    rows = []
    for ways, shots in SETTINGS:
        bank = sample_episode_bank(test.labels, ways, shots, ways * args.queries_per_class, None, args.tasks,
                                   args.seed, class_names=test.class_names)
        for normalise in ("none", "l2"):
            mean, ci = mean_and_ci95(ncm_task_accuracy(features, bank, normalise))
            rows.append((f"{ways}-way {shots}-shot", "Euclidean" if normalise == "none" else "L2-normalised",
                         f"{100 * mean:.2f} ± {100 * ci:.2f}"))
    eval_seconds = time.perf_counter() - eval_start
    total = time.perf_counter() - start

    print()
    print(f"Omniglot (Vinyals split), Conv-4 pretrained with stage `{args.stage}`, checkpoint {checkpoint}")
    print(f"training ended in epoch {epoch + 1} at step {step}; {args.tasks} balanced tasks per setting, "
          f"{args.queries_per_class} queries per class, {test.num_classes} test classes; torch threads: "
          f"{torch.get_num_threads()}, CPUs visible: {os.cpu_count()}")
    widths = (16, 14, 16)
    print("  ".join(h.ljust(w) for h, w in zip(("setting", "NCM features", "acc. % ± 95% CI"), widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(f"time: training {train_seconds / 60:.1f} min, evaluation {eval_seconds / 60:.1f} min, "
          f"total wall {total / 60:.1f} min")
    planned = args.epochs * (96000 // args.batch_size)  # 1200 characters x 4 rotations x 20 drawings
    if not args.skip_training and step < planned:
        print(f"NOTE: the {args.max_minutes:g}-minute cap stopped training at step {step} of {planned} "
              f"({100 * step / planned:.0f}%), before the learning rate had decayed: the CPU was slower than "
              "planned (busy machine?). Rerun on an idle machine, or lower --epochs.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
