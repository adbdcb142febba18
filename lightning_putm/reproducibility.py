"""MKL's conditional numerical reproducibility mode, requested when the package is imported.

Without it MKL (torch's CPU linear algebra) may choose its kernels by a matrix's memory alignment, so a task's
result would depend on where the task sits in a batch: on one CPU ``torch.linalg.inv`` (α-AM's propagator) and
UNEM's small batched products rounded differently alone and in a batch, and α-AM's Adam steps turned that into other
predictions (measured: docs/lab/code-notes.md#mkls-reproducibility-mode, docs/evaluation.md). MKL reads
``MKL_CBWR`` at its first computation, so importing this package before torch computes anything is enough; when
torch has computed already, the mode can no longer change, and the import says so once.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

#: The mode asked for: MKL's fastest code path for this CPU, with results that do not depend on alignment
MKL_REPRODUCIBILITY = "AUTO,STRICT"
#: ``MKL_CBWR_AUTO | MKL_CBWR_STRICT`` and ``MKL_CBWR_ALL``, as MKL's ``mkl_cbwr.h`` defines them
_AUTO_STRICT, _ALL = 0x2 | 0x10000, ~0
#: The library of torch's CPU operators, which carries MKL linked in, by platform
_TORCH_CPU_LIBRARY = {"linux": "libtorch_cpu.so", "darwin": "libtorch_cpu.dylib", "win32": "torch_cpu.dll"}


class MKLReproducibilityWarning(RuntimeWarning):
    """torch computed with MKL before the package was imported, so MKL runs without its reproducibility mode."""


def mkl_mode_reader() -> Callable[[], int] | None:
    """A function returning MKL's mode in effect (``mkl_cbwr_get(MKL_CBWR_ALL)``), or ``None`` where it cannot be
    read: torch not imported yet, torch without MKL, or an MKL that does not export the function."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.backends.mkl.is_available():
        return None
    library = Path(torch.__file__).parent / "lib" / _TORCH_CPU_LIBRARY.get(sys.platform, "libtorch_cpu.so")
    try:
        get = ctypes.CDLL(str(library)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return lambda: int(get(_ALL))


def request_mkl_reproducibility() -> None:
    """Set ``MKL_CBWR`` unless the environment names a mode; warn once if torch already used MKL without it."""
    if "MKL_CBWR" in os.environ:
        return  # the user's choice (or a parent process's), which MKL reads
    os.environ["MKL_CBWR"] = MKL_REPRODUCIBILITY
    read = mkl_mode_reader()
    if read is not None and read() != _AUTO_STRICT:  # reading initialises MKL's mode from the variable if unused
        warnings.warn(
            "torch computed with MKL before lightning_putm was imported, so MKL runs without its reproducibility "
            "mode in this process: a task's result can then depend in its last bits on the batch it was solved in "
            "(on some CPUs, α-AM's and UNEM's). Import lightning_putm before computing with torch, or set "
            f"MKL_CBWR={MKL_REPRODUCIBILITY} in the environment.", MKLReproducibilityWarning, stacklevel=2)
