"""Where ``solver=hopper`` can run, asked before any work: each answer is one line naming ``method.putm.solver=hopper``
and the fix, or ``None``. Not part of the paper.

The kernel (:mod:`.build`'s ``e_step.cu``) is built for sm_90a only (H100, H200), computes the navigator's products
in bf16 only, has the paper's navigator widths 128 → 64 → 1 built in, and takes the task shapes of
:meth:`.layout.Layout.unsupported`. Kept apart from the engines so that settings validation
(:meth:`..settings.PUTMSettings.resolve`) can ask without importing them.
"""

from __future__ import annotations

import torch

from lightning_putm.methods.putm.hopper import build
from lightning_putm.methods.putm.hopper.layout import H1, H2, Layout

KEY = "method.putm.solver=hopper"
#: The one compute capability the kernel is built for (sm_90a: H100, H200).
CAPABILITY = (9, 0)
#: ``precision`` values it honours: its products are bf16 whatever is asked.
PRECISIONS = ("auto", "bf16")
FIX = "use solver=auto"


def settings_reason(hidden: tuple[int, ...], precision: str) -> str | None:
    """Why options ``hidden``/``precision`` cannot run on the kernel, or ``None``."""
    if tuple(hidden) != (H1, H2):
        return f"{KEY} has the navigator widths [{H1}, {H2}] built in, got hidden={list(hidden)}; {FIX}"
    if precision not in PRECISIONS:
        return (f"{KEY} computes the navigator's products in bf16 only, got precision={precision}; use "
                "precision=auto or bf16 (or solver=auto)")
    return None


def device_reason(device: torch.device | None) -> str | None:
    """Why the kernel cannot run on ``device`` (``None``: this machine's current CUDA device), or ``None``: a CUDA
    device of capability 9.0, NVRTC to build the kernel, and a driver at least as new as that NVRTC (a cubin
    from a newer compiler does not load)."""
    if device is not None and device.type != "cuda":
        return f"{KEY} needs an H100/H200 GPU (sm_90; this run is on {device.type}); {FIX}"
    if not torch.cuda.is_available():
        return f"{KEY} needs an H100/H200 GPU (sm_90; this machine has no CUDA device); {FIX}"
    try:
        capability = tuple(torch.cuda.get_device_capability(device))
    except (RuntimeError, AssertionError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return f"{KEY} cannot read the GPU's compute capability ({first}); {FIX}"
    if capability != CAPABILITY:
        return (f"{KEY} needs an H100/H200 GPU (sm_90), this GPU is sm_{capability[0]}{capability[1]}; {FIX} "
                "(the kernel is built for sm_90a only)")
    try:
        build.nvrtc()
    except build.ToolchainMissing as missing:
        text = str(missing).splitlines()[0].removeprefix("putm hopper kernel: ")
        return f"{KEY} cannot build its kernel: {text}; or {FIX}"
    try:
        supported, compiler = build.driver_version(), build.nvrtc_version()
    except build.ToolchainMissing as error:
        return f"{KEY} cannot ask the CUDA driver its version ({str(error).splitlines()[0]}); {FIX}"
    if supported < compiler:
        have, need = ".".join(map(str, supported)), ".".join(map(str, compiler))
        return (f"{KEY} builds its kernel with NVRTC {need}, which this CUDA driver (CUDA {have}) cannot load; "
                f"update the driver, or install the NVRTC of CUDA {have} (pip's nvidia-cuda-nvrtc of that "
                f"version), or {FIX}")
    return None


def shape_reason(queries: int, ways: int, dim: int) -> str | None:
    """Why the kernel cannot take tasks of ``queries`` × ``ways`` pairs in a basis of ``dim`` columns, or ``None``."""
    reason = Layout(queries, ways, dim).unsupported()
    if reason is None:
        return None
    return f"{KEY} cannot take these tasks: {reason}; {FIX} (or solver=fused)"
