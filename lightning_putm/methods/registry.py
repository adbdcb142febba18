"""Every few-shot method by its config name: methods register themselves, and are built here from a config.

A method is a class in a module of its own that registers under the name a config uses (``methods=[ptmap]``,
``method.ptmap.<key>=value``)::

    @register_method("ptmap")
    class PTMAP(FewShotMethod):
        Settings = PTMAPSettings      # its options (lightning_putm/methods/options.py)
        uses_class_prior = True       # flags: what the evaluation gives it (below)
        plot_slot = 1                 # its colour and marker in every figure
        ...

The built-in methods are the modules of this package: :func:`load_methods` imports them all on first use (and
with them torch). A user's method is any module that registers one, imported by the jobs' ``plugins`` key
(:func:`import_plugins`), so it runs through ``evaluate.py`` with no file of the package touched.

:func:`build_method` gives every constructor what the evaluation knows of the setting: ``shots``, ``balanced``,
``show_progress`` and ``memory_budget_mb`` (:class:`~lightning_putm.methods.base.FewShotMethod` takes them all),
and only to the classes whose flags ask for them the base statistics (``uses_base_mean`` → ``base_mean=``,
``uses_base_covariance`` → ``base_covariance=``) and, under the explicit oracle switch, the true query counts
(``uses_class_prior`` → ``query_counts=``). No method needs a factory of its own.

Importing this module imports no torch: the config checks and ``--help`` read the options of the built-in methods
from :mod:`~lightning_putm.methods.catalog`, and the methods load when one is built or a flag is read.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

from lightning_putm.errors import ConfigError
from lightning_putm.methods.catalog import METHOD_SETTINGS, options_error
from lightning_putm.validators import did_you_mean

if TYPE_CHECKING:
    from lightning_putm.methods.base import FewShotMethod

M = TypeVar("M", bound="type[FewShotMethod]")

#: name → method class, in registration order (the built-ins once :func:`load_methods` has run).
METHOD_CLASSES: dict[str, type[FewShotMethod]] = {}
#: The config key that names the user's modules to import (:func:`import_plugins`).
PLUGINS_KEY = "plugins"
_loaded = False


def register_method(name: str) -> Callable[[M], M]:
    """Class decorator: register a :class:`~lightning_putm.methods.base.FewShotMethod` subclass as ``name`` (its
    config name; also its ``name`` attribute and its settings' ``method``). Registering another class under a name
    already taken is an error; the same class again (a module imported twice) replaces the entry."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"register_method: a method's name must be a Python identifier (it is a config key: "
                          f"method.<name>.<key>), got {name!r}")

    def decorator(cls: M) -> M:
        from lightning_putm.methods.base import FewShotMethod  # loaded already: the class's module imported it

        if not (isinstance(cls, type) and issubclass(cls, FewShotMethod)):
            raise ConfigError(f"register_method({name!r}) decorates a FewShotMethod subclass, got {cls!r}")
        old = METHOD_CLASSES.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ConfigError(f"method {name!r} is registered twice: {old.__module__}.{old.__qualname__} and "
                              f"{cls.__module__}.{cls.__qualname__}; give one of them another name")
        settings = cls.Settings
        if settings is not None and "method" in vars(settings) and settings.method != name:
            raise ConfigError(f"register_method({name!r}): {cls.__qualname__}.Settings ({settings.__name__}) is "
                              f"declared for method {settings.method!r}")
        cls.name = name
        if settings is not None:
            settings.method = name  # its error messages name method.<name>.<key>
        METHOD_CLASSES[name] = cls
        METHOD_SETTINGS[name] = settings  # a config may name it, and --help lists its options
        return cls

    return decorator


def builtin_modules() -> list[str]:
    """The modules of :mod:`lightning_putm.methods`, where the built-in methods register: each module, and of a
    package (``putm/``) its ``method`` module (the package itself stays torch-free)."""
    package = importlib.import_module("lightning_putm.methods")
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        name = f"{package.__name__}.{info.name}"
        has_method = info.ispkg and importlib.util.find_spec(f"{name}.method") is not None
        found.append(f"{name}.method" if has_method else name)
    return found


def load_methods() -> dict[str, type[FewShotMethod]]:
    """Every registered method (the package's modules are imported on the first call; this imports torch)."""
    global _loaded
    if not _loaded:
        for module in builtin_modules():
            importlib.import_module(module)
        _loaded = True
    return METHOD_CLASSES


def available_methods() -> list[str]:
    """Every registered method's name, sorted."""
    return sorted(load_methods())


def method_class(name: str) -> type[FewShotMethod]:
    """The class registered as ``name``; an unknown name is a :class:`ConfigError` with the nearest names."""
    classes = load_methods()
    if name not in classes:
        names = sorted(classes)
        raise ConfigError(f"unknown method {name!r}; {did_you_mean(name, names)}available methods: {', '.join(names)}")
    return classes[name]


def method_order() -> list[str]:
    """The registered methods in figure order: by the classes' ``plot_slot``, then in registration order (a
    method without a slot comes after the built-ins), so a method keeps its colour and marker in every figure."""
    classes = load_methods()
    index = {name: i for i, name in enumerate(classes)}
    return sorted(classes, key=lambda name: (classes[name].plot_slot, index[name]))


def _flag(name: str, flag: str) -> bool:
    cls = load_methods().get(name)
    return bool(cls is not None and getattr(cls, flag, False))


def method_uses_base_mean(name: str) -> bool:
    """Whether method ``name`` normalises with a base-class mean (CL2N) when one is given."""
    return _flag(name, "uses_base_mean")


def method_uses_base_covariance(name: str) -> bool:
    """Whether method ``name`` whitens with the base classes' within-class scatter when one is given."""
    return _flag(name, "uses_base_covariance")


def method_uses_class_prior(name: str) -> bool:
    """Whether method ``name`` uses a class marginal (and so may receive counts under the oracle prior)."""
    return _flag(name, "uses_class_prior")


def method_display_name(name: str) -> str:
    """How figures print method ``name`` (``alpha_tim`` → ``α-TIM``): the class's ``display_name``, else ``name``."""
    cls = load_methods().get(name)
    return (getattr(cls, "display_name", "") if cls is not None else "") or name


#: What :func:`build_method` passes only to a class whose flag is set: constructor keyword → class flag.
FLAGGED_CONTEXT = {"base_mean": "uses_base_mean", "base_covariance": "uses_base_covariance",
                   "query_counts": "uses_class_prior"}


def build_method(name: str, params: Mapping[str, Any] | None = None, *, shots: int | None = None,
                 balanced: bool = False, memory_budget_mb: float | str | None = None, show_progress: bool = False,
                 base_mean: Any = None, base_covariance: Any = None, query_counts: Any = None) -> FewShotMethod:
    """Method ``name`` with the options ``params`` (``method.<name>.*``) for one evaluation setting.

    ``base_mean``, ``base_covariance`` and ``query_counts`` reach only the classes that declare
    ``uses_base_mean``, ``uses_base_covariance`` and ``uses_class_prior``; a bad option is one
    :class:`ConfigError` naming ``method.<name>.<key>``."""
    cls = method_class(name)
    context: dict[str, Any] = {"shots": shots, "balanced": balanced, "show_progress": show_progress}
    if memory_budget_mb is not None:
        context["memory_budget_mb"] = memory_budget_mb
    given = {"base_mean": base_mean, "base_covariance": base_covariance, "query_counts": query_counts}
    context.update({key: value for key, value in given.items() if getattr(cls, FLAGGED_CONTEXT[key], False)})
    try:
        return cls(**context, **dict(params or {}))
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise options_error(name, exc) from exc


# --------------------------------------------------------------------------------------------------- plugins
def plugin_list(value: Any, key: str = PLUGINS_KEY) -> list[str]:
    """``plugins``: a list of module names or ``.py`` paths (one text value is a list of one)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if isinstance(items, Sequence) and not isinstance(items, str) and all(
            isinstance(item, str) and item.strip() for item in items):
        return [item.strip() for item in items]
    raise ConfigError(f"`{key}` must be a list of module names or .py file paths that register methods, e.g. "
                      f"{key}=[my_methods] or {key}=[path/to/my_method.py]; got {value!r}")


def _module_name(path: Path) -> str:
    """The name a plugin file is imported as: its stem, unless another module holds that name."""
    stem = path.stem if path.stem.isidentifier() else "plugin"
    taken = sys.modules.get(stem)
    if taken is None or Path(getattr(taken, "__file__", "") or "").resolve() == path:
        return stem
    return f"lightning_putm_plugin_{abs(hash(str(path)))}"


def _import_file(path: Path) -> str:
    name = _module_name(path)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return name


def import_plugins(value: Any, key: str = PLUGINS_KEY) -> list[str]:
    """Import the user's modules named by ``plugins`` (module names, or paths of ``.py`` files) so that the methods
    they register can be named in a config; returns their module names. A module is imported once per process.
    One that cannot be imported is a one-line :class:`ConfigError` naming the key and the reason."""
    imported = []
    for item in plugin_list(value, key):
        try:
            if item.endswith(".py") or "/" in item or "\\" in item:
                path = Path(item).expanduser().resolve()
                if not path.is_file():
                    raise ConfigError(f"`{key}`: file not found: {item}; give the path of a .py file that registers "
                                      "a method, or an importable module name")
                imported.append(_import_file(path))
            else:
                importlib.import_module(item)
                imported.append(item)
        except ConfigError:
            raise
        except Exception as exc:  # the user's code: any error while importing it is theirs to see, on one line
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise ConfigError(f"`{key}`: cannot import {item!r} ({reason}); give an importable module name or the "
                              "path of a .py file that registers a method") from exc
    return imported


__all__ = ["FLAGGED_CONTEXT", "METHOD_CLASSES", "PLUGINS_KEY", "available_methods", "build_method",
           "builtin_modules", "import_plugins", "load_methods", "method_class", "method_display_name",
           "method_order", "method_uses_base_covariance", "method_uses_base_mean", "method_uses_class_prior",
           "plugin_list", "register_method"]
