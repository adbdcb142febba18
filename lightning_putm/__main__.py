"""``python -m lightning_putm <command> ...``: the jobs that have no script of their own.

    python -m lightning_putm study conf/sweep/putm_sensitivity.yaml checkpoint=/path/to/best.ckpt

``python -m lightning_putm --help`` lists the commands, ``python -m lightning_putm <command> --help`` one command's
arguments (both wrapped to the terminal).
"""

from __future__ import annotations

import sys

from lightning_putm.cli import EXIT_USER_ERROR, run_cli

COMMANDS = {"study": "run a sweep file (conf/sweep/*.yaml) as a resumable study, offline or with W&B",
            "tune": "choose hyper-parameters on a checkpoint's validation classes; write a config evaluate.py runs"}

HELP_FLAGS = ("-h", "--help", "help")

STUDY_OPTIONS = [
    ("key=value", "fixes an evaluate.py argument for every run (a swept key given here is no longer swept)"),
    ("--storage URL", "Optuna storage (default: sqlite:///<dir>/study.db; postgresql://... for several machines)"),
    ("--dir DIR", "the study's folder (default outputs/studies/<sweep name>): storage, runs/, summary.*"),
    ("--max-runs N", "stop after N runs in this process (random/bayes sweeps: the run cap)"),
    ("--heartbeat S", "seconds between the heartbeats of a running run (default 10)"),
    ("--grace S", "seconds without a heartbeat after which a run counts as failed and its point is free again "
                  "(default 30)"),
    ("--summary-only", "write the summary of what has finished, run nothing"),
]

TUNE_OPTIONS = [
    ("checkpoint=CKPT", "required: the backbone whose validation split the sweep's points are evaluated on"),
    ("key=value", "fixes an evaluate.py argument for every run (split is always val)"),
    ("--dir DIR", "the tuning folder (default outputs/tune/<sweep name>)"),
    ("--test", "also evaluate the selected setting and the defaults on the test split; writes <dir>/selection.md"),
    ("--prefer KEY=max|min", "among points whose metric ties with the best (within 0.005), pick by a swept key "
                             "(e.g. the more conservative value)"),
    ("--storage URL", "Optuna storage, as for study"),
]


def overview() -> str:
    """``python -m lightning_putm --help``: the commands, and where the scripts' own help is."""
    from lightning_putm.help import help_width, paragraph, two_columns

    width = help_width()
    return "\n".join(["usage: python -m lightning_putm <command> [arguments]", "", "commands:",
                      two_columns(list(COMMANDS.items()), width), "",
                      paragraph("python -m lightning_putm <command> --help lists a command's arguments; "
                                "python evaluate.py --help, python evaluate.py predict --help and "
                                "python train_backbone.py --help list the scripts' keys.", width)])


def command_help(summary: str, command_line: str, options: list[tuple[str, str]], after: str = "") -> str:
    """One command's ``--help``: what it does, how it is called, its arguments."""
    from lightning_putm.help import help_width, paragraph, two_columns, usage

    width = help_width()
    body = [paragraph(summary, width), "", usage([(command_line, "")], width), "", "arguments:",
            two_columns(options, width)]
    return "\n".join(body + (["", paragraph(after, width)] if after else []))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        asked = args[:1] and args[0] in HELP_FLAGS
        if args and not asked:
            from lightning_putm.validators import did_you_mean

            print(f"error: unknown command {args[0]!r}; {did_you_mean(args[0], COMMANDS)}commands: "
                  f"{', '.join(COMMANDS)}", file=sys.stderr)
            return EXIT_USER_ERROR
        print(overview(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else EXIT_USER_ERROR
    command, rest = args[0], args[1:]
    if command == "study":
        from lightning_putm.jobs.study import run_study

        def study(argv: list[str]) -> None:
            """Run a sweep file as a resumable study (Optuna storage; W&B offline or online) and summarise it."""
            run_study(argv)

        return run_cli(study, rest, help_text=lambda summary: command_help(
            summary, "python -m lightning_putm study SWEEP.yaml [key=value ...] [--option ...]", STUDY_OPTIONS,
            "Run the same command in more processes or on more machines (same storage) to share the runs."))
    if command == "tune":
        from lightning_putm.jobs.tune import run_tune

        def tune(argv: list[str]) -> None:
            """Select hyper-parameters on validation classes (never the test classes) and write selected.yaml:
            the best run's config, switched to split=test, for `python evaluate.py config=<dir>/selected.yaml`."""
            run_tune(argv)

        return run_cli(tune, rest, help_text=lambda summary: command_help(
            summary, "python -m lightning_putm tune SWEEP.yaml checkpoint=CKPT [key=value ...] [--option ...]",
            TUNE_OPTIONS, "Runs the sweep's points as a study on the checkpoint's validation split."))
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
