"""``putm.solver``: which E-step engine runs (:mod:`.engines`, :mod:`.compiled`, :mod:`.triton_engine`). Not part of
the paper."""

from __future__ import annotations

import dataclasses

import torch

from lightning_putm.errors import ConfigError
from lightning_putm.methods.putm.compiled import CompiledTrainer
from lightning_putm.methods.putm.engines import AutogradTrainer, Engine, FusedTrainer
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings


def resolve_solver(solver: str, device: torch.device) -> str:
    """``auto`` → ``compiled`` on CUDA (CUDA graphs, compiled step), ``fused`` elsewhere; others unchanged.

    On CPU ``fused`` stays the default: it is the bit-exact engine and ``compiled`` was not faster on a
    2-core CPU (docs/gpu.md). ``auto`` does not pick ``triton``: on an H100 its first (chunked) kernel was accurate to
    the noise floor but no faster than ``compiled`` (346 tasks/s at T = 10,000, docs/gpu.md), and its default wide
    kernel has not been timed on a GPU yet. ``triton`` where it
    cannot run (no CUDA device, no Triton interpreter) raises :class:`ConfigError`.
    """
    if solver == "triton":
        from lightning_putm.methods.putm.triton_support import unavailable_reason

        reason = unavailable_reason(device)
        if reason is not None:
            raise ConfigError(reason)
    if solver != "auto":
        return solver
    return "compiled" if device.type == "cuda" else "fused"


def make_trainer(navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> Engine:
    """The E-step engine chosen by ``settings.solver`` (``auto`` resolved for the navigator's device)."""
    settings = dataclasses.replace(settings, solver=resolve_solver(settings.solver, navigator.flat.device))
    if settings.solver == "compiled":
        return CompiledTrainer(navigator, settings, compute_dtype)
    if settings.solver == "triton":
        from lightning_putm.methods.putm.triton_engine import TritonTrainer  # imports triton on first use

        return TritonTrainer(navigator, settings, compute_dtype)
    trainer_class = FusedTrainer if settings.solver == "fused" else AutogradTrainer
    return trainer_class(navigator, settings, compute_dtype)
