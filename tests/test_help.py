"""``--help`` of every entry point: readable at the terminal's width, complete, and typed.

The help pages are built from the config files, so these tests read the same files and check that nothing of them
is lost on the way (a default cut off, a comment truncated), that every line fits the terminal (``$COLUMNS``, at
most ``MAX_WIDTH`` when piped), that every key shows a type a user can act on (``path``, not ``null``), and that
``evaluate.py --help`` points at its ``predict`` subcommand.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO_ROOT
from helpers.cli import run_in_process
from lightning_putm.__main__ import main as module_main
from lightning_putm.config import conf_dir, group_options
from lightning_putm.help import MAX_WIDTH, MIN_WIDTH, Row, format_rows, job_rows, rows, show, yaml_comments
from lightning_putm.job_options import job_types


def evaluate_script():
    """``evaluate.py`` loaded as a module (its ``cli`` dispatches ``predict``)."""
    spec = importlib.util.spec_from_file_location("_help_evaluate_script", REPO_ROOT / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def captured(call) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = call()
    return code, out.getvalue(), err.getvalue()


def help_pages() -> dict[str, str]:
    """Every help page a user can ask for, at the current ``$COLUMNS``."""
    script = evaluate_script()
    pages = {
        "evaluate.py --help": run_in_process("evaluate", ["--help"]).stdout,
        "train_backbone.py --help": run_in_process("train_backbone", ["--help"]).stdout,
        "evaluate.py predict --help": captured(lambda: script.cli(["predict", "--help"]))[1],
        "python -m lightning_putm --help": captured(lambda: module_main(["--help"]))[1],
        "python -m lightning_putm study --help": captured(lambda: module_main(["study", "--help"]))[1],
        "python -m lightning_putm tune --help": captured(lambda: module_main(["tune", "--help"]))[1],
    }
    assert all(text.strip() for text in pages.values()), [name for name, text in pages.items() if not text.strip()]
    return pages


def all_rows() -> dict[str, list[Row]]:
    """The rows of every table the help pages show: the jobs' configs and every config group."""
    folder = conf_dir()
    tables: dict[str, list[Row]] = {}
    for job in ("evaluate", "train_backbone", "predict"):
        tables[job] = job_rows(job, skip=("method",) if job == "evaluate" else ())
    for group in ("method", "data", "backbone"):
        types = {f"{group}.{key}": kind for key, kind in job_types(group).items()}
        for name in group_options(group):
            path = folder / group / f"{name}.yaml"
            prefix = f"method.{name}." if group == "method" else f"{group}."
            tables[f"{group}/{name}"] = rows(OmegaConf.load(path), yaml_comments(path, prefix), prefix, types=types)
    return tables


def squeezed(text: str) -> str:
    """``text`` without any whitespace: wrapping may move words to other lines but must not drop any."""
    return "".join(text.split())


@pytest.mark.parametrize("columns", [40, 60, 80, 100, 200])
def test_every_help_line_fits_the_terminal(monkeypatch, columns: int) -> None:
    """Kills: rows printed unwrapped (300-500 characters), or a width that ignores $COLUMNS or exceeds the cap."""
    monkeypatch.setenv("COLUMNS", str(columns))
    limit = max(MIN_WIDTH, min(MAX_WIDTH, columns))
    for name, text in help_pages().items():
        long = [line for line in text.splitlines() if len(line) > limit]
        assert not long, f"{name} at COLUMNS={columns}: {len(long)} lines over {limit}, e.g. {long[0]!r}"


def test_piped_help_stays_within_the_readable_width(monkeypatch) -> None:
    """No $COLUMNS and no terminal (pytest captures stdout): the help wraps at MAX_WIDTH, not at 80 or never."""
    monkeypatch.delenv("COLUMNS", raising=False)
    text = run_in_process("evaluate", ["--help"]).stdout
    widths = [len(line) for line in text.splitlines()]
    assert max(widths) <= MAX_WIDTH
    assert max(widths) > 80  # the room is used: a piped page is not squeezed to the narrow layout


def test_evaluate_help_names_the_predict_subcommand(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    text = run_in_process("evaluate", ["--help"]).stdout
    usage = text.split("Keys of conf/evaluate.yaml")[0]
    assert "python evaluate.py predict" in usage and "python evaluate.py predict --help" in usage


@pytest.mark.parametrize("columns", [60, 100])
def test_defaults_and_meanings_are_shown_in_full(monkeypatch, columns: int) -> None:
    """Kills: a default cut to its column (`['putm', 'simpleshot', …`) or a comment truncated by the wrapping."""
    monkeypatch.setenv("COLUMNS", str(columns))
    pages = help_pages()
    shown = {"evaluate": pages["evaluate.py --help"], "train_backbone": pages["train_backbone.py --help"],
             "predict": pages["evaluate.py predict --help"]}
    for table, table_rows in all_rows().items():
        text = squeezed(shown.get(table, shown["evaluate" if table.startswith("method/") else "train_backbone"]))
        for key, kind, default, meaning in table_rows:
            assert squeezed(f"{key}{kind}{default}") in text, (table, key)
            assert squeezed(meaning) in text, (table, key, meaning)
    methods = show(OmegaConf.load(conf_dir() / "evaluate.yaml").methods)
    assert methods.startswith("[") and methods.endswith("]") and methods in pages["evaluate.py --help"]


def test_every_key_has_a_type_a_user_can_act_on() -> None:
    """A null default still says what to give (checkpoint: path); no Python class names (DictConfig).
    Kills: dropping the key-type table or the methods' signatures as the schema of their null defaults."""
    typed = {row[0]: row[1] for table in all_rows().values() for row in table}
    vague = sorted(key for key, kind in typed.items() if kind in ("null", "NoneType", "DictConfig", "ListConfig", ""))
    assert not vague, f"keys without a meaningful type: {vague}"
    assert typed["checkpoint"] == "path" and typed["output_dir"] == "path|auto" and typed["queries"] == "int"
    assert typed["method.putm.rho"] == "float" and typed["method.bdcspn.top_z"] == "int"
    assert typed["method.tim.loss_weights"] == "list" and typed["method.laplacianshot.proto_rect"] == "bool"
    assert typed["data.options"] == "mapping" and typed["init_from"] == "path"


def test_defaults_are_written_as_on_the_command_line() -> None:
    assert show(None) == "null" and show(True) == "true" and show(False) == "false"
    assert show(OmegaConf.create({"x": [2, "balanced"]}).x) == "[2, balanced]"
    assert show(OmegaConf.create({})) == "{}" and show(0.0001) == "0.0001"


def test_a_long_default_gets_its_own_lines_and_the_meaning_keeps_its_column() -> None:
    table = [("methods", "list", "[putm, simpleshot, ptmap, tim, alpha_tim, bdcspn]", "any of: " + "word " * 30),
             ("ways", "int", "5", "")]
    lines = format_rows(table, width=100).splitlines()
    assert lines[0].startswith("  methods  list  [putm, simpleshot, ptmap, tim, alpha_tim, bdcspn]")
    meaning_column = lines[1].index("any of")
    assert all(len(line) <= 100 for line in lines)
    assert all(line[:meaning_column].strip() == "" for line in lines[1:-1])  # meaning lines, in one column
    assert lines[-1].split() == ["ways", "int", "5"]


def test_module_help_goes_to_stdout_and_an_unknown_command_suggests_one() -> None:
    code, out, err = captured(lambda: module_main(["--help"]))
    assert code == 0 and err == ""
    assert "study" in out and "tune" in out and "<command> --help" in out and "python evaluate.py predict --help" in out
    code, out, err = captured(lambda: module_main(["stduy"]))
    assert code == 2 and out == ""
    assert err.strip() == ("error: unknown command 'stduy'; did you mean study? commands: evaluate, train, predict, "
                           "study, tune, compare-presets, combine-tunes, sensitivity-figure, navigator-confidence, "
                           "table, fit-unem")


def test_study_help_lists_every_option_the_parser_accepts() -> None:
    """Kills: an option of ``study`` that its help does not describe (``--heartbeat`` and ``--grace`` were missing)."""
    from lightning_putm.studies import study  # its parse_options reads the options

    _, text, _ = captured(lambda: module_main(["study", "--help"]))
    source = Path(study.__file__).read_text()
    accepted = {name for name in ("--storage", "--dir", "--max-runs", "--heartbeat", "--grace", "--summary-only")
                if f'"{name}"' in source}
    assert accepted and all(name in text for name in accepted), accepted
