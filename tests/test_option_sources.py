"""Each method option is declared once, on its settings dataclass's field; the yaml defaults a user reads, ``--help``
and the method page's options table are written from that field (lightning_putm/methods/option_pages.py,
tools/sync_options.py). These tests walk every field of every built-in method and fail when one of the three says
something else, or when a hand-written copy of a field's help appears beside them."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from lightning_putm.config import conf_dir
from lightning_putm.help import job_help, method_comments, show, yaml_comments
from lightning_putm.methods.catalog import BUILTIN_SETTINGS
from lightning_putm.methods.option_pages import (TABLE_END, config_default, meaning, method_yaml, options_table,
                                                 yaml_header, yaml_scalar)
from lightning_putm.methods.options import OptionField, config_fields

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [(settings, f) for settings in BUILTIN_SETTINGS for f in config_fields(settings)]
IDS = [f"{settings.method}.{f.name}" for settings, f in FIELDS]


def sync_tool():
    spec = importlib.util.spec_from_file_location("sync_options", ROOT / "tools" / "sync_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page_table(name: str) -> str:
    """The generated block of ``docs/methods/<name>.md`` (empty if the page has none)."""
    page = (ROOT / "docs" / "methods" / f"{name}.md").read_text()
    start, end = page.find("<!-- options: generated"), page.find(TABLE_END)
    return page[start:end] if start >= 0 and end >= 0 else ""


def test_generated_files_are_up_to_date() -> None:
    """Kills: a yaml default or comment, or a page's table row, edited by hand (or a field changed without running
    tools/sync_options.py): the files must be exactly what the dataclasses render."""
    stale = [str(path.relative_to(ROOT)) for path, text in sync_tool().rendered().items() if path.read_text() != text]
    assert not stale, f"out of date (run python tools/sync_options.py): {stale}"


def test_every_builtin_method_has_a_yaml_and_a_page_table() -> None:
    """Kills: a method whose yaml or page the tool skips (no file, no markers), so nothing is checked for it."""
    for settings in BUILTIN_SETTINGS:
        assert (conf_dir() / "method" / f"{settings.method}.yaml").is_file(), settings.method
        assert page_table(settings.method), f"docs/methods/{settings.method}.md has no generated options table"


@pytest.mark.parametrize("settings,f", FIELDS, ids=IDS)
def test_yaml_help_and_page_say_what_the_field_declares(settings, f: OptionField) -> None:
    """Kills: a yaml value OmegaConf reads back differently (``1e-6`` as text, a tuple as a string), a comment or
    ``--help`` row that is not the field's help and bounds, a page row with another default or meaning."""
    path = conf_dir() / "method" / f"{settings.method}.yaml"
    loaded = OmegaConf.to_container(OmegaConf.load(path))[f.name]
    expected = config_default(f)
    assert loaded == (list(expected) if isinstance(expected, tuple) else expected)
    assert type(loaded) is type(list(expected) if isinstance(expected, tuple) else expected)
    key = f"method.{settings.method}.{f.name}"
    assert yaml_comments(path, f"method.{settings.method}.")[key] == meaning(f)
    assert method_comments(settings.method, path)[key] == meaning(f)
    assert f.spec.help in meaning(f) and f.spec.help.strip()
    row = next(line for line in page_table(settings.method).splitlines() if line.startswith(f"| `{f.name}` |"))
    assert meaning(f).replace("|", "\\|") in row and yaml_scalar(f.default if not f.spec.by_setting else None) in row


def test_help_page_shows_every_field_with_its_type_default_and_bounds() -> None:
    """Kills: ``--help`` reading a stale comment instead of the field, or dropping the bounds."""
    text = " ".join(job_help("evaluate", "summary").split())
    squeezed = "".join(text.split())  # a long word (a link) may be cut at the column's end
    for settings, f in FIELDS:
        value = config_default(f)
        default = show(OmegaConf.create({"x": list(value) if isinstance(value, tuple) else value}).x)
        assert f"method.{settings.method}.{f.name} {f.kind} {default}" in text, (settings.method, f.name)
        assert "".join(meaning(f).split()) in squeezed, (settings.method, f.name)
    assert "method.putm.rho float null CT forward/backward weight" in text
    assert "(must lie in [0, 1])" in text


def words(text: str) -> str:
    return " ".join(re.sub(r"[#|`]", " ", text).split())


def test_no_hand_written_copy_of_a_fields_help() -> None:
    """Kills: the help of an option written again by hand in the package's code (outside its settings module), in
    a method page outside the generated table, or in a yaml's own (kept) lines."""
    sources = {path: words(path.read_text()) for path in (ROOT / "lightning_putm").rglob("*.py")
               if path.name not in ("settings.py", "peer_settings.py")}
    for settings, f in FIELDS:
        help_text = words(f.spec.help)
        if len(help_text) < 40:  # short phrases ("Adam steps") recur in prose by nature
            continue
        page = (ROOT / "docs" / "methods" / f"{settings.method}.md").read_text()
        outside = page.replace(page_table(settings.method), "")
        assert help_text not in words(outside), f"docs/methods/{settings.method}.md repeats {f.name}'s help"
        yaml = (conf_dir() / "method" / f"{settings.method}.yaml").read_text()
        assert help_text not in words(yaml_header(yaml, settings)), f"{settings.method}.yaml header repeats {f.name}"
        copies = [str(path.relative_to(ROOT)) for path, text in sources.items() if help_text in text]
        assert not copies, f"{settings.method}.{f.name}'s help is written again in {copies}"


def test_rendered_yaml_reads_back_as_the_defaults() -> None:
    """The renderer alone, on values the built-ins lack: exponents without a dot, negative numbers, empty lists.
    Kills: a float written as ``1e-06`` or ``1.0e20`` (YAML 1.1, PyYAML's, reads them as text) or a tuple written
    with parentheses."""
    for value in (1e-6, 5e-4, 1e20, -2.5, 0.0, 3, True, None, (0.5, 0.99), (), "auto"):
        back = OmegaConf.create(f"x: {yaml_scalar(value)}").x
        back = list(back) if not isinstance(back, (int, float, str, bool, type(None))) else back
        assert back == (list(value) if isinstance(value, tuple) else value), value
        assert type(back) is type(list(value) if isinstance(value, tuple) else value), value
        plain = yaml.safe_load(f"x: {yaml_scalar(value)}")["x"]
        assert plain == back and type(plain) is type(back), value
    text = method_yaml(BUILTIN_SETTINGS[0], "# title\n")
    assert text.startswith("# title\n# Options from ") and text.endswith("\n")
    assert options_table(BUILTIN_SETTINGS[0]).count("\n| `") == len(config_fields(BUILTIN_SETTINGS[0]))
