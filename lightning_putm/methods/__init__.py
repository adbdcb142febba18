"""Few-shot methods behind one interface, and the registry that builds them by name.

Each method is one module; :func:`build_method` maps a config name (``methods=[putm, simpleshot]``) to
its class with the hyper-parameters of ``conf/method/<name>.yaml`` plus command-line overrides. A class's
``Settings`` dataclass (:mod:`~lightning_putm.methods.options`) declares those hyper-parameters once: it checks
them, and ``--help`` and ``tests/test_method_options.py`` read it.

Importing this package imports no torch. The names a config check needs come from :mod:`.catalog` (which methods
exist, each one's settings); the method classes and :func:`build_method` (:mod:`.registry`, which imports every
method and torch) load on first use of their names.
"""

from __future__ import annotations

from typing import Any

from lightning_putm.methods.catalog import available_methods, method_settings

__all__ = ["FewShotMethod", "PUTM", "SimpleShot", "ProtoNet", "PTMAP", "TIMGD", "AlphaTIM", "BDCSPN",
           "LaplacianShot", "BAVARDAGE", "ILPC", "UNEM", "AlphaAM",
           "METHOD_REGISTRY", "METHOD_CLASSES", "available_methods", "build_method", "method_display_name",
           "method_settings", "method_uses_base_covariance", "method_uses_base_mean", "method_uses_class_prior",
           "register_method"]


def __getattr__(name: str) -> Any:
    """The method classes and the registry's names, imported on first use (they import torch)."""
    if name in __all__:
        from lightning_putm.methods import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
