"""Evaluation on features: every method on the same seeded episode bank per (shot, α), then a report.

This is where feature sets, episodes and methods meet (DESIGN §1). ``evaluate.py`` is a thin wrapper:
it loads ``conf/evaluate.yaml`` with overrides, calls :func:`evaluate_features` and :func:`write_report`.
"""

from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from lightning_putm.config import apply_overrides, conf_dir, group_options, load_group, load_yaml, to_container, to_yaml
from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import EpisodeBank, sample_episode_bank
from lightning_putm.errors import ConfigError, FeatureError
from lightning_putm.features import FeatureSet, load_features
from lightning_putm.methods import available_methods, build_method, method_uses_base_mean, method_uses_class_prior
from lightning_putm.metrics import mean_and_ci95, task_accuracy

DEMO_TASKS = 100
DEFAULT_TASKS = 1000


@dataclass
class EvaluationSettings:
    """Validated values of ``conf/evaluate.yaml``."""

    features: str
    methods: list[str]
    ways: int
    shots: list[int]
    queries: int
    alphas: list[float | None]  # None = balanced
    tasks: int
    seed: int
    device: torch.device
    output_dir: Path
    allow_pickle: bool = False
    memory_budget_mb: float = 2048.0
    progress: bool = True
    method_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    base_features: str | None = None  # base-class feature file whose mean CL2N subtracts
    oracle_prior: bool = False  # give methods with a class prior the TRUE query counts (labelled, unfair)


@dataclass
class SettingResult:
    method: str
    shots: int
    alpha: float | None
    accuracies: torch.Tensor  # [T] float64
    seconds: float
    bank: EpisodeBank
    oracle_prior: bool = False  # the method received the true query counts

    @property
    def alpha_label(self) -> str:
        return "balanced" if self.alpha is None else f"{self.alpha:g}"

    def summary(self) -> dict[str, Any]:
        mean, ci = mean_and_ci95(self.accuracies)
        return {
            "method": self.method,
            "shots": self.shots,
            "alpha": self.alpha_label,
            "accuracy": round(100 * mean, 4),
            "ci95": round(100 * ci, 4),
            "tasks": int(self.accuracies.numel()),
            "seconds": round(self.seconds, 3),
            "oracle_prior": _flag(self.oracle_prior),
        }


def _flag(value: bool) -> str:
    return "true" if value else "false"


# --------------------------------------------------------------------------------------------- config
def load_evaluate_config(overrides: Sequence[str] = ()) -> DictConfig:
    """``conf/evaluate.yaml`` with every ``conf/method/*.yaml`` under ``method.<name>``, plus overrides."""
    cfg = load_yaml(conf_dir() / "evaluate.yaml")
    cfg.method = {name: load_group("method", name) for name in group_options("method")}
    return apply_overrides(cfg, overrides)


def _int(cfg: DictConfig, key: str, low: int) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"`{key}` must be an integer >= {low}, got {value!r}")
    return value


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) or hasattr(value, "__iter__") and not isinstance(value, str) else [value]


def parse_alpha(value: Any) -> float | None:
    """A Dirichlet α (> 0, finite) or ``balanced`` → ``None``."""
    if isinstance(value, str) and value.strip().lower() == "balanced":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"alphas: {value!r} is neither a positive number nor `balanced`") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"alphas: Dirichlet alpha must be > 0 (or `balanced`), got {value!r}")
    return float(value)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device: cannot use {name!r} ({exc}); use auto, cpu or cuda[:index]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here; use device=auto or device=cpu")
    return device


def settings_from_config(cfg: DictConfig) -> EvaluationSettings:
    """Validate the merged config; every problem is a :class:`ConfigError` naming the key."""
    methods = [str(m) for m in _as_list(cfg.methods)]
    if not methods:
        raise ConfigError(f"`methods` is empty; choose from {', '.join(available_methods())}")
    for name in methods:
        if name not in available_methods():
            raise ConfigError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    ways = _int(cfg, "ways", 2)
    shots = _as_list(cfg.shots)
    if not shots or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shots):
        raise ConfigError(f"`shots` must be a list of positive integers (e.g. shots=[1,5]), got {cfg.shots!r}")
    queries = 15 * ways if cfg.queries is None else _int(cfg, "queries", 1)
    alphas = [parse_alpha(a) for a in _as_list(cfg.alphas)]
    if not alphas:
        raise ConfigError("`alphas` is empty; give Dirichlet alphas and/or `balanced`, e.g. alphas=[2,balanced]")
    features = str(cfg.features)
    if cfg.tasks == "auto":
        tasks = DEMO_TASKS if features == "demo" else DEFAULT_TASKS
    else:
        tasks = _int(cfg, "tasks", 1)
    seed = _int(cfg, "seed", 0)
    budget = cfg.memory_budget_mb
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ConfigError(f"`memory_budget_mb` must be a positive number, got {budget!r}")
    oracle_prior = cfg.get("oracle_prior", False)
    if not isinstance(oracle_prior, bool):
        raise ConfigError(f"`oracle_prior` must be true or false, got {oracle_prior!r}")
    base_features = cfg.get("base_features")
    base_features = None if base_features in (None, "") else str(base_features)
    return EvaluationSettings(
        features=features,
        methods=methods,
        ways=ways,
        shots=[int(s) for s in shots],
        queries=queries,
        alphas=alphas,
        tasks=tasks,
        seed=seed,
        device=resolve_device(str(cfg.device)),
        output_dir=Path(str(cfg.output_dir)),
        allow_pickle=bool(cfg.allow_pickle),
        memory_budget_mb=float(budget),
        progress=bool(cfg.progress),
        method_params={name: to_container(cfg.method[name]) for name in methods if name in cfg.method},
        base_features=base_features,
        oracle_prior=oracle_prior,
    )


def load_feature_source(settings: EvaluationSettings) -> FeatureSet:
    """The feature set named by ``features=``: the built-in demo or a file."""
    feature_set = digits_feature_set() if settings.features == "demo" else load_features(
        settings.features, allow_pickle=settings.allow_pickle
    )
    feature_set.check_finite(f"features from {settings.features}")
    return feature_set


def load_base_mean(settings: EvaluationSettings, dim: int, log: Callable[[str], None] = print) -> torch.Tensor | None:
    """Mean ``[d]`` of the rows of ``base_features`` for CL2N, or ``None`` with one notice when it is not set."""
    users = [name for name in settings.methods if method_uses_base_mean(name)]
    if settings.base_features is None:
        if users:
            log(f"notice: no base_features file given, so {', '.join(users)} cannot subtract the base-class "
                "mean (CL2N) and use plain L2 normalisation (L2N) instead; pass base_features=<file> with "
                "features of the base classes from the same backbone")
        return None
    base = load_features(settings.base_features, allow_pickle=settings.allow_pickle)
    base.check_finite(f"base features from {settings.base_features}")
    if base.dim != dim:
        raise FeatureError(
            f"base_features {settings.base_features} has d={base.dim} but the evaluated features have d={dim}; "
            "both must come from the same backbone"
        )
    if len(base) == 0:
        raise FeatureError(f"base_features {settings.base_features} has no rows")
    log(f"base-class mean for CL2N: {len(base)} rows of {settings.base_features}")
    return base.features.double().mean(0).float()


# --------------------------------------------------------------------------------------------- run
def evaluate_features(
    feature_set: FeatureSet,
    settings: EvaluationSettings,
    log: Callable[[str], None] = print,
) -> list[SettingResult]:
    """Run every method on the same episode bank for each (shot, α); returns one result per triple."""
    base_mean = load_base_mean(settings, feature_set.dim, log)
    if base_mean is not None:
        base_mean = base_mean.to(settings.device)
    total = len(settings.shots) * len(settings.alphas) * len(settings.methods) * settings.tasks
    bar = tqdm(total=total, desc="tasks", unit="task", disable=not settings.progress, dynamic_ncols=True)
    results: list[SettingResult] = []
    try:
        for shots in settings.shots:
            for alpha in settings.alphas:
                bank = sample_episode_bank(
                    feature_set.labels, settings.ways, shots, settings.queries, alpha, settings.tasks,
                    settings.seed, class_names=feature_set.class_names,
                )
                gathered = bank.gather(feature_set.features, settings.device)
                for name in settings.methods:
                    oracle = settings.oracle_prior and method_uses_class_prior(name)
                    method = build_method(
                        name, settings.method_params.get(name, {}), shots=shots, balanced=alpha is None,
                        show_progress=settings.progress, memory_budget_mb=settings.memory_budget_mb,
                        base_mean=base_mean, query_counts=bank.query_counts if oracle else None,
                    )
                    bar.set_postfix_str(f"{name} {shots}-shot alpha={bank.alpha_label}")
                    start = time.perf_counter()
                    probabilities = method.predict(gathered.batch, on_chunk=bar.update)
                    seconds = time.perf_counter() - start
                    accuracies = task_accuracy(probabilities, gathered.query_labels).cpu()
                    results.append(SettingResult(name, shots, alpha, accuracies, seconds, bank, method.oracle_prior))
    finally:
        bar.close()
    return results


# --------------------------------------------------------------------------------------------- report
SUMMARY_COLUMNS = ["method", "shots", "alpha", "accuracy", "ci95", "tasks", "seconds", "oracle_prior"]


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table: method, shot, α, accuracy ± 95% CI, tasks, seconds, oracle prior."""
    header = ["method", "shots", "alpha", "accuracy (%)", "tasks", "time (s)", "oracle_prior"]
    body = [
        [str(r["method"]), str(r["shots"]), str(r["alpha"]), f"{r['accuracy']:.2f} ± {r['ci95']:.2f}",
         str(r["tasks"]), f"{r['seconds']:.1f}", str(r.get("oracle_prior", "false"))]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(b) for b in body)])


def per_task_rows(results: list[SettingResult]) -> list[dict[str, Any]]:
    """One row per (method, shot, α, task) with the task's query counts and imbalance."""
    rows = []
    for result in results:
        bank = result.bank
        imbalance = bank.imbalance()
        for t in range(len(bank)):
            counts = bank.query_counts[t].tolist()
            rows.append({
                "method": result.method,
                "shots": result.shots,
                "alpha": result.alpha_label,
                "task": t,
                "accuracy": f"{float(result.accuracies[t]):.6f}",
                "oracle_prior": _flag(result.oracle_prior),
                "query_counts": ";".join(str(c) for c in counts),
                "class_ids": ";".join(str(c) for c in bank.class_ids[t].tolist()),
                "max_min_ratio": f"{float(imbalance['max_min_ratio'][t]):.4f}",
                "normalised_entropy": f"{float(imbalance['normalised_entropy'][t]):.6f}",
            })
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> Path:
    """Write rows atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    columns = columns or (list(rows[0].keys()) if rows else [])
    with open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path


def write_report(results: list[SettingResult], output_dir: Path, config_yaml: str | None = None) -> dict[str, Path]:
    """``results.csv`` (summary), ``per_task.csv`` and ``config.yaml`` in ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": write_csv(output_dir / "results.csv", [r.summary() for r in results], SUMMARY_COLUMNS),
        "per_task": write_csv(output_dir / "per_task.csv", per_task_rows(results)),
    }
    if config_yaml is not None:
        config_path = output_dir / "config.yaml"
        config_path.write_text(config_yaml)
        paths["config"] = config_path
    return paths


def run_evaluate(overrides: Sequence[str], log: Callable[[str], None] = print) -> list[SettingResult]:
    """The whole ``evaluate.py`` job: config → features → evaluation → table and CSV files."""
    cfg = load_evaluate_config(overrides)
    settings = settings_from_config(cfg)
    cfg.tasks = settings.tasks  # show the resolved value, not `auto`
    cfg.queries = settings.queries
    config_yaml = to_yaml(cfg)
    log("effective config:\n" + config_yaml)
    feature_set = load_feature_source(settings)
    log(f"features: {len(feature_set)} rows x {feature_set.dim} dims, {feature_set.num_classes} classes "
        f"({feature_set.metadata.get('source', settings.features)}); device: {settings.device}")
    results = evaluate_features(feature_set, settings, log)
    paths = write_report(results, settings.output_dir, config_yaml)
    log(format_table([r.summary() for r in results]))
    if any(r.oracle_prior for r in results):
        log("WARNING: rows with oracle_prior=true were given the TRUE query counts of every task "
            "(oracle_prior=true); they are not comparable with fair results")
    log(f"wrote {paths['results']}, {paths['per_task']} and {paths['config']}")
    return results
