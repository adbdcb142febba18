"""Which methods a config may name, and each one's settings dataclass, known without importing the methods.

Every job checks ``methods=[...]`` (or predict's ``method=``) and each ``method.<name>.<key>`` before it imports,
reads or writes anything, and ``--help`` lists every method's options: both read the settings dataclasses
(:mod:`~lightning_putm.methods.peer_settings`, :mod:`~lightning_putm.methods.putm.settings`), which import no
torch, so a typo is an error within a second. Building a method is :mod:`~lightning_putm.methods.registry`'s job
(it imports every method, and torch); a class registered there with ``@register_method`` (a user's, from
``plugins``) is added here too.

The built-in methods known here are the settings dataclasses those two modules declare (each names its method), so
no list of methods is kept by hand: a method of the package declares its settings there, beside the others
(``tests/test_registry.py`` checks that every class of the package has its settings there).
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_putm.errors import ConfigError
from lightning_putm.methods import peer_settings
from lightning_putm.methods.options import MethodOptions, config_fields
from lightning_putm.methods.putm import settings as putm_settings

#: The torch-free modules that declare the built-in methods' settings.
SETTINGS_MODULES = (putm_settings, peer_settings)
#: The built-in methods' settings: every settings dataclass of :data:`SETTINGS_MODULES` that names its method
#: (``method: ClassVar[str] = "ptmap"``, the config name its class registers under).
BUILTIN_SETTINGS: tuple[type[MethodOptions], ...] = tuple(
    value for module in SETTINGS_MODULES for value in vars(module).values()
    if isinstance(value, type) and issubclass(value, MethodOptions) and value.__module__ == module.__name__
    and "method" in vars(value))
#: name → settings dataclass of every method a config may name: the built-in ones, and each one registered with
#: :func:`~lightning_putm.methods.registry.register_method` (``None``: a method without options).
METHOD_SETTINGS: dict[str, type[MethodOptions] | None] = {settings.method: settings for settings in BUILTIN_SETTINGS}


def available_methods() -> list[str]:
    """The methods known without importing them (the built-ins and those registered so far), sorted."""
    return sorted(METHOD_SETTINGS)


def known_method(name: str) -> bool:
    """Whether a config may name method ``name`` (a built-in, or one registered from ``plugins``)."""
    return name in METHOD_SETTINGS


def method_settings(name: str) -> type[MethodOptions] | None:
    """Method ``name``'s settings dataclass (the schema of its options), or ``None`` (unknown, or none)."""
    return METHOD_SETTINGS.get(name)


def method_defaults(name: str) -> dict[str, Any]:
    """The options of method ``name`` as a config holds them (``method.<name>.*``): each declared option's default
    (a list for a tuple; ``null`` for one chosen by the evaluation setting)."""
    settings = method_settings(name)
    if settings is None:
        return {}
    return {f.name: None if f.spec.by_setting else list(f.default) if isinstance(f.default, tuple) else f.default
            for f in config_fields(settings)}


def method_configs() -> dict[str, Any]:
    """``method.<name>`` of every method a config may name: its ``conf/method/<name>.yaml`` where it has one, else
    (a method registered from ``plugins``) its settings' defaults."""
    from lightning_putm.config import group_options, load_group

    files = group_options("method")
    configs: dict[str, Any] = {name: load_group("method", name) for name in files}
    configs.update({name: method_defaults(name) for name in available_methods() if name not in files})
    return configs


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
