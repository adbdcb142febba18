"""``python -m lightning_putm tune``: a study on validation classes, its best point checked on test classes
(:mod:`lightning_putm.studies.tune`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence


from lightning_putm.atomic import atomic_write_text
from lightning_putm.config import Overrides, load_yaml
from lightning_putm.errors import ConfigError
from lightning_putm.runs import slug
from lightning_putm.studies.study import Study, parse_options
from lightning_putm.studies.summary_report import write_study_summary
from lightning_putm.studies.sweep import metric_parts, read_sweep
from lightning_putm.studies.tune import TIE, TUNE_ROOT, _take_prefer, _test_report, select_best


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
    conditions = [key for key in sweep.swept if not key.startswith("method.")]
    if conditions:  # a selection over them would compare, say, 1-shot accuracy with 5-shot accuracy
        given = " ".join(f"{key}=..." for key in conditions)
        raise ConfigError(f"tune selects methods' settings (method.<name>.<option>), but {sweep.name} also sweeps "
                          f"{', '.join(conditions)}: points would be compared under different conditions. Fix "
                          f"{'it' if len(conditions) == 1 else 'them'} on the command line ({given}, e.g. "
                          "alphas=[2,balanced]: every run then covers those values)")
    if prefer is not None and prefer[0] not in sweep.swept:
        raise ConfigError(f"--prefer {prefer[0]}: not a swept parameter of {sweep.name} "
                          f"(swept: {', '.join(sweep.swept)})")
    given = Overrides.parse(sweep.extra)  # command-line arguments, as typed
    split_given, checkpoint_given = given.last("split"), given.last("checkpoint")
    split = split_given.raw if split_given else str(sweep.fixed.get("split", "val"))
    if split != "val":
        raise ConfigError(f"tune selects on the validation classes: split must be val, got split={split} "
                          "(drop split= from the sweep file and the command line)")
    if (checkpoint_given.raw if checkpoint_given else sweep.fixed.get("checkpoint")) in (None, "", "null", "None"):
        raise ConfigError("tune needs checkpoint=/path/to/best.ckpt: it evaluates the checkpoint's validation split")
    sweep.fixed["split"] = "val"
    sweep.extra = tuple(given.partition(lambda o: o.key == "split")[1].texts())
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
