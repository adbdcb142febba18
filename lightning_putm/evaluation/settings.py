"""The settings of an evaluation run: ``conf/evaluate.yaml`` + method/data groups + overrides, validated.

Every problem is a :class:`~lightning_putm.errors.ConfigError` naming the key, raised before anything is
read, written or logged.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from lightning_putm.config import (Override, Overrides, apply_overrides, apply_trainer_overrides, command_line_value,
                                   conf_dir, group_options, is_trainer_override, load_group, load_saved_config,
                                   load_yaml, progress_seconds, resolve_override_value, to_container)
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.evaluation.options import EvaluateOptions
from lightning_putm.evaluation.presets import PRESET_KEY, apply_presets
from lightning_putm.job_options import checked_options
from lightning_putm.loggers import check_wandb_mode
from lightning_putm.methods.catalog import available_methods, check_method_options, known_method, method_configs
from lightning_putm.methods.registry import PLUGINS_KEY, import_plugins
from lightning_putm.models.timm_names import check_model_name, timm_model_name
from lightning_putm.runs import run_name
from lightning_putm.validators import (alpha_label, as_list, did_you_mean, distinct, parse_alpha,
                                       parse_query_classes, protocol_flags)

if TYPE_CHECKING:  # torch and the methods load once the settings are valid: errors and --help come without them
    import torch

    from lightning_putm.methods.base import FewShotMethod

DEMO_TASKS = 100
DEFAULT_TASKS = 1000

#: Trainer arguments evaluation sets itself.
EVALUATION_TRAINER_ARGS = {
    "logger": "use logger=auto|wandb|csv|none",
    "callbacks": "the few-shot evaluation callback is built from this config",
    "enable_checkpointing": "evaluation writes no checkpoints",
    "inference_mode": "PUTM needs gradients for its navigators (inference_mode is off)",
    "default_root_dir": "use output_dir",
    "enable_progress_bar": "use progress=true|false",
}


#: ``base_features=split:<name>``: the base-class features are that split of ``data``, extracted with the checkpoint.
BASE_SPLIT_PREFIX = "split:"
#: Where ``output_dir=auto`` puts run folders: ``<RUN_ROOT>/<date>/<time>-<name>``.
RUN_ROOT = Path("outputs/evaluate")
BASE_SPLITS = ("train", "val")
#: The file names ``train_backbone.py`` gives every stage's checkpoints.
CHECKPOINT_FILES = ("best", "last")
@dataclass
class EvaluationSettings:
    """Validated values of ``conf/evaluate.yaml``."""

    features: str
    methods: list[str]
    ways: int
    shots: list[int]
    queries: int
    alphas: list[float | str | None]  # None = balanced, "uniform" = PADDLE's uniform draw
    tasks: int
    seed: int
    device: torch.device
    output_dir: Path | None  # None = a new run folder under RUN_ROOT (resolved by the job)
    allow_pickle: bool = False
    memory_budget_mb: float | str = 2048.0  # MB, or "auto" (free device memory on CUDA)
    progress: bool = True
    method_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    base_features: str | None = None  # base-class feature file whose mean CL2N subtracts
    oracle_prior: bool = False  # give methods with a class prior the TRUE query counts (labelled, unfair)
    checkpoint: Path | None = None  # extract features of data/split from this backbone checkpoint
    split: str = "test"
    feature_cache_dir: Path = Path("outputs/feature_cache")
    refresh_features: bool = False
    logger: str = "auto"
    wandb: dict[str, Any] = field(default_factory=dict)
    plots: bool = True
    plot_task: int = 0
    trainer: dict[str, Any] = field(default_factory=dict)
    backbone: str = "auto"  # expected backbone of the checkpoint (auto = whatever it holds)
    timm_model: str | None = None  # checkpoint=timm:<name>: a pretrained timm model instead of a checkpoint file
    pretrained_file: Path | None = None  # its weights file (None: timm's hub cache or download)
    name: str = "run"  # run name: part of the run folder's and the W&B run's names
    verbose: bool = False
    query_classes: list[int | None] = field(default_factory=lambda: [None])  # K_eff per bank; None = all N classes


def load_evaluate_config(overrides: Iterable[str | Override] = ()) -> DictConfig:
    """``conf/evaluate.yaml`` with every ``conf/method/*.yaml`` under ``method.<name>``, the chosen
    ``conf/data/<name>.yaml`` under ``data`` (``data=<name>`` picks it), plus overrides; ``trainer.<arg>``
    accepts any ``pytorch_lightning.Trainer`` argument except those evaluation sets itself.

    The arguments are parsed once, first (a malformed one fails before any file is read); then the selectors
    (``config=``, ``data=``) and ``trainer.*`` are taken out, the YAML files composed with the checkpoint's
    recorded data settings, and the rest merged."""
    overrides = Overrides.parse(overrides)
    saved_path, overrides = overrides.pop("config")
    data_name, overrides = overrides.pop("data")
    trainer_overrides, overrides = overrides.partition(is_trainer_override)
    cfg = load_yaml(conf_dir() / "evaluate.yaml")
    saved = None
    if saved_path is not None:  # re-run a recorded run: its config.yaml is the base, overrides still apply
        if not Path(saved_path).is_file():
            raise ConfigError(f"config={saved_path}: file not found; give the config.yaml saved in a run folder")
        saved = load_yaml(Path(saved_path))
    plugins = overrides.last(PLUGINS_KEY)  # first: the methods they register are named below
    import_plugins(resolve_override_value(plugins) if plugins is not None
                   else saved.get(PLUGINS_KEY) if saved is not None else cfg.get(PLUGINS_KEY))
    cfg.method = method_configs()
    if saved is not None:
        data_name = data_name or (str(saved.data.name) if "data" in saved and "name" in saved.data else None)
        if "checkpoint" in saved and saved.checkpoint and overrides.last("checkpoint") is None:
            overrides = Overrides([Override("checkpoint", str(saved.checkpoint), str(saved.checkpoint))]) + overrides
    checkpoint = overrides.last("checkpoint")
    recorded = None if checkpoint is None else checkpoint_data_config(resolve_override_value(checkpoint))
    name = data_name or (str(recorded["name"]) if recorded else str(cfg.data))
    cfg.data = data_config(name, recorded)
    if saved_path is not None:
        cfg = load_saved_config(saved_path, cfg)
        cfg.output_dir = "auto"  # a re-run gets its own folder (name output_dir=... to choose one)
    # a saved config holds its preset's values already: a preset is applied again only when named anew
    cfg, overrides = apply_presets(cfg, overrides, defaults_too=saved_path is None)
    cfg = apply_overrides(cfg, overrides)
    if checkpoint is None and (data_keys := [o.text for o in overrides if o.key.startswith("data.")]):
        check_checkpoint_only_settings(cfg, data_keys)  # no images are read: a data.* key would be ignored
    if recorded and recorded.get("name") != name and not cfg.force_data:
        raise ConfigError(f"the checkpoint was trained on data={recorded.get('name')} but data={name} was given; "
                          "drop data= to evaluate it on its own data, or pass force_data=true to evaluate it on "
                          f"{name} on purpose")
    return apply_trainer_overrides(cfg, trainer_overrides, EVALUATION_TRAINER_ARGS, "evaluate.py")


def data_config(name: str, recorded: dict[str, Any] | None = None) -> DictConfig:
    """``data``: ``conf/data/<name>.yaml`` under its name, with the settings a checkpoint recorded (``recorded``)
    when the checkpoint was trained on that same dataset — what its evaluation must use to see the same images."""
    data = OmegaConf.merge({"name": name}, load_group("data", name))
    if recorded and recorded.get("name") == name:
        data = OmegaConf.merge(data, {k: v for k, v in recorded.items() if k in data})
    return data


def checkpoint_data(checkpoint: str | Path, root: str | None = None) -> DictConfig:
    """The ``data`` settings to extract a split of the data ``checkpoint`` was trained on (as ``evaluate.py
    checkpoint=...`` composes them), optionally read from another ``root``."""
    recorded = checkpoint_data_config(str(checkpoint))
    data = data_config(str(recorded["name"]) if recorded else str(load_yaml(conf_dir() / "evaluate.yaml").data),
                       recorded)
    if root is not None:
        data.root = root
    return data


def method_arguments(values: dict[str, Any]) -> dict[str, Any]:
    """A method's constructor arguments from its config section (the preset's name is config, not an argument)."""
    return {k: v for k, v in values.items() if k != PRESET_KEY}


def checkpoint_data_config(path: Any) -> dict[str, Any] | None:
    """The ``data_config`` the checkpoint at ``path`` records (``None``: no checkpoint, an older checkpoint, or a
    file that cannot be read — the feature source reports that one with its own clear error)."""
    path = None if path is None else str(path)
    if path in (None, "", "null", "None") or not Path(path).is_file():
        return None
    file = Path(path)
    stat = file.stat()
    recorded = _recorded_data_config(str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    return copy.deepcopy(recorded)


@functools.lru_cache(maxsize=8)
def _recorded_data_config(path: str, mtime_ns: int, size: int) -> dict[str, Any] | None:
    """The checkpoint's ``data_config``, read once per file version (the console summary asks again, and a
    checkpoint of a large backbone takes seconds to load)."""
    from lightning_putm.pretraining.checkpoints import read_checkpoint  # torch: only for a checkpoint file

    try:
        recorded = (read_checkpoint(path).get("hyper_parameters") or {}).get("data_config")
    except DataError:
        return None
    return dict(recorded) if isinstance(recorded, dict) and recorded.get("name") else None


def checkpoint_run_name(checkpoint: Path) -> str:
    """A run name that says which checkpoint was evaluated: ``<dataset>-<backbone>-<run>-<stage>``.

    ``train_backbone.py`` writes ``<checkpoint_dir>/<dataset>/<backbone>/<run>/<stage>/{best,last}.ckpt``, so the
    file's own name (``best``) tells nothing; the folders do (``latest`` is followed to the run it points at).
    ``last.ckpt`` adds ``-last``. A checkpoint elsewhere is named by its folder and file (``models-best``) when its
    file name is one of those two, else by its file name.
    """
    folder = checkpoint.expanduser().parent
    with contextlib.suppress(OSError):
        folder = folder.resolve()  # <run> = latest → the run folder it points at
    stem = checkpoint.stem
    if stem not in CHECKPOINT_FILES:
        return stem
    parts = folder.parts
    suffix = "" if stem == "best" else f"-{stem}"
    if len(parts) >= 5 and parts[-4] in group_options("data"):  # .../<dataset>/<backbone>/<run>/<stage>
        return "-".join(parts[-4:]) + suffix
    return f"{folder.name}-{stem}" if folder.name else stem


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device: cannot use {name!r} ({exc}); use auto, cpu or cuda[:index]") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device: {name!r} is not supported; use auto, cpu or cuda[:index]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here; use device=auto or device=cpu")
    return device


def settings_from_config(cfg: DictConfig) -> EvaluationSettings:
    """Validate the merged config; every problem is a :class:`ConfigError` naming the key. Each key is first checked
    against what its field declares (:func:`~lightning_putm.job_options.checked_options`); what follows relates
    keys to each other, to the registered methods and to files."""
    values = checked_options(EvaluateOptions, cfg)
    progress_seconds()  # $LIGHTNING_PUTM_PROGRESS_SECONDS, read by the progress lines later: checked now
    methods = [str(m) for m in as_list(cfg.methods)]
    if not methods:
        raise ConfigError(f"`methods` is empty; choose from {', '.join(available_methods())}")
    for name in methods:
        if not known_method(name):
            raise ConfigError(f"unknown method {name!r}; {did_you_mean(name, available_methods())}available methods: "
                              f"{', '.join(available_methods())}")
    distinct(methods, "methods")
    ways, shots = values["ways"], values["shots"]
    queries = 15 * ways if values["queries"] is None else values["queries"]
    alphas = [parse_alpha(a, uniform=True) for a in as_list(cfg.alphas)]
    if not alphas:
        raise ConfigError("`alphas` is empty; give Dirichlet alphas and/or `balanced`, e.g. alphas=[2,balanced]")
    distinct(shots, "shots")
    distinct(alphas, "alphas", alpha_label)
    query_classes = parse_query_classes(cfg.get("query_classes"), ways)
    features = str(cfg.features)
    from_checkpoint = cfg.checkpoint not in (None, "")
    demo = str(cfg.data.name) == DEMO_DATA if from_checkpoint else features in ("demo", "auto")
    tasks = values["tasks"]
    if tasks == "auto":
        tasks = DEMO_TASKS if demo else DEFAULT_TASKS
    base_features = cfg.get("base_features")
    base_features = None if base_features in (None, "") else str(base_features)
    checkpoint = None if cfg.checkpoint in (None, "") else Path(str(cfg.checkpoint))
    if base_features == "auto":  # CL2N from the checkpoint's base classes when a method needs them, else none
        wanted = checkpoint is not None and any_uses_base_mean(methods)
        base_features = "split:train" if wanted and str(cfg.get("split", "test")) != "train" else None
    if base_features is not None and base_features.startswith(BASE_SPLIT_PREFIX):
        base_split = base_features[len(BASE_SPLIT_PREFIX):]
        if checkpoint is None:
            raise ConfigError(f"base_features={base_features} extracts a split with the checkpoint's backbone; "
                              "give checkpoint=PATH too, or base_features=<feature file>")
        if base_split == str(cfg.get("split", "test")):
            raise ConfigError(f"base_features={base_features} is the evaluated split itself; CL2N subtracts the "
                              "mean of the base classes: use base_features=split:train")
        if base_split not in BASE_SPLITS:
            raise ConfigError(f"base_features={base_features}: unknown split {base_split!r}; use split:train "
                              "(the base classes the backbone was trained on) or split:val")
    if checkpoint is not None and features != "auto":
        raise ConfigError(f"give either features=<file> or checkpoint=<ckpt>, not both (features={features}, "
                          f"checkpoint={checkpoint})")
    if checkpoint is None:
        check_checkpoint_only_settings(cfg)
    if checkpoint is not None:
        features = f"checkpoint:{checkpoint}"
    elif features == "auto":
        features = "demo"
    split = values["split"]
    if cfg.output_dir is None or str(cfg.output_dir).strip() in ("", "None", "null"):
        raise ConfigError("`output_dir` must be a folder path or auto (a new run folder), e.g. output_dir=outputs/mine")
    output_dir = None if str(cfg.output_dir) == "auto" else Path(str(cfg.output_dir))
    method_params = {name: method_arguments(to_container(cfg.method[name])) for name in methods if name in cfg.method}
    flags = protocol_flags(alphas, query_classes, ways)  # each bank: balanced or not
    check_methods_options(methods, method_params, shots, flags)
    if base_features is not None and not base_features.startswith(BASE_SPLIT_PREFIX) \
            and not Path(base_features).is_file():
        raise ConfigError(f"base_features: file not found: {base_features}; give a feature file of the base classes "
                          "from the same backbone, base_features=split:train with a checkpoint, or base_features=null")
    timm_model, pretrained_file = timm_settings(cfg)
    if timm_model is not None:
        source = f"timm-{timm_model}"
    else:
        source = checkpoint_run_name(checkpoint) if checkpoint is not None else Path(features).stem
    name = run_name(None if cfg.get("name") in (None, "") else str(cfg.name), source)
    wandb = to_container(cfg.wandb)
    check_wandb_mode(wandb.get("mode"), values["logger"])
    plot_task = values["plot_task"]
    if plot_task >= tasks:
        raise ConfigError(f"plot_task={plot_task} but there are {tasks} tasks per setting: give an index from 0 to "
                          f"{tasks - 1}")
    check_methods_build(methods, method_params, shots, flags)  # last: it imports the methods
    return EvaluationSettings(
        features=features,
        methods=methods,
        ways=ways,
        shots=shots,
        queries=queries,
        alphas=alphas,
        tasks=tasks,
        seed=values["seed"],
        device=resolve_device(str(cfg.device)),
        output_dir=output_dir,
        allow_pickle=values["allow_pickle"],
        memory_budget_mb=values["memory_budget_mb"],
        progress=values["progress"],
        method_params=method_params,
        base_features=base_features,
        oracle_prior=values["oracle_prior"],
        checkpoint=checkpoint,
        split=split,
        feature_cache_dir=Path(str(cfg.feature_cache_dir)),
        refresh_features=values["refresh_features"],
        logger=values["logger"],
        wandb=wandb,
        plots=values["plots"],
        plot_task=plot_task,
        trainer=to_container(cfg.trainer),
        backbone=str(cfg.backbone),
        timm_model=timm_model,
        pretrained_file=pretrained_file,
        name=name,
        verbose=values["verbose"], query_classes=query_classes,
    )


def timm_settings(cfg: DictConfig) -> tuple[str | None, Path | None]:
    """``checkpoint=timm:<name>`` and ``pretrained_file``, checked: a name timm knows, a weights file that exists,
    ``pretrained_file`` only with a timm model, and ``backbone`` auto or that model."""
    name = timm_model_name(cfg.checkpoint)
    given = cfg.get("pretrained_file")
    path = None if given in (None, "", "null", "None") else Path(str(given)).expanduser()
    if name is None:
        if path is not None:
            raise ConfigError(f"pretrained_file={given} is the weights file of a timm model: use it with "
                              "checkpoint=timm:<model name>, or drop it (a train_backbone.py checkpoint holds its "
                              "weights)")
        return None, None
    check_model_name(name)
    if path is not None and not path.is_file():
        raise ConfigError(f"pretrained_file={path}: file not found; give the weights file of timm:{name} "
                          "(.safetensors, .pth, .bin), or drop it to use timm's hub cache")
    if str(cfg.backbone) not in ("auto", name):
        raise ConfigError(f"backbone={cfg.backbone} does not apply to checkpoint=timm:{name}; drop it (backbone=auto)")
    return name, path


#: The dataset of the built-in demo (``conf/evaluate.yaml``'s default ``data``).
DEMO_DATA = "digits"
#: Settings that choose what a checkpoint's backbone extracts, with the values that mean "not set".
CHECKPOINT_ONLY = {"backbone": "auto", "pretrained_file": None, "force_data": False}


def check_checkpoint_only_settings(cfg: DictConfig, data_keys: Sequence[str] = ()) -> None:
    """Without ``checkpoint=`` the demo or ``features=`` are evaluated as they are: a dataset (``data=cub``), a
    ``data.<key>=`` given on the command line (``data_keys``, as typed), a ``backbone=`` or a ``pretrained_file=``
    would be ignored without a word, so each is an error saying why."""
    given = [f"data={cfg.data.name}"] if str(cfg.data.name) != DEMO_DATA else []
    given += list(data_keys)
    given += [f"{key}={command_line_value(cfg.get(key))}" for key, unset in CHECKPOINT_ONLY.items()
              if cfg.get(key) not in (unset, "")]
    if given:
        one = len(given) == 1
        evaluated = "the features file" if str(cfg.features) not in ("auto", "demo") else "the demo data"
        raise ConfigError(f"{', '.join(given)} appl{'ies' if one else 'y'} only with checkpoint=: "
                          f"{'it chooses' if one else 'they choose'} the images a backbone extracts features from. "
                          "Give checkpoint=PATH (a train_backbone.py checkpoint) or checkpoint=timm:<model>, or "
                          f"drop {'it' if one else 'them'} to evaluate {evaluated}")


def any_uses_base_mean(methods: list[str]) -> bool:
    """Whether one of ``methods`` normalises with a base-class mean (CL2N); reads the classes (imports torch)."""
    from lightning_putm.methods import method_uses_base_mean

    return any(method_uses_base_mean(name) for name in methods)


def check_methods_options(methods: list[str], params: dict[str, dict[str, Any]], shots: list[int],
                          flags: list[bool]) -> None:
    """Check every method's options (``method.putm.rho=high``) for every setting with its settings dataclass, as
    its constructor will: an error naming the key, before torch is imported or any file is read."""
    for name in methods:
        for shot in shots:
            for balanced in flags:
                check_method_options(name, params.get(name, {}), shots=shot, balanced=balanced)


def built_methods(methods: list[str], params: dict[str, dict[str, Any]], shots: list[int],
                  flags: list[bool]) -> Iterator[FewShotMethod]:
    """Every method as each setting builds it (its options resolve per shot count and protocol)."""
    from lightning_putm.methods import build_method

    for name in methods:
        for shot in shots:
            for balanced in flags:
                yield build_method(name, params.get(name, {}), shots=shot, balanced=balanced)


def check_methods_build(methods: list[str], params: dict[str, dict[str, Any]], shots: list[int],
                        flags: list[bool]) -> None:
    """Build every method once per setting with its parameters, so a value only the constructor checks (UNEM's
    ``params_file``) is an error naming the key now, not after features were loaded and a W&B run was started."""
    for _ in built_methods(methods, params, shots, flags):
        pass


def check_methods_accept(features: torch.Tensor, settings: EvaluationSettings) -> None:
    """Every method of every setting accepts the feature set (e.g. PUTM's power transform needs non-negative
    features): a :class:`~lightning_putm.errors.FeatureError` before the run folder exists, not at the setting."""
    for method in built_methods(settings.methods, settings.method_params, settings.shots,
                                protocol_flags(settings.alphas, settings.query_classes, settings.ways)):
        method.check_features(features)
