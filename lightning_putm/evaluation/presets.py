"""Method presets: named sets of a method's values (``method.putm.preset=paper``), in
``conf/method/presets/<method>/<preset>.yaml``, applied over the method's defaults before any other override."""

from __future__ import annotations

from typing import Iterable

from omegaconf import DictConfig, OmegaConf

from lightning_putm.config import Override, Overrides, conf_dir, group_options, load_group, load_yaml
from lightning_putm.errors import ConfigError
from lightning_putm.validators import did_you_mean

#: ``conf/method/presets/<method>/<preset>.yaml``: named sets of a method's values (``method.putm.preset=paper``).
PRESET_FOLDER = "presets"
PRESET_KEY = "preset"
#: Presets that were renamed: (method, old name) -> (new name, why). Naming the old one is an error that says so.
RENAMED_PRESETS = {("putm", "recommended"): (
    "support_anchored", "it was below the defaults on feature sets it was not selected on; the defaults are the "
    "recommended values, and `python -m lightning_putm tune` selects on your own validation classes")}


def preset_options(method: str) -> list[str]:
    """Named presets of a method: the YAML files in ``conf/method/presets/<method>/``."""
    return group_options(f"method/{PRESET_FOLDER}/{method}")


def apply_presets(cfg: DictConfig, overrides: Iterable[str | Override],
                  defaults_too: bool = True) -> tuple[DictConfig, Overrides]:
    """Merge each method's preset (``method.<name>.preset=<preset>``) over its defaults.

    A preset is a named set of values (``conf/method/presets/<name>/<preset>.yaml``), applied before every other
    override whatever the argument order, so ``method.putm.preset=paper method.putm.beta=0.7`` is the paper's
    preset with β = 0.7. Returns the config and the overrides left to apply. With ``defaults_too`` the preset a
    method's YAML names by default is applied as well (``reference``: the defaults themselves); without it (a re-run
    of a saved config, which holds its preset's values already) only presets named in ``overrides`` are, and they
    replace that method's saved values.
    """
    def names_preset(override: Override) -> bool:
        parts = override.key.split(".")
        return len(parts) == 3 and parts[0] == "method" and parts[2] == PRESET_KEY

    presets, rest = Overrides.parse(overrides).partition(names_preset)
    chosen = {o.key.split(".")[1]: o.raw.strip() for o in presets}
    for name, preset in chosen.items():
        if name not in cfg.method or PRESET_KEY not in cfg.method[name]:
            with_presets = [m for m in cfg.method if PRESET_KEY in cfg.method[m]]
            raise ConfigError(f"`method.{name}.preset`: {name!r} has no presets; {did_you_mean(name, with_presets)}"
                              f"methods with presets: {', '.join(with_presets) or '(none)'}")
    for name in list(cfg.method):
        if PRESET_KEY not in cfg.method[name] or (name not in chosen and not defaults_too):
            continue
        preset = chosen.get(name, str(cfg.method[name][PRESET_KEY]))
        options = preset_options(name)
        if (name, preset) in RENAMED_PRESETS:
            renamed, why = RENAMED_PRESETS[name, preset]
            raise ConfigError(f"`method.{name}.preset={preset}` is now `method.{name}.preset={renamed}` (same values): "
                              f"{why}")
        if preset not in options:
            raise ConfigError(f"`method.{name}.preset` must be one of {', '.join(options)}; got {preset!r}"
                              + (f"; {did_you_mean(preset, options).strip()}" if did_you_mean(preset, options) else ""))
        values = load_yaml(conf_dir() / "method" / PRESET_FOLDER / name / f"{preset}.yaml")
        unknown = sorted(str(k) for k in values if k not in cfg.method[name] or k == PRESET_KEY)
        if unknown:
            raise ConfigError(f"preset {name}/{preset} sets unknown keys {', '.join(unknown)}")
        # a preset replaces the method's section (defaults, then the preset): on a re-run from a saved config, naming a
        # preset discards that method's saved values
        cfg.method[name] = OmegaConf.merge(load_group("method", name), values, {PRESET_KEY: preset})
    return cfg, rest
