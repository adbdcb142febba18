"""Import a script of ``benchmarks/`` or ``tools/`` in a test, the way the benchmarks import reference code.

The benchmark scripts and development tools are not part of the installed package; run as ``python
benchmarks/x.py`` they import each other by top-level name (Python puts the script's folder first on its path). A
test gets the same through :func:`lightning_putm.studies.reference.import_from_checkout`, without editing the import
path.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from lightning_putm.studies.reference import import_from_checkout

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TOOLS = BENCHMARKS.parent / "tools"


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (its imports of sibling scripts resolve in ``benchmarks/``)."""
    return import_from_checkout(BENCHMARKS, name, flag="benchmark")


def tool_module(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module."""
    return import_from_checkout(TOOLS, name, flag="tool")
