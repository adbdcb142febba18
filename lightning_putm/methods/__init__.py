"""Few-shot methods behind one interface, and the registry that builds them by name.

Each method is one module whose class registers itself (``@register_method("ptmap")``, :mod:`.registry`);
:func:`build_method` maps a config name (``methods=[putm, simpleshot]``) to its class with the hyper-parameters
given by ``method.<name>.*``. A class's ``Settings`` dataclass (:mod:`~lightning_putm.methods.options`) declares
those hyper-parameters once: it checks them, and ``--help`` and ``tests/test_method_options.py`` read it.

Importing this package imports no torch. The names a config check needs come from :mod:`.catalog` (which methods
exist, each one's settings); the method classes load (with torch) on first use of their names.
"""

from __future__ import annotations

from typing import Any

from lightning_putm.methods.catalog import available_methods, method_settings
from lightning_putm.methods.registry import (build_method, import_plugins, load_methods,
                                             method_display_name, method_order, method_uses_base_covariance,
                                             method_uses_base_mean, method_uses_class_prior, register_method)

__all__ = ["FewShotMethod", "METHOD_CLASSES", "available_methods", "build_method", "import_plugins", "load_methods",
           "method_display_name", "method_order", "method_settings", "method_uses_base_covariance",
           "method_uses_base_mean", "method_uses_class_prior", "register_method"]


def __getattr__(name: str) -> Any:
    """``METHOD_CLASSES`` (name → class), ``FewShotMethod`` and every registered method class by its class name
    (``PUTM``, ``AlphaTIM``), imported on first use (they import torch)."""
    if name == "METHOD_CLASSES":  # every registered class: the package's modules load first
        return load_methods()
    if name == "FewShotMethod":
        from lightning_putm.methods.base import FewShotMethod

        return FewShotMethod
    if name[:1].isupper():
        found = {cls.__name__: cls for cls in load_methods().values()}
        if name in found:
            return found[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
