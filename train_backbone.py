#!/usr/bin/env python
"""Pretrain a backbone with S2M2 (Mangla et al. 2020): rotation, then manifold mixup + rotation (S2M2_R).

Usage: python train_backbone.py [key=value ...]   (defaults: conf/train_backbone.yaml, conf/data/<name>.yaml)
  python train_backbone.py                                        # digits demo, about a minute on a CPU
  python train_backbone.py data=miniimagenet data.root=/data/mini-imagenet trainer.devices=4 trainer.strategy=ddp
  python train_backbone.py data=omniglot data.root=/path/to/omniglot     # stages: classifier (the recipe)
  python train_backbone.py ... resume=true                        # continue from checkpoints/.../last.ckpt
"""

import sys

from lightning_putm.cli import run_cli


def main(argv: list[str]) -> None:
    """Pretrain a backbone with S2M2 (rotation, then manifold mixup + rotation) or a plain classifier; every run
    gets its own checkpoint folder (<checkpoint_dir>/<dataset>/<backbone>/<run>/<stage>/{best,last}.ckpt)."""
    from lightning_putm.pretraining.settings import check_train_arguments

    check_train_arguments(argv)  # config errors before torch and Lightning load
    from lightning_putm.jobs.train import run_train_backbone  # the job loads here: --help needs none of it

    run_train_backbone(argv)


if __name__ == "__main__":
    sys.exit(run_cli(main, job="train_backbone"))
