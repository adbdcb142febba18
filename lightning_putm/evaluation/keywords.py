"""The few-shot callback's keyword arguments → :class:`EvaluationSettings`, checked as ``evaluate.py`` checks them.

``FewShotEvaluationCallback(methods=["putm"], shots=[1, 5], tasks=500, ...)`` takes the evaluation settings of
``conf/evaluate.yaml`` under the same names and with the same defaults. They are turned into typed overrides of
that file and validated by :func:`~lightning_putm.evaluation.settings.settings_from_config`, the function
``evaluate.py`` uses: one set of checks and messages, whichever way the settings come in. What only
``evaluate.py`` does (reading a checkpoint or a feature file, its logger, its Trainer) is not an argument here:
the callback evaluates the features the user's own module returns, and logs through the user's own Trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from lightning_putm.config import Override, command_line_value
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.settings import (BASE_SPLIT_PREFIX, EvaluationSettings, load_evaluate_config,
                                                settings_from_config)
from lightning_putm.validators import alpha_label, did_you_mean

#: ``conf/evaluate.yaml``'s evaluation settings, taken by the callback as keyword arguments (``method_params`` is the
#: file's ``method`` section: ``method_params={"putm": {"rho": 0.7}}`` is ``method.putm.rho=0.7``).
CALLBACK_KEYS = ("methods", "ways", "shots", "queries", "alphas", "query_classes", "tasks", "seed", "base_features",
                 "oracle_prior", "allow_pickle", "device", "memory_budget_mb", "output_dir", "progress", "plots",
                 "plot_task", "split", "method_params")

#: The other keys of ``conf/evaluate.yaml``, and why the callback does not take them.
_SOURCE = ("chooses what evaluate.py extracts features from; the callback evaluates the features your module's "
           "step returns")
NOT_CALLBACK_KEYS = {
    **{key: _SOURCE for key in ("checkpoint", "pretrained_file", "data", "force_data", "backbone", "features",
                                "feature_cache_dir", "refresh_features")},
    "logger": "is evaluate.py's; the callback logs through your Trainer's loggers (Trainer(logger=...))",
    "wandb": "is evaluate.py's; the callback logs through your Trainer's loggers (Trainer(logger=WandbLogger(...)))",
    "trainer": "is evaluate.py's; the Trainer is yours",
    "name": "names evaluate.py's run folder; give output_dir=<folder> instead",
    "verbose": "is evaluate.py's console option",
    "debug": "is evaluate.py's console option",
    "plugins": "imports modules for evaluate.py; in your own script, import the module that registers your method",
    "method": "is method_params here: method_params={'putm': {'rho': 0.7}} is evaluate.py's method.putm.rho=0.7",
}

#: What ``features`` is set to: not the demo, so ``tasks=auto`` means 1000 as for any other features.
MODULE_FEATURES = "lightning_module"

WHO = "FewShotEvaluationCallback"


def callback_settings(arguments: dict[str, Any], own: Sequence[str] = ()) -> EvaluationSettings:
    """``conf/evaluate.yaml``'s defaults with ``arguments`` over them, validated by ``settings_from_config``.

    Every problem is a one-line :class:`ConfigError` naming the argument, raised before anything is written; an
    unknown name gets the nearest of the evaluation settings and of ``own`` (the callback's other arguments).
    ``output_dir`` keeps ``auto`` as ``None``: the callback puts its files under the Trainer's log folder.
    """
    for name in arguments:
        if name in NOT_CALLBACK_KEYS:
            raise ConfigError(f"{WHO}: `{name}` {NOT_CALLBACK_KEYS[name]}")
        if name not in CALLBACK_KEYS:
            raise ConfigError(f"{WHO}: unknown argument `{name}`; {did_you_mean(name, [*CALLBACK_KEYS, *own])}the "
                              f"evaluation arguments are {', '.join(CALLBACK_KEYS)} (conf/evaluate.yaml; "
                              "docs/callback.md)")
    base = arguments.get("base_features")
    if isinstance(base, str) and base.startswith(BASE_SPLIT_PREFIX):
        raise ConfigError(f"{WHO}: base_features={base} extracts a split with evaluate.py's checkpoint=; give a "
                          "feature file of the base classes from the same backbone (save_features), or None")
    overrides = [Override("features", MODULE_FEATURES, MODULE_FEATURES)]
    for name, value in arguments.items():
        if name == "method_params":
            overrides += _method_overrides(value)
        else:
            overrides.append(_override(name, value))
    try:
        return settings_from_config(load_evaluate_config(overrides))
    except ConfigError as exc:
        raise ConfigError(f"{WHO}: {exc}") from None


def settings_yaml(settings: EvaluationSettings) -> str:
    """The evaluation settings as run, every default filled in (each method's full settings): the ``config.yaml``
    that a callback built from keyword arguments writes next to its results."""
    record = {"methods": settings.methods, "ways": settings.ways, "shots": settings.shots,
              "queries": settings.queries, "alphas": [alpha_label(a) for a in settings.alphas],
              "query_classes": (settings.query_classes if len(settings.query_classes) > 1
                                else settings.query_classes[0]),
              "tasks": settings.tasks,
              "seed": settings.seed, "base_features": settings.base_features, "oracle_prior": settings.oracle_prior,
              "device": str(settings.device), "memory_budget_mb": settings.memory_budget_mb, "split": settings.split,
              "method_params": settings.method_params}
    return yaml.safe_dump(record, sort_keys=False)


def _override(key: str, value: Any) -> Override:
    value = _plain(value, key)
    return Override(key, command_line_value(value), value)


def _method_overrides(params: Any) -> list[Override]:
    """``{"putm": {"rho": 0.7}}`` → ``method.putm.rho=0.7`` (``preset`` included: it is applied first)."""
    if params is None:
        return []
    example = "method_params={'putm': {'rho': 0.7}}"
    if not isinstance(params, dict):
        raise ConfigError(f"{WHO}: `method_params` must map method names to their settings, e.g. {example}; "
                          f"got {params!r}")
    overrides = []
    for method, values in params.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{WHO}: `method_params[{method!r}]` must be a dict of that method's settings, e.g. "
                              f"{example}; got {values!r}")
        overrides += [_override(f"method.{method}.{key}", value) for key, value in values.items()]
    return overrides


def _plain(value: Any, key: str) -> Any:
    """A value as the YAML config holds it: paths and devices as text, tuples as lists."""
    if isinstance(value, (Path, torch.device)):
        return str(value)
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [_plain(item, key) for item in value]
    if isinstance(value, dict):
        return {k: _plain(v, key) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ConfigError(f"{WHO}: `{key}` got a {type(value).__name__} ({value!r}); give text, a number, true/false, "
                      "None or a list of these")
