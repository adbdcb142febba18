"""``putm.solver``: which E-step engine runs (:mod:`.engines`, :mod:`.compiled`, :mod:`.triton_engine`). Not part of
the paper."""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

import torch

from lightning_putm.errors import ConfigError
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import ENGINES, PUTMSettings

if TYPE_CHECKING:
    from lightning_putm.methods.putm.engines import Engine


#: CUDA compute capabilities (major) on which ``auto`` picks ``triton``: those a GPU run has shown faster than
#: ``compiled`` and within the noise floor (an H100, sm_90; measured: docs/gpu.md#what-to-expect-measured-on-one-h100).
#: Other GPUs keep ``compiled`` until ``benchmarks/gpu_check.sh`` has measured the kernel there.
TRITON_AUTO_MAJORS = (9,)


def resolve_solver(solver: str, device: torch.device, precision: str = "auto") -> str:
    """``auto`` → ``triton`` on the GPUs of :data:`TRITON_AUTO_MAJORS` (when triton is installed and ``precision``
    is not ``tf32``, the one precision the kernel has not been checked in on a GPU), ``compiled`` on other CUDA
    devices, ``fused`` elsewhere; others unchanged.

    On CPU ``fused`` stays the default: it is the bit-exact engine and ``compiled`` was not faster on a 2-core CPU
    (docs/gpu.md). On an H100 the fused Triton kernel solved 2.6x as many tasks per second as ``compiled`` with
    the same agreement with the fp32 engine (docs/gpu.md); the kernel has not run on other GPU generations.
    ``triton`` where it cannot run (no CUDA device, no Triton interpreter) raises :class:`ConfigError`, and so does
    ``hopper`` off an sm_90 GPU or without NVRTC (:mod:`.hopper.support`). ``auto`` never picks ``hopper``: it has not
    yet run on a GPU.
    """
    from lightning_putm.methods.putm.triton_support import unavailable_reason

    if solver == "triton":
        reason = unavailable_reason(device)
        if reason is not None:
            raise ConfigError(reason)
    if solver == "hopper":  # never chosen by auto: it has not run on a GPU yet
        from lightning_putm.methods.putm.hopper.support import device_reason

        reason = device_reason(device)
        if reason is not None:
            raise ConfigError(reason)
    if solver != "auto":
        return solver
    if device.type != "cuda":
        return "fused"
    if precision != "tf32" and cuda_major(device) in TRITON_AUTO_MAJORS and unavailable_reason(device) is None:
        return "triton"
    return "compiled"


def cuda_major(device: torch.device) -> int | None:
    """The compute capability's major number of a CUDA device, ``None`` where it cannot be read (no driver: a
    CUDA device named on a machine without one, as memory planning does before anything runs)."""
    try:
        return torch.cuda.get_device_capability(device)[0]
    except (RuntimeError, AssertionError):
        return None


def engine_class(solver: str) -> type[Engine]:
    """The engine class of a resolved ``solver`` (not ``auto``: :func:`resolve_solver` first), from
    :data:`.settings.ENGINES`; its module is imported here, on first use (the ``triton`` engine's imports triton)."""
    module, name = ENGINES[solver].rsplit(".", 1)
    return getattr(importlib.import_module(f"lightning_putm.methods.putm.{module}"), name)


def make_engine(navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype,
                engine: type[Engine] | None = None) -> Engine:
    """The E-step engine chosen by ``settings.solver`` (``auto`` resolved for the navigator's device), or of class
    ``engine`` where one is given (``PUTM(engine=...)``: an engine that is no ``solver`` value, such as the Hopper
    kernel's CPU emulation)."""
    if engine is not None:
        return engine.build(navigator, settings, compute_dtype)
    chosen = settings.solver
    settings = dataclasses.replace(settings, solver=resolve_solver(settings.solver, navigator.flat.device,
                                                                   settings.precision))
    return engine_class(settings.solver).build(navigator, settings, compute_dtype, chosen_by_auto=chosen == "auto")
