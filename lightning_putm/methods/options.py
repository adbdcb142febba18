"""A method's options declared once: one frozen dataclass per method holds every option's name, type, default,
bounds (or choices) and a one-line help.

The dataclass is the single source: the constructor takes it (or builds it from keyword options), building it
checks every field against its declared bounds with one wording for all methods, ``--help`` reads types and help
from it, and ``conf/method/<name>.yaml`` and the options table of ``docs/methods/<name>.md`` are written from it
(:mod:`~lightning_putm.methods.option_pages`, ``tools/sync_options.py``). Example::

    @dataclass(frozen=True)
    class PTMAPSettings(MethodOptions):
        method: ClassVar[str] = "ptmap"

        beta: float = option(0.5, low=0, low_open=True, help="power transform (x + 1e-6)^beta")
        inertia: float = option(0.2, low=0, high=1, help="centre update rate")
        iterations: int = option(20, low=0, help="MAP iterations")

    PTMAPSettings(inertia=1.5)  # ConfigError: method.ptmap.inertia must lie in [0, 1], got 1.5
    PTMAPSettings.from_mapping({"iteration": 5})
    # ConfigError: unknown option method.ptmap.iteration; did you mean method.ptmap.iterations? valid keys: ...

    class PTMAP(FewShotMethod):
        Settings = PTMAPSettings      # the constructor takes PTMAP(settings) or PTMAP(iterations=5)
        ...                           # and reads self.iterations (delegated to self.settings)

Building converts a value to its field's type exactly as the hand-written ``float(x)`` / ``int(x)`` did (a float
field holds a Python float, an int field an int, a list field a tuple), so results do not change. A field whose
``null`` means "chosen by the evaluation setting" (``by_setting=``) stays ``None`` until :meth:`MethodOptions.resolve`
fills it for the shots and protocol at hand; the resolved value is checked again. Fields with ``config=False`` are
fixed constants of the method that engines read from the same object but that no config may set.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar

from lightning_putm.errors import ConfigError
from lightning_putm.validators import did_you_mean

#: ``field(metadata=...)`` key that holds an :class:`OptionSpec`.
SPEC = "option"

S = TypeVar("S", bound="MethodOptions")


@dataclass(frozen=True)
class OptionSpec:
    """What :func:`option` declares about one field (besides its name, type and default)."""

    help: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    #: a list field's required length (``None``: any length)
    length: int | None = None
    #: what ``null`` means when the type allows it (``automatic``, ``off``, ``all``); shown in messages
    null: str = ""
    #: non-empty: ``null`` means "by setting", resolved by :meth:`MethodOptions.resolve`; says how
    by_setting: str = ""
    #: a short reason appended to a bound error (``1 = the reference code``)
    why: str = ""
    #: False: a fixed constant of the method, not a config key
    config: bool = True


def option(default: Any, *, help: str, low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False, choices: tuple[str, ...] | None = None, length: int | None = None, null: str = "",
           by_setting: str = "", why: str = "", config: bool = True) -> Any:
    """A dataclass field with its default and declared bounds (``low``/``high``, inclusive unless ``*_open``),
    ``choices`` for a text field, ``length`` for a list, and a one-line ``help``. Bounds of a list apply to
    each element."""
    spec = OptionSpec(help=help, low=low, high=high, low_open=low_open, high_open=high_open, choices=choices,
                      length=length, null=null or ("by setting" if by_setting else ""), by_setting=by_setting,
                      why=why, config=config)
    if isinstance(default, list):
        default = tuple(default)
    return field(default=default, metadata={SPEC: spec})


@dataclass(frozen=True)
class OptionField:
    """One declared option as ``--help`` and the yaml test read it."""

    name: str
    #: ``float``, ``int``, ``bool``, ``str`` or ``list``
    kind: str
    #: element type of a list (``float``/``int``), else the same as ``kind``
    element: str
    nullable: bool
    default: Any
    spec: OptionSpec

    @property
    def type_name(self) -> str:
        """The type as ``--help`` prints it: ``float``, ``int``, ``list``…"""
        return self.kind


def _type_parts(hint: Any) -> tuple[str, str, bool]:
    """(kind, element kind, nullable) of a field's type hint (``float | None``, ``tuple[int, ...]``)."""
    nullable = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            raise TypeError(f"an option's type must be one type or that type | None, got {hint!r}")
        hint = args[0]
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        elements = {a for a in typing.get_args(hint) if a is not Ellipsis}
        if len(elements) != 1:
            raise TypeError(f"a list option holds one element type, got {hint!r}")
        return "list", next(iter(elements)).__name__, nullable
    if hint not in (float, int, bool, str):
        raise TypeError(f"an option is a float, int, bool, str or tuple of numbers, got {hint!r}")
    return hint.__name__, hint.__name__, nullable


def option_fields(cls: type[MethodOptions]) -> list[OptionField]:
    """Every option of a settings class in declaration order (fields without :func:`option` are left out)."""
    cached = cls.__dict__.get("_option_fields")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(SPEC)
        if spec is None:
            continue
        kind, element, nullable = _type_parts(hints[f.name])
        found.append(OptionField(f.name, kind, element, nullable, f.default, spec))
    setattr(cls, "_option_fields", found)
    return found


def config_fields(cls: type[MethodOptions]) -> list[OptionField]:
    """The options a config may set (``conf/method/<name>.yaml``'s keys, ``preset`` aside)."""
    return [f for f in option_fields(cls) if f.spec.config]


def _g(value: float) -> str:
    return f"{value:g}"


def requirement(f: OptionField) -> str:
    """What ``must`` be said of a valid value: ``be positive``, ``be >= 1``, ``lie in [0, 1)``, ``be one of a, b``,
    ``be a list of 3 numbers >= 0``, ``be null (automatic) or >= 1``."""
    s = f.spec
    if s.choices is not None:
        words = f"one of {', '.join(s.choices)}"
    elif s.low is not None and s.high is not None:
        words = f"in {'(' if s.low_open else '['}{_g(s.low)}, {_g(s.high)}{')' if s.high_open else ']'}"
    elif s.low is not None:
        words = "positive" if s.low == 0 and s.low_open else f"{'>' if s.low_open else '>='} {_g(s.low)}"
    elif s.high is not None:
        words = f"{'<' if s.high_open else '<='} {_g(s.high)}"
    else:
        words = ""
    if f.kind == "list":
        count = f"{s.length} " if s.length is not None else ""
        plural = {"float": "numbers", "int": "integers"}.get(f.element, f"{f.element} values")
        words = f"a list of {count}{plural}" + (f" {words}" if words else "")
    elif f.kind in ("float", "int") and (not words or f.kind == "int" and words != "positive"):
        noun = "a number" if f.kind == "float" else "an integer"
        words = f"{noun} {words}".strip()
    elif f.kind == "int":
        words = "a positive integer"
    elif not words:
        words = {"bool": "true or false", "str": "text"}[f.kind]
    if f.nullable and not s.by_setting:  # a by-setting null is never the user's mistake
        return f"be null ({s.null}) or {words}" if s.null else f"be null or {words}"
    return f"lie {words}" if words.startswith("in ") else f"be {words}"


class MethodOptions:
    """Base of a method's frozen settings dataclass: building one checks and converts every option."""

    #: the method's config name (``method.<method>.<key>`` in messages)
    method: ClassVar[str] = "method"

    def __post_init__(self) -> None:
        for f in option_fields(type(self)):
            object.__setattr__(self, f.name, self._checked(f, getattr(self, f.name)))

    # ------------------------------------------------------------------------------------------------ checks
    @classmethod
    def key(cls, name: str) -> str:
        return f"method.{cls.method}.{name}"

    @classmethod
    def _fail(cls, f: OptionField, value: Any, why: bool = True) -> ConfigError:
        value = list(value) if isinstance(value, tuple) else value
        reason = f" ({f.spec.why})" if why and f.spec.why else ""
        return ConfigError(f"{cls.key(f.name)} must {requirement(f)}, got {value!r}{reason}")

    @classmethod
    def _wrong_type(cls, f: OptionField, value: Any, whole: Any) -> ConfigError:
        """A value of the wrong type: say the type (``a number``), and the bounds once it has it."""
        if f.kind == "list" or f.nullable:
            return cls._fail(f, whole, why=False)
        noun = {"float": "a number", "int": "an integer", "bool": "true or false"}[f.kind]
        return ConfigError(f"{cls.key(f.name)} must be {noun}, got {value!r}")

    @classmethod
    def _scalar(cls, f: OptionField, kind: str, value: Any, whole: Any) -> Any:
        """One value converted to ``kind`` and checked against the field's bounds (``whole`` for the message)."""
        if kind == "bool":
            if not isinstance(value, bool):
                raise cls._wrong_type(f, value, whole)
            return value
        if kind == "str":
            if not isinstance(value, str) or (f.spec.choices is not None and value not in f.spec.choices):
                hint = did_you_mean(value, f.spec.choices or ()).strip() if isinstance(value, str) else ""
                raise ConfigError(f"{cls.key(f.name)} must {requirement(f)}; got {whole!r}"
                                  + (f"; {hint}" if hint else ""))
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise cls._wrong_type(f, value, whole)
        if kind == "int":
            if not isinstance(value, numbers.Integral):
                raise cls._wrong_type(f, value, whole)
            value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise cls._wrong_type(f, value, whole)
        s = f.spec
        if s.low is not None and (value < s.low or (s.low_open and value == s.low)):
            raise cls._fail(f, whole)
        if s.high is not None and (value > s.high or (s.high_open and value == s.high)):
            raise cls._fail(f, whole)
        return value

    @classmethod
    def _checked(cls, f: OptionField, value: Any) -> Any:
        """``value`` in the field's type, or a one-line :class:`ConfigError` naming ``method.<name>.<key>``."""
        if value is None:
            if f.nullable:
                return None
            raise cls._fail(f, value, why=False)
        if f.kind != "list":
            return cls._scalar(f, f.kind, value, value)
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, typing.Iterable):
            raise cls._fail(f, value, why=False)
        items = list(value)
        if f.spec.length is not None and len(items) != f.spec.length:
            raise cls._fail(f, items, why=False)
        return tuple(cls._scalar(f, f.element, item, items) for item in items)

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def from_mapping(cls: type[S], values: Mapping[str, Any] | None = None) -> S:
        """Settings from a config mapping (``conf/method/<name>.yaml`` plus overrides). An unknown key is an error
        with the nearest valid keys; a by-setting option left out is ``None`` (chosen by :meth:`resolve`)."""
        values = dict(values or {})
        known = [f.name for f in config_fields(cls)]
        for key in values:
            if key not in known:
                hint = did_you_mean(key, known, prefix=f"method.{cls.method}.")
                raise ConfigError(f"unknown option {cls.key(key)}; {hint}valid keys: {', '.join(known)}")
        unset = {f.name: None for f in config_fields(cls) if f.spec.by_setting and f.name not in values}
        return cls(**unset, **values)

    @classmethod
    def build(cls: type[S], settings: S | None, options: Mapping[str, Any], *, shots: int | None = None,
              balanced: bool | None = None) -> S:
        """What a constructor takes: ``settings`` (used as given) or keyword ``options`` (not both), resolved for
        the evaluation setting."""
        if settings is not None and options:
            raise ConfigError(f"{cls.method}: give a {cls.__name__} or keyword options, not both "
                              f"(got {', '.join(sorted(options))} as well)")
        if settings is not None and not isinstance(settings, cls):
            raise ConfigError(f"{cls.method}: settings must be a {cls.__name__}, got {type(settings).__name__}")
        chosen = settings if settings is not None else cls.from_mapping(options)
        return chosen.resolve(shots=shots, balanced=balanced)

    def resolve(self: S, *, shots: int | None, balanced: bool | None) -> S:
        """The settings with every by-setting ``None`` chosen for ``shots`` and the protocol (``balanced``), and
        cross-option rules checked. Override in a method whose options depend on the setting or on each other."""
        return self

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


def shots_needed(method: str, names: list[str]) -> ConfigError:
    """The error of a method built without ``shots`` whose options ``names`` are chosen by the number of shots: it
    never guesses them (a call on tensors could, but a method's values are fixed when it is built)."""
    return ConfigError(f"{method}: the number of shots is needed to choose {', '.join(names)}; build it with shots=K "
                       f"(support examples per class) or set {', '.join(names)} (method.{method}.<key> in a config)")


__all__ = ["MethodOptions", "OptionField", "OptionSpec", "config_fields", "option", "option_fields", "requirement",
           "shots_needed"]
