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

from lightning_putm.errors import ConfigError
from lightning_putm.studies.study import STUDY_ROOT
from lightning_putm.studies.sweep import agent_arguments, metric_value

TUNE_ROOT = STUDY_ROOT.parent / "tune"


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
