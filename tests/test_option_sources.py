"""Each method option is declared once, on its settings dataclass's field; the yaml defaults a user reads, ``--help``
and the method page's options table are written from that field (lightning_putm/methods/option_pages.py,
tools/sync_options.py). Each job key (evaluate.py, predict, train_backbone.py) likewise, on its job's options
dataclass (lightning_putm/job_options.py): its yaml line and ``--help`` row. These tests walk every field of every
built-in method and job and fail when one of them says something else, or when a hand-written copy of a field's
help (or a job key's type) appears beside them."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from lightning_putm.config import conf_dir
from lightning_putm.help import job_help, method_comments, show, yaml_comments
from lightning_putm.errors import ConfigError
from lightning_putm.job_options import JOBS, JobField, checked, job_fields, job_schema, job_yaml, requirement
from lightning_putm.job_options import yaml_header as job_yaml_header
from lightning_putm.job_options import yaml_scalar as job_yaml_scalar
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


# ------------------------------------------------------------------------------------------------- job options
JOB_FIELDS = [(job, f) for job in JOBS for f in job_fields(job_schema(job))]
JOB_IDS = [f"{job}.{f.key}" for job, f in JOB_FIELDS]


def job_page(job: str) -> str:
    """The ``--help`` page that lists ``job``'s keys, whitespace squeezed to single spaces."""
    from lightning_putm.prediction.settings import predict_help

    text = predict_help("summary") if job == "predict" else job_help(job, "summary")
    return " ".join(text.split())


@functools.cache
def job_pages() -> dict[str, str]:
    return {job: job_page(job) for job in JOBS}


def dotted(node, key: str):
    for part in key.split("."):
        node = node[part]
    return node


@pytest.mark.parametrize("job,f", JOB_FIELDS, ids=JOB_IDS)
def test_job_yaml_and_help_say_what_the_field_declares(job: str, f: JobField) -> None:
    """Kills: a ``conf/<job>.yaml`` default that OmegaConf reads back as another value or type (``2.0`` as ``2``,
    ``auto`` for ``null``), a yaml comment that is not the field's help, and a ``--help`` row whose type, default
    or meaning is not the field's (a stale type table, a comment read from somewhere else)."""
    path = conf_dir() / f"{job}.yaml"
    loaded = OmegaConf.to_container(OmegaConf.load(path))
    value = dotted(loaded, f.key)
    if f.mapping:
        assert isinstance(value, dict)
    else:
        assert value == f.default and type(value) is type(f.default), (value, f.default)
    assert yaml_comments(path).get(f.key, "") == f.meaning
    assert f.help in f.meaning
    assert f.low is None or f.kind not in ("int", "float") or f"(must {requirement(f, example=False)})" in f.meaning
    if f.mapping or (job == "evaluate" and f.key == "method"):  # groups are not rows; method.* rows are the methods'
        return
    default = show(OmegaConf.create({"x": f.default}).x)
    row = f"{f.key} {f.type} {default}"
    text = job_pages()[job]
    assert row in text, row
    assert "".join(f.meaning.split()) in "".join(text.split())


def test_every_job_key_is_declared_and_typed() -> None:
    """Kills: a yaml key (leaf or group) without a declaration, or a declared key without a type ``--help`` can
    show."""
    for job in JOBS:
        declared = {f.key for f in job_fields(job_schema(job))}
        loaded = OmegaConf.load(conf_dir() / f"{job}.yaml")

        def keys(node, prefix=""):
            for key, value in node.items():
                yield prefix + key
                if isinstance(value, DictConfig) and len(value):
                    yield from keys(value, f"{prefix}{key}.")

        assert set(keys(loaded)) == declared, job
        assert all(f.type for f in job_fields(job_schema(job)))


def test_no_hand_written_copy_of_a_job_keys_type_or_help() -> None:
    """Kills: a second table of the jobs' key types (``KEY_TYPES = {"checkpoint": "path", ...}`` in help.py) or a
    field's help written again by hand in the package's code or a yaml's title lines."""
    sources = {path: path.read_text() for path in (ROOT / "lightning_putm").rglob("*.py")
               if path.name != "options.py"}
    plain = {path: words(text) for path, text in sources.items()}
    for job, f in JOB_FIELDS:
        typed = re.compile(rf"""["']{re.escape(f.key)}["']\s*:\s*["']{re.escape(f.type)}["']""")
        copies = [str(path.relative_to(ROOT)) for path, text in sources.items() if typed.search(text)]
        assert not copies, f"{job}.{f.key}'s type is written again in {copies}"
        help_text = words(f.help)
        if len(help_text) < 40:
            continue
        copies = [str(path.relative_to(ROOT)) for path, text in plain.items() if help_text in text]
        assert not copies, f"{job}.{f.key}'s help is written again in {copies}"
        header = job_yaml_header((conf_dir() / f"{job}.yaml").read_text())
        assert help_text not in words(header), f"{job}.yaml's title repeats {f.key}'s help"
    assert not hasattr(importlib.import_module("lightning_putm.help"), "KEY_TYPES")


CHECKED = [(job, f) for job, f in JOB_FIELDS if f.is_checked]


def wrong_values(f: JobField) -> list:
    """Values the field's declaration refuses, each for another reason."""
    kind = f.spec.element if f.kind == "list" else f.kind
    if kind == "int" and f.spec.choices is None:
        one = ([] if f.low is None else [f.low - 1, float(f.low)]) + [True, 1.5, "x"]
    elif kind == "float":
        one = [f.low if f.spec.low_open else f.low - 1, True, float("nan"), "x"]
    elif kind == "bool":
        one = ["maybe", 1, "true"]
    elif kind == "path":
        one = [5, "", [f"{f.key}"]]
    else:
        one = [f"{f.spec.choices[0]}x", 5]
    if f.kind != "list":
        return one + ([] if f.nullable else [None])
    return [[v] for v in one if v is not None] + ([[]] if f.spec.nonempty else [])


@pytest.mark.parametrize("job,f", CHECKED, ids=[f"{job}.{f.key}" for job, f in CHECKED])
def test_what_a_field_declares_is_what_is_checked(job: str, f: JobField) -> None:
    """Kills: a check that drifts from the field (a bound, choice or element type of its own), accepts a bool as a
    number or the text ``true`` as a bool, converts a number without checking it, or words the error otherwise
    than `` `key` must <what the field declares>, got <value>``; and a default the check itself refuses."""
    schema = job_schema(job)
    default = checked(schema, f.key, f.default)
    assert default == f.default and (f.kind != "float" or isinstance(default, float) or default == "auto")
    for wrong in wrong_values(f):
        with pytest.raises(ConfigError, match=rf"^`{re.escape(f.key)}` must {re.escape(requirement(f))}, got "):
            checked(schema, f.key, wrong)


def test_a_misspelt_choice_gets_the_nearest_name() -> None:
    """Kills: a choice or list-of-choices check without "did you mean"."""
    for job, key, wrong, near in (("evaluate", "split", "tset", "test"), ("train_backbone", "stages", ["rotaton"],
                                                                           "rotation")):
        with pytest.raises(ConfigError, match=rf"; did you mean {near}\?$"):
            checked(job_schema(job), key, wrong)


OVERRIDE_TEXT = {"int": "x", "float": "x", "bool": "maybe", "path": "[a]"}


@pytest.mark.parametrize("job", ["evaluate", "train_backbone"])
def test_the_jobs_check_every_declared_key_through_its_field(job: str) -> None:
    """Each checked key, given a wrong value on the command line, fails the job's settings with the field's message.
    Kills: a job's settings checking a key by hand first (another wording or bound, ``integer(cfg.ways, "ways",
    2)``) or not at all (a field the job never passes to the generic check)."""
    import lightning_putm.evaluation.settings as evaluation
    import lightning_putm.pretraining.settings as pretraining

    base = ["queries=75", "tasks=20", "methods=[simpleshot]"] if job == "evaluate" else []
    for _, f in [(j, f) for j, f in CHECKED if j == job]:
        kind = f.spec.element if f.kind == "list" else f.kind
        text = "[]" if f.kind == "list" and f.spec.nonempty else OVERRIDE_TEXT.get(kind, "zzz")
        if f.kind == "list" and not f.spec.nonempty:
            text = f"[{OVERRIDE_TEXT.get(kind, 'zzz')}]"
        override = [*base, f"{f.key}={text}"]
        with pytest.raises(ConfigError, match=rf"^`{re.escape(f.key)}` must {re.escape(requirement(f))}, got "):
            if job == "evaluate":
                evaluation.settings_from_config(evaluation.load_evaluate_config(override))
            else:
                pretraining.settings_from_config(pretraining.load_train_config(override))


def test_rendered_job_yaml_reads_back_as_the_defaults() -> None:
    """The job renderer alone on values the jobs lack. Kills: a nested mapping or list of mappings written as
    Python (``{'a': 1}``), a float written as an int, a group written without its keys."""
    for value in ({"a": [1, "x"], "b": None}, [], {}, 0.5, 2.0, "split:train", "32-true", [2, "balanced"]):
        back = OmegaConf.to_container(OmegaConf.create({"x": OmegaConf.create(f"x: {job_yaml_scalar(value)}").x}))["x"]
        assert back == value and type(back) is type(value), value
    text = job_yaml(job_schema("evaluate"), "# title\n")
    assert text.startswith("# title\n# Keys from ") and "\nwandb:\n  project: lightning-putm" in text




def test_the_trainer_group_is_left_to_lightning() -> None:
    """``trainer.*`` is passed to ``pytorch_lightning.Trainer``, which checks its own arguments and takes more than
    the declared type says (``deterministic="warn"``). Kills: the generic check run over a group declared
    ``checked=False``."""
    from lightning_putm.pretraining.settings import load_train_config, settings_from_config

    fields = [f for f in job_fields(job_schema("train_backbone")) if f.key.startswith("trainer.")]
    assert fields and not any(f.is_checked for f in fields)
    assert settings_from_config(load_train_config(["trainer.deterministic=warn"])).trainer["deterministic"] == "warn"
