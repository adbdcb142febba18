"""Where ``solver=triton`` can run: a CUDA device, or CPU tensors under Triton's interpreter. Not part of the paper.

Kept apart from :mod:`.triton_engine` (which needs the engines) so that settings validation can ask without an
import cycle; triton itself is imported only when asked.
"""

from __future__ import annotations

import torch


def interpreter_requested() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``); ``False`` without triton."""
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)


def unavailable_reason(device: torch.device | None) -> str | None:
    """Why ``solver=triton`` cannot run on ``device`` (``None``: on this machine at all), or ``None`` if it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return ("method.putm.solver=triton needs the triton package (it ships with torch's CUDA wheels); "
                "use solver=auto")
    on_cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    if on_cuda or (interpreter_requested() and (device is None or device.type == "cpu")):
        return None
    where = "this machine has no CUDA device" if device is None else f"this run is on {device.type}"
    return (f"method.putm.solver=triton needs a CUDA device ({where}); use solver=auto, or set TRITON_INTERPRET=1 "
            "to run the kernel on CPU in Triton's interpreter (slow: for tests)")
