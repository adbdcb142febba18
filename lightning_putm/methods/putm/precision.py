"""Which arithmetic the navigator products run in (``putm.precision``).

``fp32``: exact float32 products (TF32 off); ``tf32``: TF32 allowed on CUDA (identical to fp32 on CPU);
``bf16``: bfloat16 navigator products on casts of float32 master weights, with float32 Adam and CT loss;
``auto``: bf16 where the hardware multiplies bf16 natively, else fp32. Not part of the paper: a speed
option whose measured accuracy effect is recorded in conf/method/putm.yaml.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from lightning_putm.methods.putm.settings import PRECISIONS


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` → ``bf16`` where bf16 products are native and fast, else ``fp32``; other values unchanged.

    Native: CUDA devices of compute capability 8.0 or newer (bf16 tensor cores), CPUs with AVX512-BF16 or
    AMX. On a 2-core AMD EPYC (Zen 4, AVX512-BF16) bf16 made the solver 1.65x faster at -0.03 accuracy
    points over 1000 tasks (conf/method/putm.yaml); without native support bf16 would be emulated (slow).
    """
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp32"
    if device.type == "cpu":
        native = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        return "bf16" if any(check is not None and check() for check in native) else "fp32"
    return "fp32"


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the navigator products for a resolved precision."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


@contextlib.contextmanager
def matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    """float32 products exact (``fp32``, and ``tf32`` off CUDA) or TF32 on CUDA (``tf32``), restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" and device.type == "cuda" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
