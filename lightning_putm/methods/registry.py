"""The registry that builds a method by name, and every method class (this module imports them all, and torch).

:func:`build_method` maps a config name (``methods=[putm, simpleshot]``) to its class with the hyper-parameters
of ``conf/method/<name>.yaml`` plus command-line overrides. Which names exist, and each one's settings, are known
without this module (:mod:`~lightning_putm.methods.catalog`); ``lightning_putm.methods`` loads it on first use of a
name below.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_putm.errors import ConfigError
from lightning_putm.methods.alpha_am import AlphaAM
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.bavardage import BAVARDAGE
from lightning_putm.methods.bdcspn import BDCSPN
from lightning_putm.methods.catalog import METHOD_SETTINGS, available_methods, options_error
from lightning_putm.methods.ilpc import ILPC
from lightning_putm.methods.laplacianshot import LaplacianShot
from lightning_putm.methods.protonet import ProtoNet
from lightning_putm.methods.ptmap import PTMAP
from lightning_putm.methods.putm import PUTM
from lightning_putm.methods.simpleshot import SimpleShot
from lightning_putm.methods.tim import TIMGD, AlphaTIM
from lightning_putm.methods.unem import UNEM
from lightning_putm.validators import did_you_mean

#: name → factory(params, context). The context holds shots, balanced, show_progress, memory_budget_mb,
#: base_mean (a ``[d]`` base-class feature mean, or None) and query_counts (the true ``[T, N]`` query counts,
#: given ONLY under the explicit oracle_prior switch, and passed on only to methods with a class prior).
METHOD_REGISTRY: dict[str, Callable[..., FewShotMethod]] = {}
#: name → method class, so callers can read class flags (uses_base_mean, uses_class_prior) without building.
METHOD_CLASSES: dict[str, type[FewShotMethod]] = {}


def register_method(
    name: str, method_class: type[FewShotMethod] | None = None
) -> Callable[[Callable[..., FewShotMethod]], Callable[..., FewShotMethod]]:
    def decorator(factory: Callable[..., FewShotMethod]) -> Callable[..., FewShotMethod]:
        METHOD_REGISTRY[name] = factory
        if method_class is not None:
            METHOD_CLASSES[name] = method_class
        METHOD_SETTINGS[name] = getattr(method_class, "Settings", None)  # a config may name it now
        return factory

    return decorator


def _common(context: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments every method takes from the evaluation context."""
    common: dict[str, Any] = {"show_progress": context.get("show_progress", False)}
    if context.get("memory_budget_mb") is not None:
        common["memory_budget_mb"] = context["memory_budget_mb"]
    return common


@register_method("putm", PUTM)
def _build_putm(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return PUTM(shots=context["shots"], balanced=context["balanced"], **_common(context), **params)


@register_method("simpleshot", SimpleShot)
def _build_simpleshot(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return SimpleShot(base_mean=context.get("base_mean"), **_common(context), **params)


@register_method("protonet", ProtoNet)
def _build_protonet(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return ProtoNet(**_common(context), **params)


@register_method("ptmap", PTMAP)
def _build_ptmap(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return PTMAP(query_counts=context.get("query_counts"), **_common(context), **params)


@register_method("tim", TIMGD)
def _build_tim(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return TIMGD(balanced=context["balanced"], **_common(context), **params)


@register_method("alpha_tim", AlphaTIM)
def _build_alpha_tim(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return AlphaTIM(shots=context["shots"], **_common(context), **params)


@register_method("bdcspn", BDCSPN)
def _build_bdcspn(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return BDCSPN(base_mean=context.get("base_mean"), **_common(context), **params)


@register_method("laplacianshot", LaplacianShot)
def _build_laplacianshot(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return LaplacianShot(shots=context["shots"], balanced=context["balanced"], base_mean=context.get("base_mean"),
                         **_common(context), **params)


@register_method("ilpc", ILPC)
def _build_ilpc(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return ILPC(balanced=context["balanced"], query_counts=context.get("query_counts"), **_common(context), **params)


@register_method("bavardage", BAVARDAGE)
def _build_bavardage(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return BAVARDAGE(shots=context["shots"], balanced=context["balanced"], base_mean=context.get("base_mean"),
                     base_covariance=context.get("base_covariance"), query_counts=context.get("query_counts"),
                     **_common(context), **params)


@register_method("alpha_am", AlphaAM)
def _build_alpha_am(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return AlphaAM(shots=context["shots"], **_common(context), **params)


@register_method("unem", UNEM)
def _build_unem(params: dict[str, Any], context: dict[str, Any]) -> FewShotMethod:
    return UNEM(shots=context["shots"], **_common(context), **params)


def method_uses_base_mean(name: str) -> bool:
    """Whether method ``name`` normalises with a base-class mean (CL2N) when one is given."""
    cls = METHOD_CLASSES.get(name)
    return bool(cls is not None and cls.uses_base_mean)


def method_uses_base_covariance(name: str) -> bool:
    """Whether method ``name`` whitens with the base classes' within-class scatter when one is given."""
    cls = METHOD_CLASSES.get(name)
    return bool(cls is not None and getattr(cls, "uses_base_covariance", False))


def method_display_name(name: str) -> str:
    """How figures print method ``name`` (``alpha_tim`` → ``α-TIM``): the class's ``display_name``, falling
    back to ``name`` itself for unknown or user-registered methods without one."""
    cls = METHOD_CLASSES.get(name)
    return (getattr(cls, "display_name", "") if cls is not None else "") or name


def method_uses_class_prior(name: str) -> bool:
    """Whether method ``name`` uses a class marginal (and so may receive counts under the oracle prior)."""
    cls = METHOD_CLASSES.get(name)
    return bool(cls is not None and cls.uses_class_prior)


def build_method(name: str, params: dict[str, Any] | None = None, **context: Any) -> FewShotMethod:
    """Build method ``name`` with hyper-parameters ``params`` for one evaluation setting ``context``."""
    if name not in METHOD_REGISTRY:
        raise ConfigError(f"unknown method {name!r}; {did_you_mean(name, available_methods())}available methods: "
                         f"{', '.join(available_methods())}")
    try:
        return METHOD_REGISTRY[name](dict(params or {}), context)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise options_error(name, exc) from exc


__all__ = ["FewShotMethod", "PUTM", "SimpleShot", "ProtoNet", "PTMAP", "TIMGD", "AlphaTIM", "BDCSPN",
           "LaplacianShot", "BAVARDAGE", "ILPC", "UNEM", "AlphaAM",
           "METHOD_REGISTRY", "METHOD_CLASSES", "available_methods", "build_method", "method_display_name",
           "method_uses_base_covariance", "method_uses_base_mean", "method_uses_class_prior", "register_method"]
