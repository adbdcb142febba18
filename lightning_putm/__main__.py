"""``python -m lightning_putm <command> ...`` (installed as ``lightning-putm <command> ...``): every job and analysis.

    python -m lightning_putm study conf/sweep/putm_sensitivity.yaml checkpoint=/path/to/best.ckpt
    lightning-putm evaluate features=demo tasks=100
    lightning-putm compare-presets --set "digits pixels" outputs/recommend/a outputs/recommend/b

``evaluate``, ``train`` and ``predict`` run the same code as ``evaluate.py``, ``train_backbone.py`` and
``evaluate.py predict``; ``study`` and ``tune`` have no script of their own; the analyses of finished runs live in
``lightning_putm/studies/``. ``python -m lightning_putm --help`` lists the commands,
``python -m lightning_putm <command> --help`` one command's arguments (both wrapped to the terminal).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_putm.cli import EXIT_USER_ERROR, run_cli

COMMANDS = {"evaluate": "evaluate few-shot methods on balanced and Dirichlet-imbalanced episodes (as evaluate.py)",
            "train": "pretrain a backbone with S2M2 or a plain classifier (as train_backbone.py)",
            "predict": "label your own query images from support folders (as evaluate.py predict)",
            "study": "run a sweep file (conf/sweep/*.yaml) as a resumable study, offline or with W&B",
            "tune": "choose hyper-parameters on a checkpoint's validation classes; write a config evaluate.py runs",
            "compare-presets": "does a PUTM preset ever lose to SimpleShot? table and figure from evaluate.py runs",
            "combine-tunes": "one selection from several tune runs of a sweep (the worst validation metric)",
            "sensitivity-figure": "PUTM against β, ρ and the inertia one at a time: tables and a figure from runs",
            "navigator-confidence": "PUTM's accuracy against its confidence and the support-only nearest mean",
            "table": "a paper table (Markdown, LaTeX, CSV) from evaluate.py runs: best, second, paired significance",
            "fit-unem": "learn UNEM's parameters on validation-class features (cached); prints the option to use"}

#: the analyses of finished runs: command → module of lightning_putm.studies with ``main(argv, prog)``
ANALYSES = {"compare-presets": "compare_presets", "combine-tunes": "combine_tunes",
            "sensitivity-figure": "sensitivity_figure", "navigator-confidence": "navigator_confidence",
            "table": "table",
            "fit-unem": "fit_unem"}

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
                                "python train_backbone.py --help list the scripts' keys. "
                                "After pip install -e . the same commands run as lightning-putm <command>.", width)])


def command_help(summary: str, command_line: str, options: list[tuple[str, str]], after: str = "") -> str:
    """One command's ``--help``: what it does, how it is called, its arguments."""
    from lightning_putm.help import help_width, paragraph, two_columns, usage

    width = help_width()
    body = [paragraph(summary, width), "", usage([(command_line, "")], width), "", "arguments:",
            two_columns(options, width)]
    return "\n".join(body + (["", paragraph(after, width)] if after else []))


def program() -> str:
    """How the user called us, for the analyses' usage lines: the installed command or ``python -m``."""
    return "lightning-putm" if Path(sys.argv[0]).name == "lightning-putm" else "python -m lightning_putm"


def run_analysis(command: str, argv: list[str]) -> int:
    """Run one analysis of :mod:`lightning_putm.studies`; its ``SystemExit("message")`` or a user error
    (:class:`~lightning_putm.errors.LightningPutmError`, e.g. a missing feature file) becomes one error line."""
    import importlib

    from lightning_putm.cli import user_message
    from lightning_putm.errors import LightningPutmError

    module = importlib.import_module(f"lightning_putm.studies.{ANALYSES[command]}")
    try:
        module.main(argv, prog=f"{program()} {command}")
    except SystemExit as exc:  # argparse (--help: 0, a usage error: 2, already printed) or a bad input's message
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(f"error: {exc.code}", file=sys.stderr)
        return EXIT_USER_ERROR
    except LightningPutmError as exc:
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def evaluate(argv: list[str]) -> None:
    """Evaluate few-shot methods (PUTM and its peers) on balanced and Dirichlet-imbalanced episodes, from a
    backbone checkpoint, a feature file or the built-in demo data; every run gets its own folder."""
    from lightning_putm.jobs.evaluate import run_evaluate

    run_evaluate(argv)


def predict(argv: list[str]) -> None:
    """Predict the class of your own query images from labelled support folders (one sub-folder per class) with a
    backbone checkpoint and any few-shot method; writes one CSV row per query and the estimated count per class."""
    from lightning_putm.jobs.predict import run_predict

    run_predict(argv)


def train(argv: list[str]) -> None:
    """Pretrain a backbone with S2M2 (rotation, then manifold mixup + rotation) or a plain classifier; every run
    gets its own checkpoint folder (<checkpoint_dir>/<dataset>/<backbone>/<run>/<stage>/{best,last}.ckpt)."""
    from lightning_putm.pretraining.settings import check_train_arguments

    check_train_arguments(argv)  # config errors before torch and Lightning load
    from lightning_putm.jobs.train import run_train_backbone

    run_train_backbone(argv)


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
    if command in ANALYSES:
        return run_analysis(command, rest)
    if command == "predict" or (command == "evaluate" and rest[:1] == ["predict"]):  # as `evaluate.py predict`
        from lightning_putm.prediction.settings import predict_help

        return run_cli(predict, rest[1:] if command == "evaluate" else rest, help_text=predict_help)
    if command == "evaluate":
        return run_cli(evaluate, rest, job="evaluate")
    if command == "train":
        return run_cli(train, rest, job="train_backbone")
    if command == "study":
        def study(argv: list[str]) -> None:
            """Run a sweep file as a resumable study (Optuna storage; W&B offline or online) and summarise it."""
            from lightning_putm.jobs.study import run_study  # the job loads here: --help needs none of it

            run_study(argv)

        return run_cli(study, rest, help_text=lambda summary: command_help(
            summary, "python -m lightning_putm study SWEEP.yaml [key=value ...] [--option ...]", STUDY_OPTIONS,
            "Run the same command in more processes or on more machines (same storage) to share the runs."))
    if command == "tune":
        def tune(argv: list[str]) -> None:
            """Select hyper-parameters on validation classes (never the test classes) and write selected.yaml:
            the best run's config, switched to split=test, for `python evaluate.py config=<dir>/selected.yaml`."""
            from lightning_putm.jobs.tune import run_tune  # the job loads here: --help needs none of it

            run_tune(argv)

        return run_cli(tune, rest, help_text=lambda summary: command_help(
            summary, "python -m lightning_putm tune SWEEP.yaml checkpoint=CKPT [key=value ...] [--option ...]",
            TUNE_OPTIONS, "Runs the sweep's points as a study on the checkpoint's validation split."))
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
