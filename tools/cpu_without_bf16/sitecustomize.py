"""Make this machine look like a CPU without native bf16 to every Python process started with this folder on
``PYTHONPATH`` (tests' child processes included): ``torch.cpu``'s AVX512-BF16 and AMX checks answer ``False``, so
``method.putm.precision=auto`` resolves to ``fp32`` as on an AVX2-only CPU.

    PYTHONPATH=tools/cpu_without_bf16 ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 WANDB_MODE=offline python -m pytest

A development aid for docs/development.md's cross-CPU runs; nothing in the package imports it. torch is not
imported here: the checks are replaced when ``torch.cpu`` is first imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _NoNativeBf16(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            execute(module)
            module._is_avx512_bf16_supported = lambda: False
            module._is_amx_tile_supported = lambda: False

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _NoNativeBf16())
