"""What users read about a method's options, written from its settings dataclass (the one declaration).

``conf/method/<name>.yaml`` (the defaults a user sees and copies) and the options table of
``docs/methods/<name>.md`` are rendered here from each field's name, type, default, bounds and help, and
``tools/sync_options.py`` writes them; ``tests/test_option_sources.py`` fails when a file differs from what is
rendered, so no copy is kept by hand. A yaml's lines above its first option (the method's title, ``preset``) are
the file's own and kept as they are.
"""

from __future__ import annotations

import textwrap
from typing import Any

from lightning_putm.methods.options import MethodOptions, OptionField, config_fields, requirement

#: The column where a yaml line's comment starts (a longer ``key: value`` pushes it right).
COMMENT_COLUMN = 24
#: A yaml line is wrapped at this width.
YAML_WIDTH = 118
#: Joins the words of a bounds clause so that wrapping never splits it (``[0, 1]``).
KEEP = "\x00"
#: The line above a yaml's generated options.
YAML_NOTICE = "# Options from {cls} (tools/sync_options.py writes them); sources: docs/methods/{name}.md"
#: The markers around the generated table of a method page.
TABLE_BEGIN = "<!-- options: generated from {cls} by tools/sync_options.py; edit the dataclass, not this table -->"
TABLE_END = "<!-- options: end -->"


def yaml_scalar(value: Any) -> str:
    """A default as YAML that OmegaConf reads back as the same value (``1.0e-4``, ``null``, ``[0.5, 0.99]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_scalar(v) for v in value) + "]"
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:
            mantissa, exponent = text.split("e")
            text = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exponent):+d}"
        return text
    return str(value)


def config_default(f: OptionField) -> Any:
    """What a config holds for ``f``: its default, or ``null`` for one chosen by the evaluation setting."""
    return None if f.spec.by_setting else f.default


def meaning(f: OptionField, glue: str = " ") -> str:
    """The help a user reads for ``f``: its one-line help and, where it has bounds, what a value must be (the
    words of that clause joined by ``glue``, which a wrapper keeps on one line)."""
    must = requirement(f)
    plain = {"be true or false", "be text"}
    if must in plain or f.spec.choices is not None:
        return f.spec.help
    return f"{f.spec.help} {glue.join(f'(must {must})'.split())}"


def yaml_lines(f: OptionField) -> list[str]:
    """``key: default  # help (must ...)``, the comment wrapped under its column."""
    head = f"{f.name}: {yaml_scalar(config_default(f))}"
    column = max(COMMENT_COLUMN, len(head) + 2)
    said = [line.replace(KEEP, " ") for line in textwrap.wrap(meaning(f, KEEP), width=YAML_WIDTH - column - 2,
                                                               break_long_words=False, break_on_hyphens=False)]
    said = said or [""]
    return [f"{head.ljust(column)}# {said[0]}".rstrip(), *(f"{' ' * column}# {line}" for line in said[1:])]


def method_yaml(settings: type[MethodOptions], header: str = "") -> str:
    """``conf/method/<name>.yaml``: ``header`` (the file's own lines above its options) and one entry per option."""
    notice = YAML_NOTICE.format(cls=settings.__qualname__, name=settings.method)
    lines = [line for f in config_fields(settings) for line in yaml_lines(f)]
    return header + "\n".join([notice, *lines]) + "\n"


def yaml_header(text: str, settings: type[MethodOptions]) -> str:
    """The lines of a yaml above its first option (kept as written: a title, ``preset``)."""
    names = {f.name for f in config_fields(settings)}
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(YAML_NOTICE.split("{")[0]) or line.split(":", 1)[0] in names and not line.startswith((" ", "#")):
            return "".join(lines[:i])
    return text


def markdown_default(f: OptionField) -> str:
    """A default in a table cell: `null` with what it stands for where the setting chooses it."""
    if f.spec.by_setting:
        return f"`null` = {f.spec.by_setting}"
    value = f"`{yaml_scalar(f.default)}`"
    return f"{value} ({f.spec.null})" if f.default is None and f.spec.null else value


def options_table(settings: type[MethodOptions]) -> str:
    """The method page's options table (key, type, default, meaning) between its markers."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in config_fields(settings):
        kind = f"list of {f.element}" if f.kind == "list" else f.kind
        text = meaning(f).replace("|", "\\|")
        rows.append(f"| `{f.name}` | {kind} | {markdown_default(f).replace('|', chr(92) + '|')} | {text} |")
    begin = TABLE_BEGIN.format(cls=f"{settings.__module__}.{settings.__qualname__}")
    return "\n".join([begin, *rows, TABLE_END])


def with_table(page: str, settings: type[MethodOptions]) -> str:
    """``page`` with its generated table replaced by the one rendered now (a page without markers is unchanged)."""
    start = page.find("<!-- options: generated")
    end = page.find(TABLE_END)
    if start < 0 or end < 0:
        return page
    return page[:start] + options_table(settings) + page[end + len(TABLE_END):]


__all__ = ["method_yaml", "meaning", "options_table", "with_table", "yaml_header", "yaml_scalar"]
