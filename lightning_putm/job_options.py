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

Checking a value stays with the job's settings (``evaluation/settings.py``...), which give one-line errors naming
the key. This module imports no torch: ``--help`` and config errors come without them.
"""

from __future__ import annotations

import dataclasses
import importlib
import textwrap
from dataclasses import dataclass, field
from typing import Any

from lightning_putm.validators import integer

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
#: The line above a job yaml's generated keys.
YAML_NOTICE = "# Keys from {cls} (tools/sync_options.py writes them)"


@dataclass(frozen=True)
class JobOptionSpec:
    """What :func:`job_option` declares about one key besides its name and default."""

    #: the type ``--help`` shows: ``int``, ``path``, ``int|auto``, ``float|balanced``, ``list``, ``mapping``...
    type: str
    help: str = ""
    #: the least integer the key takes (``ways``: 2); its job's settings check it with :func:`checked_integer`
    low: int | None = None


@dataclass(frozen=True)
class JobField:
    """One declared key: its dotted name (``wandb.mode``), default, shown type and help; ``mapping``: a group of keys
    (``trainer``), whose help stands beside its name in the yaml."""

    key: str
    default: Any
    type: str
    help: str
    mapping: bool = False
    low: int | None = None

    @property
    def name(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    @property
    def depth(self) -> int:
        return self.key.count(".")

    @property
    def meaning(self) -> str:
        """The help a user reads (yaml comment, ``--help``): the declared help and, with a bound, what must hold."""
        if self.low is None:
            return self.help
        return f"{self.help} (must be an integer >= {self.low})".strip()


def job_option(default: Any, *, type: str, help: str = "", low: int | None = None) -> Any:
    """A job key with its default, the type ``--help`` shows, a one-line help and, for an integer, its least value
    ``low`` (a list default is copied per instance)."""
    spec = JobOptionSpec(type=type, help=help, low=low)
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type_copy(value), metadata={SPEC: spec})
    return field(default=default, metadata={SPEC: spec})


def type_copy(value: Any) -> Any:
    return [type_copy(v) for v in value] if isinstance(value, list) else \
        {k: type_copy(v) for k, v in value.items()} if isinstance(value, dict) else value


def nested(cls: type, help: str = "") -> Any:
    """A group of keys (``wandb``, ``trainer``) declared by its own dataclass; ``help`` is said beside the group."""
    return field(default_factory=cls, metadata={NESTED: help})


def job_fields(cls: type, prefix: str = "") -> list[JobField]:
    """Every key of ``cls`` in declaration order, a group before its keys (``trainer``, ``trainer.devices``...)."""
    found: list[JobField] = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if NESTED in f.metadata:
            found.append(JobField(key, None, "mapping", f.metadata[NESTED], mapping=True))
            found += job_fields(f.default_factory, key + ".")
            continue
        spec = f.metadata.get(SPEC)
        if spec is None:
            raise TypeError(f"{cls.__qualname__}.{f.name} is declared without job_option() or nested()")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        found.append(JobField(key, default, spec.type, spec.help, low=spec.low))
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


def checked_integer(schema: type, key: str, value: Any) -> int:
    """``value`` of ``key``, an integer at least the bound its field declares, or a one-line error naming the key."""
    return integer(value, key, declared(schema, key).low)


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
    said = textwrap.wrap(f.meaning.replace("(must be an integer >= ", f"(must{KEEP}be{KEEP}an{KEEP}integer{KEEP}>={KEEP}"), width=YAML_WIDTH - column - 2, break_long_words=False, break_on_hyphens=False)
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


__all__ = ["JOBS", "JobField", "checked_integer", "job_comments", "job_fields", "job_option", "job_schema", "job_types", "job_yaml", "nested",
           "yaml_header", "yaml_scalar"]
