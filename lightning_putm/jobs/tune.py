"""Select hyper-parameters on validation classes, never on the test classes (``python -m lightning_putm tune``).

A sweep file's points are evaluated as a study (:mod:`lightning_putm.jobs.study`) on episodes of the checkpoint's
**validation** split. The best point's run config, switched to the test split, is written as ``selected.yaml``,
which ``evaluate.py config=<dir>/selected.yaml`` accepts. With ``--test`` the selected setting and the defaults
(the sweep's fixed arguments without the swept keys) are then evaluated once each on the test split, on the same
seeded episodes, and ``selection.md`` puts validation and test accuracy side by side.

    python -m lightning_putm tune conf/sweep/putm_sensitivity.yaml checkpoint=/path/to/best.ckpt --test
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from lightning_putm.atomic import atomic_write_text
from lightning_putm.config import load_yaml, split_override
from lightning_putm.errors import ConfigError
from lightning_putm.jobs.study import (STUDY_ROOT, Study, agent_arguments, metric_parts, metric_value, parse_options,
                                      read_sweep)
from lightning_putm.evaluation.study_summary import write_study_summary
from lightning_putm.runs import slug

TUNE_ROOT = STUDY_ROOT.parent / "tune"


def run_tune(argv: Sequence[str], log: Callable[[str], None] = print,
             run: Callable[[list[str]], Sequence[Any]] | None = None) -> Path:
    """``python -m lightning_putm tune SWEEP.yaml checkpoint=CKPT [key=value ...] [--dir DIR] [--test]
    [--prefer KEY=max|min]``."""
    args = list(argv)
    test = "--test" in args
    args = [a for a in args if a != "--test"]
    args, prefer = _take_prefer(args)
    options, rest = parse_options(args)
    if not rest:
        raise ConfigError("give a sweep file: python -m lightning_putm tune conf/sweep/<name>.yaml checkpoint=... ")
    sweep = read_sweep(Path(rest[0]), rest[1:])
    if prefer is not None and prefer[0] not in sweep.swept:
        raise ConfigError(f"--prefer {prefer[0]}: not a swept parameter of {sweep.name} "
                          f"(swept: {', '.join(sweep.swept)})")
    given = dict(split_override(t) for t in sweep.extra)  # command-line arguments, as typed
    split = str(given.get("split", sweep.fixed.get("split", "val")))
    if split != "val":
        raise ConfigError(f"tune selects on the validation classes: split must be val, got split={split} "
                          "(drop split= from the sweep file and the command line)")
    if given.get("checkpoint", sweep.fixed.get("checkpoint")) in (None, "", "null", "None"):
        raise ConfigError("tune needs checkpoint=/path/to/best.ckpt: it evaluates the checkpoint's validation split")
    sweep.fixed["split"] = "val"
    sweep.extra = tuple(t for t in sweep.extra if split_override(t)[0] != "split")
    if sweep.method != "grid" and options.get("max_runs") is not None:
        sweep.run_cap = int(options["max_runs"])
    folder = Path(options.get("dir") or TUNE_ROOT / slug(sweep.name))
    study = Study(sweep, folder, options.get("storage"), int(options.get("heartbeat", 10)),
                  int(options.get("grace", 30)), log=log)
    study.check()
    if run is None:
        from lightning_putm.jobs.evaluate import run_evaluate

        def run(args: list[str]) -> Sequence[Any]:
            return run_evaluate(args, log=lambda line: None)

    study.run(run)
    rows = study.rows()
    write_study_summary(rows, sweep.metric, sweep.goal, list(sweep.swept), folder, f"{sweep.name} (validation)",
                        metric_parts(sweep.metric))
    if not rows:
        raise ConfigError(f"no run of {sweep.name} finished; nothing to select")
    best, tied = select_best(rows, sweep.goal, prefer)
    if len(tied) > 1:
        log(f"tune {sweep.name}: {len(tied)} points tie on validation (within {TIE} of the best): "
            + "; ".join(str(r.point) for r in tied)
            + ("" if prefer else "; the first is taken, --prefer KEY=max|min chooses among them"))
    selected = load_yaml(Path(best.output_dir) / "config.yaml")
    for key in ("provenance",):
        selected.pop(key, None)
    selected.split, selected.output_dir = "test", "auto"
    selected.name = f"{slug(sweep.name)}-selected"
    target = folder / "selected.yaml"
    from omegaconf import OmegaConf

    tie_note = (f"; {len(tied)} points tied, " + (f"--prefer {prefer[0]}={prefer[1]}" if prefer else "the first taken")
                if len(tied) > 1 else "")
    header = (f"# selected on validation episodes by `python -m lightning_putm tune {rest[0]}`: "
              f"{best.point} ({sweep.metric} = {best.metric:.2f} on val{tie_note})\n")
    atomic_write_text(target, header + OmegaConf.to_yaml(selected))
    log(f"tune {sweep.name}: selected {best.point} ({sweep.metric} {best.metric:.2f} on validation); "
        f"evaluate it with: python evaluate.py config={target}")
    if test:
        lines = _test_report(sweep, best, rows, folder, run, log)
        atomic_write_text(folder / "selection.md", "\n".join(lines) + "\n")
        log("\n".join(lines))
    return folder


#: Metrics closer than this to the best count as a tie (they print the same at two decimals).
TIE = 0.005


def select_best(rows: Sequence[Any], goal: str, prefer: tuple[str, str] | None = None) -> tuple[Any, list[Any]]:
    """The best row and the rows that tie with it (within :data:`TIE`), best first.

    Without ``prefer`` the best is the row with the best metric (the first of equals). With ``prefer=(key, "max")``
    (or ``"min"``) it is the tied row with the largest (smallest) value of that swept key: when validation cannot
    tell points apart, the user says which way to lean (e.g. the more conservative value).
    """
    sign = 1.0 if goal == "maximize" else -1.0
    exact = max(rows, key=lambda r: sign * r.metric)
    tied = [exact, *(r for r in rows if r is not exact and sign * r.metric >= sign * exact.metric - TIE)]
    if prefer is None:
        return exact, tied
    key, direction = prefer
    pick = max if direction == "max" else min
    return pick(tied, key=lambda r: float(r.point[key])), tied


def _take_prefer(args: list[str]) -> tuple[list[str], tuple[str, str] | None]:
    """``--prefer KEY=max|min`` (or ``--prefer=KEY=max``) out of the arguments, checked."""
    rest: list[str] = []
    value = None
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--prefer" or arg.startswith("--prefer="):
            value = arg.partition("=")[2] if arg.startswith("--prefer=") else (
                args[index + 1] if index + 1 < len(args) else "")
            index += 1 if arg.startswith("--prefer=") else 2
            continue
        rest.append(arg)
        index += 1
    if value is None:
        return rest, None
    key, _, direction = value.rpartition("=")
    if not key or direction not in ("max", "min"):
        raise ConfigError(f"--prefer takes KEY=max or KEY=min (e.g. --prefer method.putm.support_weight=max), "
                          f"got {value!r}")
    return rest, (key, direction)


def _test_report(sweep: Any, best: Any, rows: Sequence[Any], folder: Path,
                 run: Callable[[list[str]], Sequence[Any]], log: Callable[[str], None]) -> list[str]:
    """Selected setting vs the defaults on the test split: same seed, same episodes."""
    fixed = {**sweep.fixed, "split": "test"}
    selected = run([*agent_arguments({**fixed, **best.point}), *sweep.extra, f"output_dir={folder / 'test' / 'selected'}"])
    defaults = run([*agent_arguments(fixed), *sweep.extra, f"output_dir={folder / 'test' / 'defaults'}"])
    selected_test = metric_value(sweep.metric, [r.summary() for r in selected])
    default_test = metric_value(sweep.metric, [r.summary() for r in defaults])
    default_rows = [r for r in rows if all(_is_default(k, v) for k, v in r.point.items())]
    default_val = f"{default_rows[0].metric:.2f}" if default_rows else "—"
    return [f"# Selection of {sweep.name} on validation classes", "",
            f"metric `{sweep.metric}`; selected on the validation split, reported on the test split (same seed).", "",
            "| setting | validation | test |", "|---|---|---|",
            f"| selected: {yaml.safe_dump(best.point, default_flow_style=True).strip()} | {best.metric:.2f} | "
            f"{selected_test:.2f} |",
            f"| defaults | {default_val} | {default_test:.2f} |"]


@lru_cache(maxsize=1)
def _defaults() -> Any:
    from lightning_putm.evaluation.settings import load_evaluate_config

    return load_evaluate_config([])


def _is_default(key: str, value: Any) -> bool:
    """Whether a swept value equals the evaluate.py default (so the defaults' validation score can be shown)."""
    from omegaconf import OmegaConf

    return OmegaConf.select(_defaults(), key, default=object()) == value
