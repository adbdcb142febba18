"""``--help`` of the scripts, generated from the declarations of their options so it cannot drift from them.

Every key of ``conf/<job>.yaml`` is listed with its default (in full, as it is written on the command line) and the
type and help declared on its job's options dataclass (:mod:`lightning_putm.job_options`; the yaml is written from
the same field). The config groups' keys (``conf/data/*.yaml`` as ``data.<key>``, ``conf/backbone/*.yaml`` as
``backbone.<key>``) come with the comment written beside them in their yaml. A method's options
(``method.<name>.<key>``) come from its settings dataclass: type, help and bounds as declared on the field.
Rows are wrapped to the terminal (at most :data:`MAX_WIDTH` characters, also when piped).
"""

from __future__ import annotations

import inspect
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_putm.config import Overrides, command_line_value, conf_dir, group_options, resolve_override_value
from lightning_putm.job_options import job_comments, job_types
from lightning_putm.methods.catalog import available_methods, method_defaults, method_settings
from lightning_putm.methods.option_pages import meaning
from lightning_putm.methods.options import config_fields
from lightning_putm.methods.registry import PLUGINS_KEY, import_plugins

KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w]*):(?P<rest>.*)$")
COMMENT_LINE = re.compile(r"^\s*#\s?(?P<text>.*)$")

#: Longest help line: wider text is hard to read even on a wide terminal.
MAX_WIDTH = 100
#: Narrowest layout we wrap to (a narrower terminal wraps our lines itself).
MIN_WIDTH = 60
#: Default column width in the table; a longer default gets lines of its own.
DEFAULT_COLUMN = 16
#: Below this many characters for the meaning, rows are stacked (meaning under the key) instead of in columns.
MIN_MEANING = 34

#: Sub-commands of a script, listed in its ``--help`` (each has its own ``--help``).
SUBCOMMANDS = {
    "evaluate": [("predict", "label your own images; its keys: python evaluate.py predict --help")],
}

Row = tuple[str, str, str, str]  # key, type, default, meaning


def help_width() -> int:
    """The terminal's width (``$COLUMNS`` first; :data:`MAX_WIDTH` when piped), within the readable range."""
    columns = shutil.get_terminal_size(fallback=(MAX_WIDTH, 24)).columns
    return max(MIN_WIDTH, min(MAX_WIDTH, columns))


def yaml_comments(path: Path, prefix: str = "") -> dict[str, str]:
    """``{dotted key: comment}`` from a YAML file's inline comments and the comment lines that continue them."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last: str | None = None
    for line in path.read_text().splitlines():
        match = KEY_LINE.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            dotted = prefix + ".".join([k for _, k in stack] + [match["key"]])
            stack.append((indent, match["key"]))
            rest = match["rest"]
            comment = rest.split(" #", 1)[1].strip() if " #" in rest else ""
            comments[dotted] = comment.lstrip("# ").strip()
            last = dotted if comment else None
            continue
        continuation = COMMENT_LINE.match(line)
        if continuation and last is not None and line.startswith(" "):
            comments[last] = f"{comments[last]} {continuation['text'].strip()}".strip()
        else:
            last = None
    return comments


def type_name(value: Any) -> str:
    """The type of a YAML value as the help shows it (``null`` only where nothing better is known)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (ListConfig, list, tuple)):
        return "list"
    if isinstance(value, (DictConfig, dict)):
        return "mapping"
    return type(value).__name__


def method_option(method: str, key: str) -> Any:
    """The declared option ``key`` of method ``method`` (an :class:`~lightning_putm.methods.options.OptionField`:
    type, default, bounds, help), or ``None`` for an unknown method or key (``preset``)."""
    settings = method_settings(method)  # each method's settings dataclass is its schema
    if settings is None:
        return None
    return next((f for f in config_fields(settings) if f.name == key), None)


def method_argument_type(method: str, key: str) -> str | None:
    """The type a method's settings dataclass declares for ``key`` (``float | None`` → ``float``)."""
    found = method_option(method, key)
    return None if found is None else found.type_name


def value_type(dotted: str, value: Any, types: dict[str, str] | None = None) -> str:
    """The type column of a key: its declaration (``types``: :func:`~lightning_putm.job_options.job_types`), a
    method's settings dataclass, else the YAML default's type."""
    if types and dotted in types:
        return types[dotted]
    parts = dotted.split(".")
    if len(parts) == 3 and parts[0] == "method":
        return method_argument_type(parts[1], parts[2]) or type_name(value)
    return type_name(value)


def method_source(method: str) -> str:
    """Where a method without a config file declares its options: its settings dataclass's module and name."""
    settings = method_settings(method)
    return "no options" if settings is None else f"{settings.__module__}.{settings.__qualname__}"


def method_comments(method: str, path: Path) -> dict[str, str]:
    """The meaning of each ``method.<method>.<key>``: a declared option's help and bounds from its settings
    dataclass (the yaml's comment is written from the same field); a key that is no option (``preset``) keeps the
    comment of ``conf/method/<method>.yaml``."""
    prefix = f"method.{method}."
    comments = yaml_comments(path, prefix) if path.is_file() else {}
    settings = method_settings(method)
    for found in config_fields(settings) if settings is not None else []:
        comments[prefix + found.name] = meaning(found)
    return comments


def show(value: Any) -> str:
    """A default as it is written on the command line: ``null``, ``true``, ``[putm, simpleshot]``, ``{}``."""
    return command_line_value(value)


def rows(cfg: DictConfig, comments: dict[str, str], prefix: str = "", skip: Sequence[str] = ("method",),
         types: dict[str, str] | None = None) -> list[Row]:
    """One row per leaf of ``cfg`` (an empty mapping is a leaf); ``skip``: keys listed elsewhere (the method group);
    ``types``: the declared type of each dotted key."""
    table: list[Row] = []
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if dotted in skip:
            continue
        if isinstance(value, DictConfig) and len(value):
            table += rows(value, comments, dotted + ".", skip, types)
        else:
            table.append((dotted, value_type(dotted, value, types), show(value), comments.get(dotted, "")))
    return table


def _wrap(text: str, width: int, indent: int, first_indent: int | None = None) -> list[str]:
    """``text`` wrapped to ``width``: the first line starts at column ``first_indent`` (default ``indent``)."""
    first = indent if first_indent is None else first_indent
    return textwrap.wrap(text, width=width, initial_indent=" " * first, subsequent_indent=" " * indent,
                         break_long_words=True, break_on_hyphens=False) or [" " * first]


def format_rows(table: Sequence[Row], width: int | None = None) -> str:
    """The rows as a table of key, type, default and meaning, wrapped to ``width`` (the terminal's by default).

    Columns when the meaning keeps at least :data:`MIN_MEANING` characters; a default longer than its column is
    written in full on lines of its own, the meaning below it. On a narrow terminal each row is stacked: key, type
    and default on one line, the meaning indented below.
    """
    width = width or help_width()
    if not table:
        return ""
    key_width = max(len(row[0]) for row in table)
    type_width = max(len(row[1]) for row in table)
    default_width = min(DEFAULT_COLUMN, max(len(row[2]) for row in table))
    default_at = 2 + key_width + 2 + type_width + 2
    meaning_at = default_at + default_width + 2
    lines: list[str] = []
    if width - meaning_at >= MIN_MEANING:
        for key, kind, default, meaning in table:
            head = f"  {key.ljust(key_width)}  {kind.ljust(type_width)}  "
            if len(default) <= default_width:
                said = _wrap(meaning, width - meaning_at, 0)
                lines.append(f"{head}{default.ljust(default_width)}  {said[0]}")
                lines += [" " * meaning_at + line for line in said[1:]]
            else:  # in full, on as many lines as it takes; the meaning follows below, in its column
                wrapped = _wrap(default, width, default_at + 1, default_at)
                lines += [head + wrapped[0][default_at:], *wrapped[1:]]
                if meaning:
                    lines += _wrap(meaning, width, meaning_at)
    else:
        for key, kind, default, meaning in table:
            wrapped = _wrap(f"{key}  {kind}  {default}", width, 8, 2)
            lines += wrapped
            if meaning:
                lines += _wrap(meaning, width, 6)
    return "\n".join(line.rstrip() for line in lines)


def paragraph(text: str, width: int | None = None, indent: int = 0) -> str:
    """Running text (a docstring's paragraphs, a note) wrapped to the help's width; blank lines are kept."""
    width = width or help_width()
    blocks = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join("\n".join(_wrap(" ".join(block.split()), width, indent)) for block in blocks)


def two_columns(pairs: Sequence[tuple[str, str]], width: int | None = None) -> str:
    """``name  meaning`` rows (command-line options, sub-commands), the meaning wrapped in its column."""
    width = width or help_width()
    column = 2 + max(len(name) for name, _ in pairs) + 2
    lines: list[str] = []
    for name, text in pairs:
        said = _wrap(text, width - column, 0)
        lines += [f"  {name.ljust(column - 4)}  {said[0]}".rstrip(), *(" " * column + line for line in said[1:])]
    return "\n".join(lines)


def usage(lines: Sequence[tuple[str, str]], width: int | None = None) -> str:
    """``Usage:`` with one command per line and, wrapped below it where it does not fit beside it, what it does."""
    width = width or help_width()
    out = ["Usage:"]
    for command, note in lines:
        out += _wrap(command, width, 6, 2)
        if note:
            beside = f"{out[-1]}   # {note}"
            if len(beside) <= width:
                out[-1] = beside
            else:
                out += _wrap(f"# {note}", width, 8, 6)
    return "\n".join(out)


def job_rows(job: str, skip: Sequence[str] = ("method",)) -> list[Row]:
    """The rows of ``conf/<job>.yaml``: keys and defaults as the job loads them, types and meanings as the job's
    options dataclass declares them (:mod:`lightning_putm.job_options`)."""
    return rows(OmegaConf.load(conf_dir() / f"{job}.yaml"), job_comments(job), "", skip, job_types(job))


def job_help(job: str, summary: str, arguments: Sequence[str] = ()) -> str:
    """The full ``--help`` of ``evaluate`` or ``train_backbone``; a ``plugins=[...]`` among ``arguments`` is imported
    first, so the methods it registers are listed with the built-ins."""
    width = help_width()
    plugins = Overrides.parse([a for a in arguments if a.startswith(f"{PLUGINS_KEY}=")]).last(PLUGINS_KEY)
    if plugins is not None:
        import_plugins(resolve_override_value(plugins))
    folder = conf_dir()
    groups = {"method": "method"} if job == "evaluate" else {"data": "data", "backbone": "backbone"}
    commands = [(f"python {job}.py [key=value ...]", ""),
                (f"python {job}.py config=<run folder>/config.yaml [key=value ...]", "re-run a recorded run")]
    commands += [(f"python {job}.py {name} [key=value ...]", text) for name, text in SUBCOMMANDS.get(job, [])]
    body = [paragraph(summary, width), "", usage(commands, width)]
    body += ["", *_wrap(f"Keys of conf/{job}.yaml (key, type, default, meaning):", width, 2, 0),
             format_rows(job_rows(job), width)]
    for group, key in groups.items():
        group_types = {f"{key}.{name}": kind for name, kind in job_types(group).items()}
        names = available_methods() if group == "method" else group_options(group)
        for name in names:
            path = folder / group / f"{name}.yaml"
            node = OmegaConf.load(path) if path.is_file() else OmegaConf.create(method_defaults(name))
            prefix = f"method.{name}." if group == "method" else f"{key}."
            where = f"conf/{group}/{name}.yaml" if path.is_file() else method_source(name)
            title = f"method.{name}.<key>=value ({where}):" if group == "method" else \
                f"{key}={name} ({where}) sets {key}.<key>:"
            body += ["", *_wrap(title, width, 2, 0)]
            comments = method_comments(name, path) if group == "method" else yaml_comments(path, prefix)
            body.append(format_rows(rows(node, comments, prefix, types=group_types), width))
    body += ["", paragraph("trainer.<name>=value: any pytorch_lightning.Trainer argument except the ones the job sets "
                           "itself (e.g. logger, callbacks, enable_checkpointing, default_root_dir). Unknown keys are "
                           "errors that name the closest valid keys and list them all.", width)]
    return "\n".join(body)
