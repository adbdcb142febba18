"""The ``--triton-*`` command-line flags that choose the fused kernel's configuration (``solver=triton``).

Shared by ``bench_putm.py`` (speed) and ``crosscheck_putm.py`` (accuracy), so that a configuration timed by the
GPU check's kernel sweep is checked against the noise floor with the very same flags."""

from __future__ import annotations

import argparse
import dataclasses

#: ``--triton-*`` flags and the :class:`KernelConfig` field each sets (``solver=triton`` only).
TRITON_FLAGS = {"--triton-kernel": "kernel", "--triton-block-p": "block_p", "--triton-block-k": "block_k",
                "--triton-warps": "num_warps", "--triton-programs": "programs", "--triton-adam": "exact_adam",
                "--triton-max-registers": "max_registers", "--triton-stages": "num_stages",
                "--triton-scratch": "scratch"}


def add_triton_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of :data:`TRITON_FLAGS` to ``parser``; each defaults to ``None`` (the kernel's default)."""
    parser.add_argument("--triton-kernel", default=None, choices=["wide", "chunked"],
                        help="solver=triton: which kernel (default: wide)")
    parser.add_argument("--triton-block-p", type=int, default=None, help="solver=triton: pairs per tile")
    parser.add_argument("--triton-block-k", type=int, default=None,
                        help="solver=triton: input columns per chunk (chunked kernel)")
    parser.add_argument("--triton-adam", default=None, choices=["exact", "fast"],
                        help="solver=triton: Adam's square root and divisions correctly rounded (default) or by the "
                             "GPU's approximate instructions (wide kernel)")
    parser.add_argument("--triton-warps", type=int, default=None, help="solver=triton: warps per program")
    parser.add_argument("--triton-programs", type=int, default=None,
                        help="solver=triton: programs per launch (default: one per task)")
    parser.add_argument("--triton-max-registers", type=int, default=None,
                        help="solver=triton: cap on registers per thread (128: two 8-warp programs per SM, with "
                             "spills; default: no cap)")
    parser.add_argument("--triton-stages", type=int, default=None,
                        help="solver=triton: software pipelining of the loops over pair tiles (2 or more: the next "
                             "tiles' loads overlap the current tile's products; default: 3 for the wide kernel, 1 "
                             "for the chunked)")
    parser.add_argument("--triton-scratch", default=None, choices=["full", "lean"],
                        help="solver=triton: what the wide kernel keeps in global memory between an Adam step's "
                             "phases (full: inputs, activations, fp32 weight gradients; lean: activations computed "
                             "again in the backward, weight gradients in the compute dtype; default: full)")


def triton_flag_values(args: argparse.Namespace) -> list[tuple[str, object]]:
    """``(flag, value)`` for every flag of :data:`TRITON_FLAGS`, ``None`` where it was not given."""
    return [(flag, getattr(args, flag[2:].replace("-", "_"))) for flag in TRITON_FLAGS]


def use_triton_config(args: argparse.Namespace) -> None:
    """The kernel's configuration from the ``--triton-*`` flags (unset flags keep the default)."""
    from lightning_putm.methods.putm import triton_engine

    changes = {TRITON_FLAGS[flag]: value for flag, value in triton_flag_values(args) if value is not None}
    if "exact_adam" in changes:
        changes["exact_adam"] = changes["exact_adam"] == "exact"
    if changes:
        triton_engine.DEFAULT_CONFIG = dataclasses.replace(triton_engine.DEFAULT_CONFIG, **changes)


def check_triton_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop with one line when a ``--triton-*`` flag is given without ``--solver triton`` (it would be ignored,
    and the run would be mistaken for one of that configuration)."""
    given = [flag for flag, value in triton_flag_values(args) if value is not None]
    if given and args.solver != "triton":
        parser.error(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to --solver triton (got --solver {args.solver}); add "
                     "--solver triton or drop them")
