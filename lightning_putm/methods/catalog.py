"""Which methods a config may name, and each one's settings dataclass, known without importing the methods.

Every job checks ``methods=[...]`` (or predict's ``method=``) and each ``method.<name>.<key>`` before it imports,
reads or writes anything, and ``--help`` lists every method's options: both read the settings dataclasses
(:mod:`~lightning_putm.methods.peer_settings`, :mod:`~lightning_putm.methods.putm.settings`), which import no
torch, so a typo is an error within a second. Building a method is :mod:`~lightning_putm.methods.registry`'s job
(it imports every method, and torch); a method added there with ``register_method`` is added here too.
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_putm.errors import ConfigError
from lightning_putm.methods.options import MethodOptions
from lightning_putm.methods.peer_settings import (AlphaAMSettings, AlphaTIMSettings, BAVARDAGESettings, BDCSPNSettings,
                                                  ILPCSettings, LaplacianShotSettings, ProtoNetSettings, PTMAPSettings,
                                                  SimpleShotSettings, TIMSettings, UNEMSettings)
from lightning_putm.methods.putm.settings import PUTMSettings

#: The built-in methods' settings (each one's ``method`` is its config name); the registry's classes use the same.
BUILTIN_SETTINGS: tuple[type[MethodOptions], ...] = (
    PUTMSettings, SimpleShotSettings, ProtoNetSettings, PTMAPSettings, TIMSettings, AlphaTIMSettings, BDCSPNSettings,
    LaplacianShotSettings, ILPCSettings, BAVARDAGESettings, AlphaAMSettings, UNEMSettings)
#: name → settings dataclass of every method a config may name: the built-in ones, and each one added with
#: :func:`~lightning_putm.methods.registry.register_method` (``None``: registered without a class or settings).
METHOD_SETTINGS: dict[str, type[MethodOptions] | None] = {settings.method: settings for settings in BUILTIN_SETTINGS}


def available_methods() -> list[str]:
    return sorted(METHOD_SETTINGS)


def method_settings(name: str) -> type[MethodOptions] | None:
    """Method ``name``'s settings dataclass (the schema of its options), or ``None`` (unknown, or none)."""
    return METHOD_SETTINGS.get(name)


def options_error(name: str, exc: Exception) -> ConfigError:
    """A method that refused its options with a ``TypeError``/``ValueError``, as one line naming its keys."""
    return ConfigError(f"method {name!r}: {exc}; check the method.{name}.* values")


def check_method_options(name: str, params: Mapping[str, Any] | None, *, shots: int, balanced: bool) -> None:
    """Check ``method.<name>.*`` (``params``) for one setting as the method's constructor checks them, without
    building the method: a bad value is the constructor's one-line :class:`ConfigError`, before torch loads."""
    settings = method_settings(name)
    if settings is None:
        return
    try:
        settings.build(None, dict(params or {}), shots=shots, balanced=balanced)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise options_error(name, exc) from exc
