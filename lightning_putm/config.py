"""Configuration: plain YAML in ``conf/`` merged with command-line ``key=value`` overrides (omegaconf).

Strict by design: an unknown key is an error that lists the valid keys at that level, never silently
ignored, so a typo in a sweep cannot quietly run the default; the close matches come first (``taks`` → "did you
mean tasks?"), and a key that lives elsewhere is found there (``rho`` → ``method.putm.rho``).
``trainer.<arg>=value`` overrides are checked against the signature of ``pytorch_lightning.Trainer`` and against
the arguments a job sets itself. A job parses its arguments once (:class:`Overrides`), before it opens any file.
"""

from __future__ import annotations

import inspect
import itertools
import os
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_putm.errors import ConfigError
from lightning_putm.validators import alternatives, close_matches, did_you_mean

#: Sanity limit of trainer.devices / trainer.num_nodes (Lightning allocates per-device lists up front).
MAX_DEVICES = 4096


#: Seconds between two plain progress lines of a long count where no bar is drawn (a log file, a pipe), unless
#: ``$LIGHTNING_PUTM_PROGRESS_SECONDS`` says otherwise.
PROGRESS_SECONDS = 30.0
PROGRESS_SECONDS_ENV = "LIGHTNING_PUTM_PROGRESS_SECONDS"


def progress_seconds() -> float:
    """Seconds between progress lines in a log: ``$LIGHTNING_PUTM_PROGRESS_SECONDS`` (a number >= 0; 0 = a line per
    update) if set, else :data:`PROGRESS_SECONDS`. The jobs read it with their settings, so a bad value fails
    first."""
    text = os.environ.get(PROGRESS_SECONDS_ENV, "").strip()
    if not text:
        return PROGRESS_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{PROGRESS_SECONDS_ENV}={text}: give the seconds between progress lines in a log, a "
                          f"number >= 0 (default {PROGRESS_SECONDS:g}), or unset it")
    return value


def conf_dir() -> Path:
    """The ``conf/`` folder: ``$LIGHTNING_PUTM_CONF`` if set, else the one beside the package."""
    env = os.environ.get("LIGHTNING_PUTM_CONF")
    path = Path(env) if env else Path(__file__).resolve().parents[1] / "conf"
    if not path.is_dir():
        raise ConfigError(
            f"config folder not found: {path}. Install the project with `pip install -e .` from its checkout, "
            "or point LIGHTNING_PUTM_CONF at its conf/ folder"
        )
    return path


def load_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:  # yaml syntax errors
        raise ConfigError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path} must hold a mapping of keys to values")
    return cfg


def group_options(group: str) -> list[str]:
    """Names of the YAML files in ``conf/<group>/`` (e.g. the available methods)."""
    folder = conf_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def load_group(group: str, name: str) -> DictConfig:
    options = group_options(group)
    if name not in options:
        raise ConfigError(f"unknown {group} {name!r}; {did_you_mean(name, options)}available: "
                          f"{', '.join(options) or '(none)'}")
    return load_yaml(conf_dir() / group / f"{name}.yaml")


def split_override(text: str) -> tuple[str, str]:
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"cannot read argument {text!r}: write overrides as key=value (e.g. shots=[1,5])")
    key, value = text.split("=", 1)
    return key.strip(), value


def parse_value(key: str, raw: str) -> Any:
    """YAML-parse one override value (``[1,5]`` → list, ``0.5`` → float, ``balanced`` → str)."""
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={raw}"]))["value"]
    except (OmegaConfBaseException, yaml.YAMLError) as exc:  # e.g. `shots=[1` (unbalanced bracket)
        reason = " ".join(str(exc).split())
        raise ConfigError(f"cannot parse the value of {key}: {raw!r} is not valid YAML ({reason}); "
                          "quote it or fix the brackets, e.g. shots=[1,5]") from exc


@dataclass(frozen=True)
class Override:
    """One ``key=value`` argument, parsed once: the dotted key, the value as typed, and its YAML value."""

    key: str
    raw: str  # as typed: presets and recorded command lines keep the user's spelling
    value: Any  # YAML-parsed (``[1,5]`` → list, ``0.5`` → float); ``${...}`` is kept for the config to resolve

    @property
    def text(self) -> str:
        return f"{self.key}={self.raw}"


class Overrides(Sequence[Override]):
    """A command line's ``key=value`` arguments, parsed in one pass before any file is opened.

    Every argument is split and its value YAML-parsed here, so a malformed argument is an error before a config,
    checkpoint or run folder is touched; the jobs then take what they need by key (:meth:`pop` for the selectors
    ``config=``, ``data=``, ``backbone=``, ``method=``; :meth:`partition` for ``trainer.*`` and presets) and merge
    the rest with :func:`apply_overrides`. Order is the command line's: the last of a repeated key wins.
    """

    def __init__(self, items: Iterable[Override] = ()) -> None:
        self._items = tuple(items)

    @classmethod
    def parse(cls, arguments: Iterable[str | Override]) -> Overrides:
        """Parse ``key=value`` strings (an :class:`Overrides` is returned as it is)."""
        if isinstance(arguments, Overrides):
            return arguments
        items = []
        arguments = list(arguments)
        for index, argument in enumerate(arguments):
            if isinstance(argument, Override):
                items.append(argument)
                continue
            key, raw = split_override(argument)
            try:
                value = parse_value(key, raw)
            except ConfigError:
                pieces = list(itertools.takewhile(lambda a: isinstance(a, str) and "=" not in a,
                                                  arguments[index + 1:]))
                if pieces:  # `alphas=[2, balanced]`: the shell split the value at the space
                    whole = " ".join([argument, *pieces])
                    raise ConfigError(f"{whole}: the shell split this value at a space; quote it ('{whole}') or drop "
                                      f"the spaces ({whole.replace(' ', '')})") from None
                raise
            items.append(Override(key, raw, value))
        return cls(items)

    def __getitem__(self, index: Any) -> Any:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __add__(self, other: Iterable[Override]) -> Overrides:
        return Overrides((*self._items, *Overrides.parse(other)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Overrides) and self._items == other._items

    __hash__ = None  # type: ignore[assignment]  # values may be lists

    def __repr__(self) -> str:
        return f"Overrides({[o.text for o in self._items]!r})"

    def last(self, key: str) -> Override | None:
        """The last ``key=...`` given, or ``None``."""
        return next((o for o in reversed(self._items) if o.key == key), None)

    def pop(self, key: str) -> tuple[str | None, Overrides]:
        """``(value of the last key=..., as a string, or None; the other overrides)``."""
        chosen = self.last(key)
        return (None if chosen is None else str(chosen.value)), Overrides(o for o in self._items if o.key != key)

    def partition(self, belongs: Callable[[Override], bool]) -> tuple[Overrides, Overrides]:
        """``(the overrides for which belongs(o) holds, the rest)``, each in command-line order."""
        return Overrides(o for o in self._items if belongs(o)), Overrides(o for o in self._items if not belongs(o))

    def texts(self) -> list[str]:
        """The overrides as ``key=value`` strings, as typed (for a recorded command line)."""
        return [o.text for o in self._items]


#: Groups whose keys the config files do not fix: a dataset's options (``data.options.allow_pickle=true``), which
#: its reader checks, naming the options it has (:mod:`lightning_putm.data.registry`)
OPEN_GROUPS = ("data.options",)


def apply_overrides(cfg: DictConfig, overrides: Iterable[str | Override]) -> DictConfig:
    """Merge ``key=value`` overrides into ``cfg``; unknown keys raise :class:`ConfigError`, but for a new key of
    one of the :data:`OPEN_GROUPS`."""
    cfg = cfg.copy()
    for override in Overrides.parse(overrides):
        key, value = override.key, override.value
        group = key.rpartition(".")[0]
        if not (group in OPEN_GROUPS and isinstance(OmegaConf.select(cfg, group, default=None), DictConfig)):
            _check_key(cfg, key)
        current = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        if isinstance(current, DictConfig) and not isinstance(value, dict):
            keys = ", ".join(sorted(str(k) for k in current.keys())) or "(none)"
            raise ConfigError(f"{key} is a group of settings, not a single value (got {value!r}); set its keys as "
                              f"{key}.<key>=value (keys: {keys})")
        OmegaConf.update(cfg, key, value, merge=False, force_add=False)
        check_resolvable(cfg)
    return cfg


def check_resolvable(cfg: DictConfig) -> None:
    """Resolve every ``${...}`` interpolation now, so a bad one is a clear error instead of a crash later."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "a key"
        missing_env = re.search(r"Environment variable '([^']+)' not found", str(exc))
        if missing_env:  # ${oc.env:NAME} without a default, e.g. the checkpoint of a sweep file
            name = missing_env.group(1)
            raise ConfigError(f"`{key}` reads the environment variable {name}, which is not set; set it (e.g. `export "
                              f"{name}=...` before `python` or `wandb agent`) or give {key}=<value> on the command line") from exc
        reason = " ".join(str(exc).split())
        raise ConfigError(f"cannot resolve an interpolation in the config (`{key}`: {reason}); `${{key}}` must name "
                          "an existing key and must not refer to itself") from exc


def resolve_override_value(override: Override) -> Any:
    """The value of one override with its ``${...}`` resolved (e.g. ``checkpoint=${oc.env:CKPT}``), for the few
    keys read before the config is assembled; a bad interpolation is :func:`check_resolvable`'s error."""
    holder = OmegaConf.create({})
    key = override.key
    OmegaConf.update(holder, key, override.value, merge=False)
    check_resolvable(holder)
    return OmegaConf.select(holder, key)


def _check_key(cfg: DictConfig, dotted: str) -> None:
    """Raise a :class:`ConfigError` naming the first unknown part of ``dotted``, the keys nearest to it and every
    valid key at that level."""
    node: Any = cfg
    parts = dotted.split(".")
    for index, part in enumerate(parts):
        if not isinstance(node, DictConfig) or part not in node:
            walked = parts[:index]
            where = ".".join(walked) or "top level"
            if not isinstance(node, DictConfig):
                raise ConfigError(f"unknown config key {dotted!r}: {where} is a single value, not a group of "
                                  f"settings; set it as {where}=<value>")
            keys = sorted(str(k) for k in node.keys())
            rest = "".join(f".{p}" for p in parts[index + 1:])
            spelled = [".".join([*walked, name]) + rest for name in close_matches(part, keys)]
            # a key given without its group (``rho``, ``method.rho`` → method.putm.rho) is likelier than a near
            # spelling; only below the part already walked (``method.putm.temperature`` is not TIM's)
            moved = [key for key in elsewhere(cfg, ".".join(parts[index:]))
                     if not walked or key.startswith(".".join(walked) + ".")]
            near = moved or spelled
            hint = f"did you mean {alternatives(near)}? " if near else ""
            raise ConfigError(f"unknown config key {dotted!r} (no {part!r} at {where}); {hint}valid keys there: "
                              f"{', '.join(keys) or '(none)'}")
        node = node[part]


def dotted_keys(cfg: DictConfig) -> list[str]:
    """Every key of ``cfg`` as a dotted path, groups and leaves alike (``method``, ``method.putm``, ...)."""
    def walk(node: Any, prefix: str) -> list[str]:
        found: list[str] = []
        if isinstance(node, dict):
            for key, value in node.items():
                found += [f"{prefix}{key}", *walk(value, f"{prefix}{key}.")]
        return found

    return walk(OmegaConf.to_container(cfg, resolve=False), "")


def elsewhere(cfg: DictConfig, tail: str) -> list[str]:
    """Full keys that end in ``tail`` (``rho`` → ``method.putm.rho``): the key was given without its group."""
    return [key for key in dotted_keys(cfg) if key.endswith("." + tail)]


def to_container(cfg: DictConfig | ListConfig) -> Any:
    return OmegaConf.to_container(cfg, resolve=True)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def is_trainer_override(override: Override) -> bool:
    """``trainer.<arg>=value``: an argument of ``pytorch_lightning.Trainer``."""
    return override.key.startswith("trainer.")


def trainer_arguments() -> set[str]:
    """Names of ``pytorch_lightning.Trainer``'s arguments."""
    import pytorch_lightning as pl  # heavy: only when a job is configured

    return set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}


def apply_trainer_overrides(cfg: DictConfig, overrides: Iterable[str | Override], reserved: dict[str, str],
                            job: str) -> DictConfig:
    """Set ``trainer.<arg>=value`` overrides, checked against ``pl.Trainer``'s signature and the job's own args."""
    overrides = Overrides.parse(overrides)
    valid = trainer_arguments() if overrides else set()  # Lightning is imported only to check a trainer.* key
    for override in overrides:
        key = override.key
        name = key.split(".", 1)[1]
        if name in reserved:
            raise ConfigError(f"{key} is set by {job} itself: {reserved[name]}")
        if "." in name or name not in valid:
            allowed = valid - set(reserved)
            raise ConfigError(f"unknown Trainer argument {key!r}; {did_you_mean(name, allowed, 'trainer.')}valid "
                              f"trainer.<name>: {', '.join(sorted(allowed))}")
        OmegaConf.update(cfg, key, override.value, merge=False, force_add=True)
    check_resolvable(cfg)
    for name in ("devices", "num_nodes"):  # Lightning builds a list of that many devices: 10**9 exhausts memory
        count = OmegaConf.select(cfg, f"trainer.{name}")
        if isinstance(count, int) and not isinstance(count, bool) and count > MAX_DEVICES:
            raise ConfigError(f"trainer.{name}={count} is more than any machine or cluster here has (at most "
                              f"{MAX_DEVICES}); give the number of GPUs/processes you want, e.g. trainer.{name}=2")
    return cfg


def build_trainer(options: dict[str, Any], **job_arguments: Any) -> Any:
    """``pl.Trainer(**options, **job_arguments)``; a rejected option becomes one readable :class:`ConfigError`."""
    import pytorch_lightning as pl
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    kwargs = {**options, **job_arguments}
    try:
        return pl.Trainer(**kwargs)
    except (TypeError, ValueError, ImportError, RuntimeError, MemoryError, MisconfigurationException) as exc:
        # e.g. accelerator=gpu on a CPU machine, accelerator=tpu without torch_xla, devices=10**10
        given = ", ".join(f"{key}={value}" for key, value in options.items())
        raise ConfigError(f"invalid trainer options ({given}): {' '.join(str(exc).split())}") from exc


def command_line_value(value: Any) -> str:
    """A value as it is written on the command line: ``null``, ``true``, ``[putm, simpleshot]``, ``{}``, ``0.5``."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(command_line_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {command_line_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def changed_keys(defaults: DictConfig, cfg: DictConfig, ignore: Sequence[str] = ()) -> dict[str, Any]:
    """``{dotted key: value}`` of every leaf of ``cfg`` that differs from ``defaults`` (new keys included)."""
    def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict):
            flat: dict[str, Any] = {}
            for key, value in node.items():
                flat.update(flatten(value, f"{prefix}{key}."))
            return flat
        return {prefix[:-1]: node}

    before, after = flatten(to_container(defaults)), flatten(to_container(cfg))
    return {k: v for k, v in after.items() if k not in ignore and before.get(k, object()) != v}


#: Keys a saved ``config.yaml`` holds that are a record, not a setting.
RECORD_ONLY_KEYS = ("provenance",)


def load_saved_config(path: str | Path, defaults: DictConfig) -> DictConfig:
    """A run's saved ``config.yaml`` merged over ``defaults`` (so re-running an older record gets new keys'
    defaults); a key the current schema does not know is an error naming it."""
    saved = load_yaml(Path(path))
    for key in RECORD_ONLY_KEYS:
        saved.pop(key, None)

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if prefix.startswith(("trainer.",)) or dotted == "trainer":
                continue  # any Trainer argument is allowed there
            try:
                _check_key(defaults, dotted)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None
            if isinstance(value, DictConfig) and not dotted.startswith(("method.", "data", "backbone")):
                walk(value, dotted + ".")

    walk(saved, "")
    return OmegaConf.merge(defaults, saved)
