"""``python -m lightning_putm table RUN_DIR...``: finished evaluate.py runs merged into one Table-1-style table.

    python -m lightning_putm table outputs/omniglot outputs/digits --label outputs/digits="digits pixels" \\
        --format latex --output table.tex

Rows are methods, in the project's method order. Columns are (source, shot) pairs, the source being what a run
evaluated (a checkpoint, a feature file, the demo; --label renames it). One block of rows per setting: Dirichlet
alpha, balanced, and any further protocol key of SETTING_KEYS. A cell is results.csv's mean accuracy ± 95% CI,
checked against a recomputation from per_task.csv. In each column the best mean is bold, the second underlined,
and a mark goes on every result that a paired t-test over the column's shared tasks, Holm-corrected over the
column's comparisons, does not tell apart from the column's best (docs/tables.md says why a paired t-test).

Before writing anything it refuses runs whose episode banks differ for a cell they share (seed, ways, queries,
protocol, task count, or the tasks' classes and query counts), a run without per_task.csv, files out of step with
each other, and one result (method, source, shot, setting) given twice with different numbers.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from lightning_putm.errors import ConfigError
from lightning_putm.studies.significance import holm, paired_t_pvalue
from lightning_putm.studies.table_runs import (SETTING_KEYS, Column, Result, RowKey, Setting, Table, make_table,
                                               method_order)

FORMATS = ("markdown", "latex", "csv")
MISSING = "—"


# --------------------------------------------------------------------------------------------- marks
@dataclass(frozen=True)
class Verdict:
    """A result's marks in its column."""

    best: bool = False
    second: bool = False
    reference: bool = False  # the column's best mean: the others are tested against it
    p_value: float | None = None  # raw paired-t p-value against the reference
    p_holm: float | None = None
    not_different: bool | None = None  # None: not tested (the reference itself, an oracle-prior row)


def column_verdicts(entries: Mapping[RowKey, Result], decimals: int = 2, level: float = 0.05) -> dict[RowKey, Verdict]:
    """Best and second by the mean as printed (equal printed means tie), and the paired tests against the best.

    Oracle-prior rows are shown but neither ranked nor tested: they were given the true query counts."""
    ranked = {row: result for row, result in entries.items() if not row.oracle_prior}
    verdicts = {row: Verdict() for row in entries}
    if not ranked:
        return verdicts
    shown = {row: float(f"{result.accuracy:.{decimals}f}") for row, result in ranked.items()}
    levels = sorted(set(shown.values()), reverse=True)
    order = method_order(ranked)
    reference = max(order, key=lambda row: (ranked[row].accuracy, -order.index(row)))
    others = [row for row in order if row != reference]
    raw = [paired_t_pvalue(ranked[reference].per_task, ranked[row].per_task) for row in others]
    adjusted = dict(zip(others, holm(raw)))
    raw_of = dict(zip(others, raw))
    for row in ranked:
        tested = row != reference
        verdicts[row] = Verdict(best=shown[row] == levels[0], second=len(levels) > 1 and shown[row] == levels[1],
                                reference=not tested, p_value=raw_of.get(row), p_holm=adjusted.get(row),
                                not_different=adjusted[row] > level if tested else None)
    return verdicts


def all_verdicts(table: Table, decimals: int, level: float) -> dict[tuple[Setting, Column, RowKey], Verdict]:
    out = {}
    for setting in table.settings:
        for column in table.columns:
            entries = {row: table.results[(setting, column, row)] for row in table.rows
                       if (setting, column, row) in table.results}
            for row, verdict in column_verdicts(entries, decimals, level).items():
                out[(setting, column, row)] = verdict
    return out


# --------------------------------------------------------------------------------------------- rendering
@dataclass(frozen=True)
class Options:
    decimals: int = 2
    level: float = 0.05
    time: bool = False
    caption: str | None = None


def format_seconds(value: float) -> str:
    if not math.isfinite(value):
        return MISSING
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def block_rows(table: Table, setting: Setting) -> list[RowKey]:
    return [row for row in table.rows if any((setting, c, row) in table.results for c in table.columns)]


def row_time(table: Table, setting: Setting, row: RowKey) -> float:
    """Seconds per 1000 tasks of a row, averaged over its cells of the block."""
    values = [table.results[(setting, c, row)].seconds_per_1000 for c in table.columns
              if (setting, c, row) in table.results]
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def tasks_text(table: Table) -> str:
    counts = sorted({r.tasks for r in table.results.values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


def devices_text(table: Table) -> str:
    return "; ".join(sorted({r.device for r in table.results.values() if r.device})) or "devices not recorded"


def legend(table: Table, options: Options, bold: str, second: str, mark: str) -> str:
    """What the table shows, in words (the Markdown note and the LaTeX caption's text); ``bold``, ``second`` and
    ``mark`` are the marks as the format writes them."""
    text = (f"Accuracy (%) ± 95% CI over {tasks_text(table)} tasks per cell. {bold}: best of its column; "
            f"{second}: second; {mark}: not significantly different from the column's best (paired t-test over the "
            f"same tasks, Holm-corrected over the column's comparisons, p > {options.level:g}).")
    if any(row.oracle_prior for row in table.rows):
        text += " Oracle-prior rows were given the true query counts and are not ranked."
    if options.time:
        text += (" Time: seconds per 1000 tasks, the mean over the row's columns of the block, measured on "
                 f"{devices_text(table)}.")
    return text


def cell_text(result: Result | None, verdict: Verdict | None, decimals: int, bold: Callable[[str], str],
              second: Callable[[str], str], mark: str, pm: str) -> str:
    if result is None or verdict is None:
        return MISSING
    mean = f"{result.accuracy:.{decimals}f}"
    mean = bold(mean) if verdict.best else second(mean) if verdict.second else mean
    return f"{mean}{pm}{result.ci95:.{decimals}f}" + (mark if verdict.not_different else "")


def markdown_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "\\|*_`<>[]" else ch for ch in text)


def render_markdown(table: Table, options: Options) -> str:
    """One Markdown table per setting under a bold heading, after a note saying what the marks mean."""
    verdicts = all_verdicts(table, options.decimals, options.level)
    lines = [legend(table, options, "**Bold**", "<ins>underlined</ins>", "†"), ""]
    for setting in table.settings:
        head = ["Method"] + [f"{markdown_escape(c.source)} {c.shots}-shot" for c in table.columns] \
            + (["time (s / 1000 tasks)"] if options.time else [])
        lines += [f"**{markdown_escape(setting.label)}**", "", "| " + " | ".join(head) + " |",
                  "|:---|" + ":---:|" * len(table.columns) + ("---:|" if options.time else "")]
        for row in block_rows(table, setting):
            cells = [cell_text(table.results.get((setting, c, row)), verdicts.get((setting, c, row)),
                               options.decimals, lambda s: f"**{s}**", lambda s: f"<ins>{s}</ins>", " †", " ± ")
                     for c in table.columns]
            if options.time:
                cells.append(format_seconds(row_time(table, setting, row)))
            lines.append("| " + " | ".join([markdown_escape(row.name)] + cells) + " |")
        lines.append("")
    return "\n".join(lines)


LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
#: Characters pdflatex's default input encoding does not know, or that its OT1 font encoding prints as other
#: glyphs (``<`` ``>`` ``|``), as LaTeX commands; any other character is written as it is.
LATEX_UNICODE = {"α": r"$\alpha$", "β": r"$\beta$", "γ": r"$\gamma$", "ρ": r"$\rho$", "θ": r"$\theta$",
                 "±": r"$\pm$", "×": r"$\times$", "†": r"$^\dagger$", "≤": r"$\leq$", "≥": r"$\geq$",
                 "–": "--", "—": "---", "<": r"$<$", ">": r"$>$", "|": r"$|$"}


def latex_escape(text: str) -> str:
    """Plain text as LaTeX: the ten special characters escaped, Greek letters and a few symbols as math."""
    return "".join(LATEX_SPECIAL.get(ch) or LATEX_UNICODE.get(ch) or ch for ch in text)


def render_latex(table: Table, options: Options) -> str:
    """A ``table`` environment with a booktabs ``tabular``: a header of sources over shots (``\\cmidrule``), one
    block per setting (its name across the row), ``\\textbf`` best, ``\\underline`` second, ``$^\\dagger$``."""
    verdicts = all_verdicts(table, options.decimals, options.level)
    width = 1 + len(table.columns) + (1 if options.time else 0)
    groups: list[tuple[str, int, int]] = []  # (source, first column, last column), columns counted from 1
    for index, column in enumerate(table.columns, start=2):
        if groups and groups[-1][0] == column.source:
            groups[-1] = (column.source, groups[-1][1], index)
        else:
            groups.append((column.source, index, index))
    caption = latex_escape(options.caption) + " " if options.caption else ""
    caption += latex_escape(legend(table, options, "Bold", "underlined", "†"))
    time_head = "Time (s / 1000 tasks)"
    lines = ["% generated by `python -m lightning_putm table`; needs \\usepackage{booktabs}",
             r"\begin{table}[t]", r"\centering", f"\\caption{{{caption}}}",
             f"\\begin{{tabular}}{{l{'c' * len(table.columns)}{'r' if options.time else ''}}}", r"\toprule",
             " & ".join([""] + [f"\\multicolumn{{{last - first + 1}}}{{c}}{{{latex_escape(source)}}}"
                                for source, first, last in groups] + ([""] if options.time else [])) + r" \\",
             " ".join(f"\\cmidrule(lr){{{first}-{last}}}" for _, first, last in groups),
             " & ".join(["Method"] + [f"{c.shots}-shot" for c in table.columns]
                        + ([time_head] if options.time else [])) + r" \\"]
    for setting in table.settings:
        lines += [r"\midrule", f"\\multicolumn{{{width}}}{{l}}{{\\textit{{{latex_escape(setting.label)}}}}} \\\\",
                  r"\midrule"]
        for row in block_rows(table, setting):
            cells = [cell_text(table.results.get((setting, c, row)), verdicts.get((setting, c, row)),
                               options.decimals, lambda s: f"\\textbf{{{s}}}", lambda s: f"\\underline{{{s}}}",
                               r"$^\dagger$", r" $\pm$ ").replace(MISSING, "--") for c in table.columns]
            if options.time:
                cells.append(format_seconds(row_time(table, setting, row)).replace(MISSING, "--"))
            lines.append(" & ".join([latex_escape(row.name)] + cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    return "\n".join(lines)


CSV_COLUMNS = ["method", "method_name", "oracle_prior", "source", "shots", "setting", *SETTING_KEYS, "accuracy",
               "ci95", "tasks", "seconds_per_1000_tasks", "best", "second", "reference", "not_significantly_different",
               "p_value", "p_holm", "run"]


def render_csv(table: Table, options: Options) -> str:
    """One row per (method, source, shot, setting) with its marks and p-values (empty where not tested)."""
    verdicts = all_verdicts(table, options.decimals, options.level)
    flag = lambda value: "" if value is None else ("true" if value else "false")  # noqa: E731
    number = lambda value: "" if value is None else f"{value:.6g}"  # noqa: E731
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for setting in table.settings:
        given = dict(setting.parts)
        for column in table.columns:
            for row in table.rows:
                result = table.results.get((setting, column, row))
                if result is None:
                    continue
                verdict = verdicts[(setting, column, row)]
                writer.writerow({
                    "method": row.method, "method_name": row.name, "oracle_prior": flag(row.oracle_prior),
                    "source": column.source, "shots": column.shots, "setting": setting.code,
                    **{key: given.get(key, "") for key in SETTING_KEYS},
                    "accuracy": f"{result.accuracy:.4f}", "ci95": f"{result.ci95:.4f}", "tasks": result.tasks,
                    "seconds_per_1000_tasks": number(result.seconds_per_1000),
                    "best": flag(verdict.best), "second": flag(verdict.second), "reference": flag(verdict.reference),
                    "not_significantly_different": flag(verdict.not_different), "p_value": number(verdict.p_value),
                    "p_holm": number(verdict.p_holm), "run": str(result.run)})
    return out.getvalue()


RENDERERS: dict[str, Callable[[Table, Options], str]] = {"markdown": render_markdown, "latex": render_latex,
                                                         "csv": render_csv}


# --------------------------------------------------------------------------------------------- command line
def parse_labels(pairs: Sequence[str], folders: Sequence[Path]) -> dict[Path, str]:
    """``--label RUN_DIR=NAME`` → ``{resolved RUN_DIR: NAME}``; the split is at the ``=`` after which the left side is
    one of the given run folders (a name may hold ``=``)."""
    known = {Path(folder).resolve(): folder for folder in folders}
    labels: dict[Path, str] = {}
    for pair in pairs:
        cuts = [i for i, ch in enumerate(pair) if ch == "="]
        match = next((i for i in cuts if Path(pair[:i]).resolve() in known and pair[i + 1:].strip()), None)
        if match is None:
            raise ConfigError(f"--label {pair}: expected RUN_DIR=NAME with RUN_DIR one of the run folders given "
                              f"({', '.join(map(str, folders))}) and a non-empty NAME")
        labels[Path(pair[:match]).resolve()] = pair[match + 1:].strip()
    return labels


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="output_dir of a finished evaluate.py run (results.csv, per_task.csv, config.yaml)")
    parser.add_argument("--format", choices=FORMATS, default="markdown", help="what to write (default markdown)")
    parser.add_argument("--output", type=Path, metavar="FILE", help="write the table here (default: print it)")
    parser.add_argument("--label", action="append", default=[], metavar="RUN_DIR=NAME",
                        help="name a run's column group (default: its dataset and backbone, feature file or demo); "
                             "runs given the same name are merged")
    parser.add_argument("--time", action="store_true", help="add a column of seconds per 1000 tasks")
    parser.add_argument("--significance", type=float, default=0.05, metavar="LEVEL",
                        help="family-wise level of the paired tests in each column (default 0.05)")
    parser.add_argument("--decimals", type=int, default=2, help="decimals of the means and CIs (default 2)")
    parser.add_argument("--caption", help="text before the LaTeX caption's legend (escaped)")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> str:
    """Write (or print) the table of ``argv``; returns its text."""
    from lightning_putm.atomic import atomic_write_text

    args = build_parser(prog).parse_args(argv)
    if not 0 < args.significance < 1:
        raise ConfigError(f"--significance must be between 0 and 1, got {args.significance}")
    if not 0 <= args.decimals <= 6:
        raise ConfigError(f"--decimals must be between 0 and 6, got {args.decimals}")
    table = make_table(args.runs, parse_labels(args.label, args.runs))
    for note in table.notes:
        print(f"note: {note}", file=sys.stderr)
    text = RENDERERS[args.format](table, Options(args.decimals, args.significance, args.time, args.caption))
    if args.output is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(args.output, text)
        print(f"wrote {args.output}", file=sys.stderr)
    return text
