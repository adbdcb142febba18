#!/usr/bin/env python
"""Pretrain a backbone with S2M2 (rotation, then manifold mixup). Not available yet."""

import sys

from lightning_putm.cli import run_cli
from lightning_putm.errors import ConfigError


def main(argv: list[str]) -> None:
    """Pretrain a backbone with S2M2. Not available yet."""
    raise ConfigError(
        "backbone pretraining (S2M2) is not implemented yet; evaluate pre-extracted features with "
        "`python evaluate.py features=PATH` meanwhile"
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
