"""The ``--triton-*`` command-line flags that choose the fused kernel's launch (``solver=triton``).

Shared by ``bench_putm.py`` (speed) and ``crosscheck_putm.py`` (accuracy), so that a launch timed by the GPU
check's sweep is checked against the noise floor with the very same flags. They set PUTMSettings' ``triton_warps``
and ``triton_stages``, which no config sets: a benchmark builds its PUTM from :func:`putm_settings`."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

#: ``--triton-*`` flags and the PUTMSettings field each sets (``solver=triton`` only).
TRITON_FLAGS = {"--triton-warps": "triton_warps", "--triton-stages": "triton_stages"}


def add_triton_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of :data:`TRITON_FLAGS` to ``parser``; each defaults to ``None`` (the settings' default)."""
    parser.add_argument("--triton-warps", type=int, default=None,
                        help="solver=triton: warps per kernel program (a power of two; default: 8)")
    parser.add_argument("--triton-stages", type=int, default=None,
                        help="solver=triton: software pipelining of the loops over pair tiles (2 or more: the next "
                             "tiles' loads overlap the current tile's products; default: 3)")


def triton_flag_values(args: argparse.Namespace) -> list[tuple[str, object]]:
    """``(flag, value)`` for every flag of :data:`TRITON_FLAGS`, ``None`` where it was not given."""
    return [(flag, getattr(args, flag[2:].replace("-", "_"))) for flag in TRITON_FLAGS]


def putm_settings(options: Mapping[str, Any], args: argparse.Namespace):
    """PUTMSettings from config ``options`` (``method.putm.*`` keys) and the launch the ``--triton-*`` flags
    name (unset flags keep the defaults); for ``PUTM(settings, shots=..., balanced=...)``."""
    from lightning_putm.methods.putm import PUTMSettings

    launch = {TRITON_FLAGS[flag]: value for flag, value in triton_flag_values(args) if value is not None}
    return PUTMSettings.from_mapping(options).replace(**launch)


def check_triton_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop with one line when a ``--triton-*`` flag is given without ``--solver triton`` (it would be ignored,
    and the run would be mistaken for one of that launch)."""
    given = [flag for flag, value in triton_flag_values(args) if value is not None]
    if given and args.solver != "triton":
        parser.error(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to --solver triton (got "
                     f"--solver {args.solver}); add --solver triton or drop them")
