"""Few-shot methods behind one interface, and the registry that builds them by name.

Each method is one module; :func:`build_method` maps a config name (``methods=[putm, simpleshot]``) to
its class with the hyper-parameters of ``conf/method/<name>.yaml`` plus command-line overrides.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.putm import PUTM
from lightning_putm.methods.simpleshot import SimpleShot

#: name → factory(params, context) ; context holds shots, balanced, base_mean, show_progress, memory budget.
METHOD_REGISTRY: dict[str, Callable[..., FewShotMethod]] = {}


def register_method(name: str) -> Callable[[Callable[..., FewShotMethod]], Callable[..., FewShotMethod]]:
    def decorator(factory: Callable[..., FewShotMethod]) -> Callable[..., FewShotMethod]:
        METHOD_REGISTRY[name] = factory
        return factory

    return decorator


@register_method("putm")
def _build_putm(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return PUTM(shots=context["shots"], balanced=context["balanced"], show_progress=context.get("show_progress", False),
                **params)


@register_method("simpleshot")
def _build_simpleshot(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return SimpleShot(base_mean=context.get("base_mean"), show_progress=context.get("show_progress", False), **params)


def available_methods() -> list[str]:
    return sorted(METHOD_REGISTRY)


def build_method(name: str, params: dict[str, Any] | None = None, **context: Any) -> FewShotMethod:
    """Build method ``name`` with hyper-parameters ``params`` for one evaluation setting ``context``."""
    if name not in METHOD_REGISTRY:
        raise ConfigError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    try:
        return METHOD_REGISTRY[name](dict(params or {}), context)
    except TypeError as exc:
        raise ConfigError(f"method {name!r}: {exc}") from exc


__all__ = ["FewShotMethod", "PUTM", "SimpleShot", "METHOD_REGISTRY", "available_methods", "build_method",
           "register_method"]
