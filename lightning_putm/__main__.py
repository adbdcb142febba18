"""``python -m lightning_putm <command> ...``: the jobs that have no script of their own.

    python -m lightning_putm study conf/sweep/putm_sensitivity.yaml checkpoint=/path/to/best.ckpt
"""

from __future__ import annotations

import sys

from lightning_putm.cli import run_cli

COMMANDS = {"study": "run a sweep file (conf/sweep/*.yaml) as a resumable study, offline or with W&B",
            "tune": "choose hyper-parameters on a checkpoint's validation classes; write a config evaluate.py runs"}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print("usage: python -m lightning_putm <command> [arguments]\ncommands:\n" +
              "\n".join(f"  {name:8s} {text}" for name, text in COMMANDS.items()), file=sys.stderr)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    command, rest = args[0], args[1:]
    if command == "study":
        from lightning_putm.jobs.study import run_study

        def study(argv: list[str]) -> None:
            """Run a sweep file as a resumable study (Optuna storage; W&B offline or online) and summarise it.

    python -m lightning_putm study SWEEP.yaml [key=value ...] [--storage URL] [--dir DIR] [--max-runs N]
                                   [--heartbeat S] [--grace S] [--summary-only]
  key=value      fixes an evaluate.py argument for every run (a swept key given here is no longer swept)
  --storage URL  Optuna storage (default: sqlite:///<dir>/study.db; postgresql://... for several machines)
  --dir DIR      the study's folder (default outputs/studies/<sweep name>): storage, runs/, summary.*
  --max-runs N   stop after N runs in this process (random/bayes sweeps: the run cap)
  --summary-only write the summary of what has finished, run nothing
Run the same command in more processes or on more machines (same storage) to share the runs."""
            run_study(argv)

        return run_cli(study, rest)
    if command == "tune":
        from lightning_putm.jobs.tune import run_tune

        def tune(argv: list[str]) -> None:
            """Select hyper-parameters on validation classes (never the test classes) and write selected.yaml.

    python -m lightning_putm tune SWEEP.yaml checkpoint=CKPT [key=value ...] [--dir DIR] [--test] [--storage URL]
                                [--prefer KEY=max|min]
  Runs the sweep's points as a study on the checkpoint's validation split (default folder outputs/tune/<sweep>),
  writes <dir>/selected.yaml (the best run's config, switched to split=test) for
  `python evaluate.py config=<dir>/selected.yaml`; --test also evaluates the selected setting and the defaults on
  the test split and writes <dir>/selection.md. Points whose metric ties with the best (within 0.005) are listed;
  --prefer KEY=max|min picks among them by a swept key (e.g. the more conservative value)."""
            run_tune(argv)

        return run_cli(tune, rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
