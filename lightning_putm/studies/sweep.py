"""A sweep file (W&B's format: ``method``, ``metric``, ``parameters``) read into the points a study runs, and
the metric names a study can optimise (``fewshot/<method>/<k>shot/alpha_<a>/acc``)."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from lightning_putm.config import Overrides
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.report import worst_gain
from lightning_putm.runs import slug
from lightning_putm.validators import did_you_mean


METHODS = ("grid", "random", "bayes")


#: ``fewshot/<method>/acc`` (mean over the run's settings), ``fewshot/<method>/<k>shot/alpha_<a>/acc``, or
#: ``fewshot/<method>/worst_gain_over_<other>`` (the run's smallest accuracy margin over ``other``, in points).
METRIC = re.compile(r"^fewshot/(?P<method>[a-z_]+)(/(?P<shots>\d+)shot/alpha_(?P<alpha>[^/]+))?/acc$"
                    r"|^fewshot/(?P<gainer>[a-z_]+)/worst_gain_over_(?P<other>[a-z_]+)$")


METRIC_FORMS = ("fewshot/<method>/acc, fewshot/<method>/<k>shot/alpha_<a>/acc or "
                "fewshot/<method>/worst_gain_over_<other>")


#: Arguments the study sets itself for every run.
STUDY_OWNED = ("output_dir",)


@dataclass
class Sweep:
    """A sweep file, checked: fixed arguments, swept parameters and the metric."""

    name: str
    method: str
    metric: str
    goal: str
    fixed: dict[str, Any]
    swept: dict[str, dict[str, Any]]  # name -> {"values": [...]} or a distribution
    run_cap: int | None = None
    path: Path | None = None
    extra: tuple[str, ...] = ()  # command-line key=value arguments, passed to every run as typed
    #: Keys the file sweeps that the command line fixes, with the values as typed: part of each point's key (the
    #: runs of ``rho=0.5`` are not those of ``rho=0.7``), not of the study's fixed settings.
    pinned: dict[str, str] = field(default_factory=dict)


    def key(self, point: dict[str, Any]) -> str:
        """The key a point's run is filed under (:func:`point_key`), with the values the command line pinned."""
        return point_key({**point, **self.pinned})

    def points(self) -> list[dict[str, Any]]:
        """Every grid point, in the file's order (``method: grid`` only)."""
        names = list(self.swept)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.swept[n]["values"] for n in names))]


def read_sweep(path: Path, overrides: Sequence[str] = ()) -> Sweep:
    """A sweep file with command-line ``key=value`` arguments; a swept key given there is fixed to that value."""
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}; give one of conf/sweep/*.yaml or your own")
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if str(spec.get("program", "evaluate.py")) != "evaluate.py":
        raise ConfigError(f"{path}: program must be evaluate.py, got {spec.get('program')!r}")
    method = str(spec.get("method", ""))
    if method not in METHODS:
        hint = did_you_mean(method, METHODS).strip()
        raise ConfigError(f"{path}: method must be one of {', '.join(METHODS)}, got {method!r}"
                          + (f"; {hint}" if hint else ""))
    metric = spec.get("metric") or {}
    name = str(metric.get("name", ""))
    if not METRIC.match(name):
        raise ConfigError(f"{path}: metric.name must be {METRIC_FORMS}, got {name!r}")
    goal = str(metric.get("goal", "maximize"))
    if goal not in ("maximize", "minimize"):
        raise ConfigError(f"{path}: metric.goal must be maximize or minimize, got {goal!r}")
    fixed: dict[str, Any] = {}
    swept: dict[str, dict[str, Any]] = {}
    for key, options in (spec.get("parameters") or {}).items():
        if not isinstance(options, dict):
            raise ConfigError(f"{path}: parameters.{key} must be a mapping like {{value: ...}} or {{values: [...]}}")
        if "value" in options:
            fixed[key] = options["value"]
        elif "values" in options:
            if not options["values"]:
                raise ConfigError(f"{path}: parameters.{key}.values is empty")
            swept[key] = {"values": list(options["values"])}
        elif method == "grid":
            raise ConfigError(f"{path}: parameters.{key}: a grid sweep needs `values` (or a fixed `value`)")
        else:
            swept[key] = _distribution(path, key, options)
    given = Overrides.parse(overrides)
    pinned = {override.key: override.raw for override in given if override.key in swept}
    for override in given:
        if override.key in STUDY_OWNED:
            raise ConfigError(f"{override.key}: the study gives every run its own folder under the study's folder; "
                              "use --dir")
        swept.pop(override.key, None)
        fixed.pop(override.key, None)
    extra = given.texts()  # as typed: evaluate.py reads it (checkpoint=null stays null, not the text None)
    for key in STUDY_OWNED:
        fixed.pop(key, None)
    if not swept:
        raise ConfigError(f"{path}: nothing is swept (no parameter has `values` or a distribution)")
    run_cap = spec.get("run_cap")
    sweep = Sweep(str(spec.get("name") or path.stem), method, name, goal, fixed, swept,
                  None if run_cap is None else int(run_cap), path, tuple(extra), pinned)
    match = METRIC.match(name)
    methods_given = given.last("methods")
    methods = str(methods_given.raw if methods_given else fixed.get("methods", ""))
    listed = [m.strip(" '\"") for m in methods.strip("[] ").split(",")]
    for needed in (match.group("method"), match.group("gainer"), match.group("other")):
        if needed and ("methods" in fixed or methods_given) and needed not in listed:
            raise ConfigError(f"{path}: the metric {name} needs method {needed} in `methods` ({methods})")
    return sweep


def _distribution(path: Path, key: str, options: dict[str, Any]) -> dict[str, Any]:
    kind = options.get("distribution")
    if kind is None and "min" in options and "max" in options:
        kind = "int_uniform" if all(isinstance(options[b], int) for b in ("min", "max")) else "uniform"
    if kind not in ("uniform", "int_uniform", "log_uniform_values"):
        raise ConfigError(f"{path}: parameters.{key}: distribution {kind!r} is not supported here; use values, "
                          "uniform, int_uniform or log_uniform_values (min, max)")
    low, high = options.get("min"), options.get("max")
    if low is None or high is None or not float(low) < float(high):
        raise ConfigError(f"{path}: parameters.{key} needs min < max, got min={low}, max={high}")
    return {"distribution": kind, "min": low, "max": high}


def agent_arguments(point: dict[str, Any]) -> list[str]:
    """``key=value`` arguments exactly as the W&B agent passes them to ``evaluate.py`` (its own formatter)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    return create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})["args_no_hyphens"]


def point_key(point: dict[str, Any]) -> str:
    """A folder name for a point: readable swept values, then a short hash of the whole point."""
    digest = hashlib.sha256(json.dumps(point, sort_keys=True, default=str).encode()).hexdigest()[:10]
    readable = "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
    return f"{slug(readable, 80)}-{digest}"


def metric_value(metric: str, summaries: Sequence[Any]) -> float:
    """The metric of one run from its per-setting summaries: one setting's accuracy, the mean over the run's, or
    the worst margin of one method over another (:func:`~lightning_putm.evaluation.report.worst_gain`)."""
    match = METRIC.match(metric)
    if match.group("gainer"):
        try:
            return float(worst_gain(summaries, match.group("gainer"), match.group("other")))
        except ValueError as exc:
            raise ConfigError(f"the run cannot give {metric}: {exc}; check the sweep's methods") from exc
    chosen = [s for s in summaries if s.method == match.group("method")
              and (match.group("shots") is None or (str(s.shots) == match.group("shots")
                                                   and s.alpha_label == match.group("alpha")))]
    if not chosen:
        raise ConfigError(f"the run logged no {metric}: check the sweep's methods, shots and alphas")
    return float(sum(s.accuracy for s in chosen) / len(chosen))


def metric_parts(metric: str) -> dict[str, str | None]:
    """The named parts of a study metric (``method``, ``shots``, ``alpha``, ``gainer``, ``other``; unused ones
    ``None``): what the summary needs to compute its CI and SimpleShot's value of the same metric."""
    match = METRIC.match(metric)
    if match is None:
        raise ConfigError(f"metric must be {METRIC_FORMS}, got {metric!r}")
    return {k: match.group(k) for k in ("method", "shots", "alpha", "gainer", "other")}
