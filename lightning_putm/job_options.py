"""A job's options declared once: one dataclass per job (``evaluate.py``, ``evaluate.py predict``,
``train_backbone.py``) holds every key of its ``conf/<job>.yaml`` with its default, the type ``--help`` shows and a
one-line help.

The dataclass is the single source: ``conf/<job>.yaml`` (the defaults a user reads and copies, and what the job
loads) is written from it by ``tools/sync_options.py``, ``--help`` reads its type column and meanings from it, and
``tests/test_option_sources.py`` fails when the yaml or ``--help`` says something else. Example::

    @dataclass(frozen=True)
    class WandbOptions:
        project: str = job_option("lightning-putm", type="str", help="W&B project")

    @dataclass(frozen=True)
    class EvaluateOptions:
        tasks: int | str = job_option("auto", type="int|auto", help="tasks per (shot, alpha); auto = 100 on ...")
        wandb: WandbOptions = nested(WandbOptions)

What a field declares is also what is checked: an integer or number with a bound (``low=``), a ``bool``, a text
with ``choices=``, a list with an ``element`` type, a ``path``, each optionally ``auto`` (``type="int|auto"``) or
``null`` (``int | None``), is checked by :func:`checked_options` with one wording for every job (key, what must
hold, the value given, "did you mean"). Only checks that relate keys to each other or read files stay with the
job's settings (``evaluation/settings.py``...). This module imports no torch: ``--help`` and config errors come
without them.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_putm.errors import ConfigError
from lightning_putm.validators import did_you_mean

#: ``field(metadata=...)`` keys.
SPEC, NESTED = "job_option", "job_nested"

#: Where each job's options are declared (``module:class``); read by name so this core module imports no wing.
SCHEMAS = {
    "evaluate": "lightning_putm.evaluation.options:EvaluateOptions",
    "predict": "lightning_putm.prediction.options:PredictOptions",
    "train_backbone": "lightning_putm.pretraining.options:TrainBackboneOptions",
    "data": "lightning_putm.pretraining.options:DataGroupOptions",  # only types: conf/data/*.yaml are recipes
}

#: The jobs whose ``conf/<job>.yaml`` is written from their options dataclass.
JOBS = ("evaluate", "predict", "train_backbone")
#: The column where a yaml line's comment starts (a longer ``key: value`` pushes it right).
COMMENT_COLUMN = 24
#: A yaml line is wrapped at this width.
YAML_WIDTH = 118
#: Joins the words of a bound so that wrapping never splits it.
KEEP = "\x00"
#: ``memory_budget_mb``'s rule, declared by both jobs' fields (``job_option(2048, **MEMORY_BUDGET, help=...)``) and
#: checked for Python callers of the methods by :func:`checked_memory_budget`: MB > 0, or ``auto``.
MEMORY_BUDGET: dict[str, Any] = {"type": "float|auto", "low": 0, "low_open": True, "unit": "MB"}
#: The line above a job yaml's generated keys.
YAML_NOTICE = "# Keys from {cls} (tools/sync_options.py writes them)"


@dataclass(frozen=True)
class JobOptionSpec:
    """What :func:`job_option` declares about one key besides its name and default."""

    #: the type ``--help`` shows: ``int``, ``path``, ``int|auto``, ``float|balanced``, ``list``, ``mapping``...;
    #: its first part is the kind :func:`check_value` checks, ``|auto`` lets the word ``auto`` through
    type: str
    help: str = ""
    #: the least value of an ``int`` or ``float`` key (``ways``: 2) or of a list's elements; exclusive if
    #: ``low_open``
    low: float | None = None
    low_open: bool = False
    #: the names a ``str`` key (or a list's elements) may take
    choices: tuple[str, ...] | None = None
    #: a list's element kind (``int``, ``str``); a list without one is not checked here
    element: str | None = None
    #: a list must hold at least one element
    nonempty: bool = False
    #: the unit a number is in, said in its error (``MB``)
    unit: str = ""


@dataclass(frozen=True)
class JobField:
    """One declared key: its dotted name (``wandb.mode``), default, shown type and help; ``mapping``: a group of keys
    (``trainer``), whose help stands beside its name in the yaml."""

    key: str
    default: Any
    type: str
    help: str
    mapping: bool = False
    low: float | None = None
    #: what the field declares beyond its type and help (bounds, choices, list element...)
    spec: JobOptionSpec | None = None
    #: ``null`` is a valid value (the field's annotation allows ``None``)
    nullable: bool = False
    #: False: a group passed on to another library that checks it (``trainer``: Lightning)
    checked: bool = True

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    @property
    def depth(self) -> int:
        return self.key.count(".")

    @property
    def kind(self) -> str:
        """What :func:`check_value` checks a value as: ``int``, ``float``, ``bool``, ``str``, ``path``, ``list``..."""
        return self.type.split("|")[0]

    @property
    def auto(self) -> bool:
        """The word ``auto`` is a valid value (``type="int|auto"``)."""
        return "auto" in self.type.split("|")[1:]

    @property
    def is_checked(self) -> bool:
        """Whether :func:`check_value` checks this key: a declared bound, choices or list element, a ``bool`` or a
        ``path`` whose type has no other part than ``auto``; other keys (``float|balanced``...) are parsed by their
        job."""
        if self.mapping or not self.checked or self.spec is None or set(self.type.split("|")[1:]) - {"auto"}:
            return False
        s = self.spec
        return (self.kind in ("bool", "path") or (self.kind in ("int", "float") and s.low is not None)
                or (self.kind == "str" and s.choices is not None) or (self.kind == "list" and s.element is not None))

    @property
    def meaning(self) -> str:
        """The help a user reads (yaml comment, ``--help``): the declared help and, with a bound, what must hold."""
        if self.low is None or self.kind not in ("int", "float"):
            return self.help
        return f"{self.help} (must {requirement(self, example=False)})".strip()


def job_option(default: Any, *, type: str, help: str = "", low: float | None = None, low_open: bool = False,
               choices: tuple[str, ...] | None = None, element: str | None = None, nonempty: bool = False,
               unit: str = "") -> Any:
    """A job key with its default, the type ``--help`` shows, a one-line help and what a valid value is: ``low``
    (the least number, exclusive with ``low_open``; for a list, of each element), ``choices`` of a text or of a
    list's elements, a list's ``element`` kind and whether it must be ``nonempty``, a number's ``unit``. A list
    default is copied per instance."""
    spec = JobOptionSpec(type=type, help=help, low=low, low_open=low_open, choices=choices, element=element,
                         nonempty=nonempty, unit=unit)
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type_copy(value), metadata={SPEC: spec})
    return field(default=default, metadata={SPEC: spec})


def type_copy(value: Any) -> Any:
    return [type_copy(v) for v in value] if isinstance(value, list) else \
        {k: type_copy(v) for k, v in value.items()} if isinstance(value, dict) else value


#: ``field(metadata=...)`` key of a group whose keys another library checks (``trainer``: Lightning).
PASSED_ON = "job_passed_on"


def nested(cls: type, help: str = "", checked: bool = True) -> Any:
    """A group of keys (``wandb``, ``trainer``) declared by its own dataclass; ``help`` is said beside the group;
    ``checked=False``: its keys are passed on to a library that checks them itself (Lightning's Trainer)."""
    return field(default_factory=cls, metadata={NESTED: help, PASSED_ON: not checked})


def _nullable(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def job_fields(cls: type, prefix: str = "", checked: bool = True) -> list[JobField]:
    """Every key of ``cls`` in declaration order, a group before its keys (``trainer``, ``trainer.devices``...)."""
    found: list[JobField] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if NESTED in f.metadata:
            inner = checked and not f.metadata.get(PASSED_ON, False)
            found.append(JobField(key, None, "mapping", f.metadata[NESTED], mapping=True, checked=inner))
            found += job_fields(f.default_factory, key + ".", inner)
            continue
        spec = f.metadata.get(SPEC)
        if spec is None:
            raise TypeError(f"{cls.__qualname__}.{f.name} is declared without job_option() or nested()")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        found.append(JobField(key, default, spec.type, spec.help, low=spec.low, spec=spec,
                              nullable=_nullable(hints[f.name]), checked=checked))
    return found


def job_schema(job: str) -> type | None:
    """The dataclass declaring ``job``'s options (``None`` for a job without one)."""
    where = SCHEMAS.get(job)
    if where is None:
        return None
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


def declared(schema: type, key: str) -> JobField:
    """The declaration of the dotted ``key`` in ``schema``."""
    return next(f for f in job_fields(schema) if f.key == key)


def checked(schema: type, key: str, value: Any) -> Any:
    """``value`` of the dotted ``key`` checked against what its field declares (:func:`check_value`)."""
    return check_value(declared(schema, key), value)


def checked_memory_budget(value: Any, key: str = "memory_budget_mb") -> float | str:
    """A working-memory budget checked by :data:`MEMORY_BUDGET`'s rule (a float of MB, or ``"auto"``): what
    ``FewShotMethod(memory_budget_mb=...)`` takes from Python, worded as the jobs word it."""
    spec = JobOptionSpec(**MEMORY_BUDGET)
    return check_value(JobField(key, 2048, spec.type, "", low=spec.low, spec=spec), value)


def checked_options(schema: type, cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """``{dotted key: value}`` of every key of ``schema`` that :func:`check_value` checks, each checked and
    converted (a float key holds a float, a list a list), in declaration order: the first wrong value is a one-line
    :class:`ConfigError`. A key the config lacks is left out."""
    found = {}
    for f in job_fields(schema):
        if not f.is_checked:
            continue
        value = OmegaConf.select(cfg, f.key, default=_MISSING) if OmegaConf.is_config(cfg) else _get(cfg, f.key)
        if value is not _MISSING:
            found[f.key] = check_value(f, value)
    return found


_MISSING = object()


def _get(values: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        if not isinstance(values, Mapping) or part not in values:
            return _MISSING
        values = values[part]
    return values


def _g(value: float) -> str:
    return f"{value:g}"


def _bound(f: JobField, plural: bool = False) -> str:
    """``a positive number``, ``an integer >= 2``, ``positive integers``, ``numbers >= 0``... of a bounded number."""
    s = f.spec or JobOptionSpec(type=f.type)
    kind = s.element if f.kind == "list" else f.kind
    noun = {"int": "integer", "float": "number"}[kind]
    if s.low is None:
        return f"{noun}s" if plural else f"{'an' if kind == 'int' else 'a'} {noun}"
    if s.low == 0 and s.low_open or kind == "int" and s.low == 1 and plural:
        words = f"positive {noun}"
        return f"{words}s" if plural else f"a {words}"
    words = f"{noun}{'s' if plural else ''} {'>' if s.low_open else '>='} {_g(s.low)}"
    return words if plural else f"{'an' if kind == 'int' else 'a'} {words}"


def requirement(f: JobField, example: bool = True) -> str:
    """What ``must`` be said of a valid value of ``f``: ``be an integer >= 2``, ``be a positive number (MB) or
    auto``, ``be one of train, val, test``, ``be a non-empty list of positive integers (e.g. shots=[1,5])``."""
    s = f.spec or JobOptionSpec(type=f.type)
    if f.kind == "bool":
        return "be true, false or auto" if f.auto else "be true or false"
    if f.kind in ("int", "float"):
        words = _bound(f) + (f" ({s.unit})" if s.unit else "")
    elif f.kind == "str":
        words = f"one of {', '.join(s.choices or ())}"
    elif f.kind == "path":
        words = "a path"
    else:
        items = (f"names among {', '.join(s.choices)}" if s.choices is not None
                 else _bound(f, plural=True) if s.element in ("int", "float") else f"{s.element} values")
        words = f"{'a non-empty' if s.nonempty else 'a'} list of {items}"
        if example and isinstance(f.default, list) and f.default:
            words += f" (e.g. {f.key}=[{','.join(str(v) for v in f.default)}])"
    if f.auto and f.kind == "list":
        return f"be auto or {words}"
    return f"be {words}" + (" or auto" if f.auto else "")


def _scalar(f: JobField, kind: str, value: Any) -> Any:
    """One value of ``kind`` converted (``float``: a Python float), or :data:`_MISSING` when it is not valid."""
    s = f.spec or JobOptionSpec(type=f.type)
    if kind == "bool":
        return value if isinstance(value, bool) else _MISSING
    if kind == "path":
        ok = value is not None and not isinstance(value, (bool, int, float, ListConfig, DictConfig, list, dict))
        return str(value) if ok and str(value).strip() else _MISSING
    if kind == "str":
        return value if isinstance(value, str) and (s.choices is None or value in s.choices) else _MISSING
    if isinstance(value, bool) or not isinstance(value, int if kind == "int" else (int, float)):
        return _MISSING
    if not math.isfinite(value):
        return _MISSING
    if s.low is not None and (value < s.low or (s.low_open and value == s.low)):
        return _MISSING
    return value if kind == "int" else float(value)


def check_value(f: JobField, value: Any) -> Any:
    """``value`` of the key ``f`` converted to its kind, or a one-line :class:`ConfigError`: `` `key` must <what
    the field declares>, got <value>`` and, for a misspelt choice, ``; did you mean <name>?``. A list takes a
    single value as a one-element list (``shots=1`` means ``shots=[1]``)."""
    if value is None and f.nullable:
        return None
    if f.auto and value == "auto":
        return "auto"
    shown = OmegaConf.to_container(value) if isinstance(value, (ListConfig, DictConfig)) else value
    if f.kind == "list":
        items = list(value) if isinstance(value, (list, tuple, ListConfig)) else [] if value is None else [value]
        converted = [_scalar(f, f.spec.element or "str", item) for item in items]
        if all(item is not _MISSING for item in converted) and (items or not f.spec.nonempty):
            return converted
        wrong = next((item for item, c in zip(items, converted) if c is _MISSING), None)
    else:
        converted = _scalar(f, f.kind, value)
        if converted is not _MISSING:
            return converted
        wrong = value
    hint = did_you_mean(wrong, f.spec.choices).strip() if f.spec.choices and isinstance(wrong, str) else ""
    raise ConfigError(f"`{f.key}` must {requirement(f)}, got {shown!r}" + (f"; {hint}" if hint else ""))


def job_types(job: str) -> dict[str, str]:
    """``{dotted key: type shown by --help}`` of every key of ``job``."""
    schema = job_schema(job)
    return {} if schema is None else {f.key: f.type for f in job_fields(schema)}


def job_comments(job: str) -> dict[str, str]:
    """``{dotted key: help}`` of every key of ``job``."""
    schema = job_schema(job)
    return {} if schema is None else {f.key: f.meaning for f in job_fields(schema)}


def yaml_scalar(value: Any) -> str:
    """A default as YAML that OmegaConf reads back as the same value (``null``, ``[2, balanced]``, ``{}``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_scalar(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, float) else str(value)


def yaml_lines(f: JobField) -> list[str]:
    """``key: default  # help``, indented by the key's depth, the comment wrapped under its column."""
    indent = "  " * f.depth
    head = f"{indent}{f.name}:" + ("" if f.mapping else f" {yaml_scalar(f.default)}")
    if not f.meaning:
        return [head]
    column = max(COMMENT_COLUMN, len(head) + 2)
    meaning = f.meaning
    if f.low is not None and f.kind in ("int", "float"):  # wrapping never splits what must hold
        must = f"(must {requirement(f, example=False)})"
        meaning = meaning.replace(must, must.replace(" ", KEEP))
    said = textwrap.wrap(meaning, width=YAML_WIDTH - column - 2, break_long_words=False, break_on_hyphens=False)
    said = [line.replace(KEEP, " ") for line in said]
    return [f"{head.ljust(column)}# {said[0]}", *(f"{' ' * column}# {line}" for line in said[1:])]


def job_yaml(cls: type, header: str = "") -> str:
    """``conf/<job>.yaml``: ``header`` (the file's title comment) and one entry per declared key."""
    lines = [line for f in job_fields(cls) for line in yaml_lines(f)]
    return header + "\n".join([YAML_NOTICE.format(cls=f"{cls.__module__}.{cls.__qualname__}"), *lines]) + "\n"


def yaml_header(text: str) -> str:
    """The comment lines at the top of a job yaml (its title and usage), kept as written."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.startswith("#") or line.startswith(YAML_NOTICE.split("{")[0]):
            return "".join(lines[:i])
    return text


__all__ = ["JOBS", "MEMORY_BUDGET", "JobField", "check_value", "checked", "checked_memory_budget", "checked_options",
           "job_comments", "job_fields", "job_option", "job_schema", "job_types", "job_yaml", "nested", "requirement",
           "yaml_header", "yaml_scalar"]
