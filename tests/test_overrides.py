"""The command line is parsed once, before any file is opened, and ``predict`` reuses evaluation's functions.

Every job turns its ``key=value`` arguments into :class:`~lightning_putm.config.Overrides` in one pass; the jobs
then take selectors (``config=``, ``data=``, ...) and ``trainer.*`` out by key and merge the rest. ``evaluate.py
predict`` gets its CL2N base features through evaluation's own ``checkpoint_data`` and ``base_split_features``
(no override strings), so the two commands share one feature cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from omegaconf import OmegaConf

import lightning_putm.config as config
import lightning_putm.evaluation.settings as evaluation_settings
from lightning_putm.config import Override, Overrides, apply_overrides
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.settings import checkpoint_data, load_evaluate_config
from lightning_putm.prediction.settings import load_predict_config
from lightning_putm.pretraining.settings import load_train_config


def test_parse_splits_and_yaml_parses_each_argument_in_order() -> None:
    overrides = Overrides.parse(["shots=[1,5]", "method.putm.rho=0.7", "alphas=[2,balanced]", "checkpoint=null",
                                 "name=a=b"])
    assert [o.key for o in overrides] == ["shots", "method.putm.rho", "alphas", "checkpoint", "name"]
    assert [o.value for o in overrides] == [[1, 5], 0.7, [2, "balanced"], None, "a=b"]
    assert overrides.texts() == ["shots=[1,5]", "method.putm.rho=0.7", "alphas=[2,balanced]", "checkpoint=null",
                                 "name=a=b"]  # as typed, for a recorded command line
    assert Overrides.parse(overrides) is overrides


def test_pop_takes_the_last_of_a_repeated_key_and_partition_keeps_the_order() -> None:
    overrides = Overrides.parse(["data=omniglot", "tasks=3", "trainer.devices=1", "data=digits",
                                 "trainer.max_epochs=2"])
    value, rest = overrides.pop("data")
    assert value == "digits" and rest.texts() == ["tasks=3", "trainer.devices=1", "trainer.max_epochs=2"]
    trainer, others = rest.partition(config.is_trainer_override)
    assert trainer.texts() == ["trainer.devices=1", "trainer.max_epochs=2"] and others.texts() == ["tasks=3"]
    assert overrides.pop("seed") == (None, overrides)
    assert overrides.last("tasks") == Override("tasks", "3", 3)
    assert (Overrides.parse(["a=1"]) + ["b=2"]).texts() == ["a=1", "b=2"]


@pytest.mark.parametrize("bad", ["shots", "=3", "shots=[1"])
def test_a_malformed_argument_is_an_error_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError, match="shots|key=value"):
        Overrides.parse(["tasks=3", bad])


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every split of an argument string and every YAML parse of a value, by key."""
    calls: list[str] = []
    split, parse = config.split_override, config.parse_value

    def counting_split(text: str) -> tuple[str, str]:
        calls.append(f"split {text.split('=')[0]}")
        return split(text)

    def counting_parse(key: str, raw: str) -> Any:
        calls.append(f"parse {key}")
        return parse(key, raw)

    monkeypatch.setattr(config, "split_override", counting_split)
    monkeypatch.setattr(config, "parse_value", counting_parse)
    return calls


@pytest.mark.parametrize(("load", "arguments"), [
    (load_evaluate_config, ["seed=3", "data=digits", "method.putm.rho=0.7", "trainer.accelerator=cpu"]),
    (load_train_config, ["seed=3", "data=digits", "lr=0.01", "trainer.accelerator=cpu"]),
    (load_predict_config, ["seed=3", "method=putm", "method.putm.rho=0.7", "batch_size=8"]),
], ids=["evaluate", "train", "predict"])
def test_each_argument_is_parsed_exactly_once(load: Callable[[list[str]], Any], arguments: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: a second pass that splits and YAML-parses the strings again (the old loaders made about six)."""
    calls = _count_parses(monkeypatch)
    load(arguments)
    keys = [a.split("=")[0] for a in arguments]
    assert sorted(calls) == sorted([f"split {k}" for k in keys] + [f"parse {k}" for k in keys])


@pytest.mark.parametrize("load", [load_evaluate_config, load_train_config, load_predict_config],
                         ids=["evaluate", "train", "predict"])
def test_a_malformed_argument_fails_before_any_file_is_opened(load: Callable[[list[str]], Any], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills: composing the YAML files or reading the checkpoint before the arguments are parsed."""
    checkpoint = tmp_path / "any.ckpt"
    checkpoint.write_bytes(b"not read")

    def opened(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a file was opened before the arguments were parsed")

    for module in (config, evaluation_settings):
        monkeypatch.setattr(module, "load_yaml", opened)
    monkeypatch.setattr(evaluation_settings, "checkpoint_data_config", opened)
    with pytest.raises(ConfigError, match=r"shots.*\[1"):
        load([f"checkpoint={checkpoint}", "shots=[1"])


def test_overrides_and_strings_merge_the_same() -> None:
    base = OmegaConf.create({"tasks": 1, "shots": [1], "method": {"putm": {"rho": 0.5}}})
    texts = ["tasks=7", "shots=[1,5]", "method.putm.rho=0.25"]
    assert apply_overrides(base, texts) == apply_overrides(base, Overrides.parse(texts))
    with pytest.raises(ConfigError, match="taks"):
        apply_overrides(base, Overrides.parse(["taks=3"]))


def test_checkpoint_data_is_what_evaluate_composes_for_the_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """``predict`` and ``evaluate.py checkpoint=...`` read a checkpoint's images with the same data settings."""
    composed = load_evaluate_config([f"checkpoint={tiny_checkpoint}"]).data
    assert OmegaConf.to_container(checkpoint_data(tiny_checkpoint)) == OmegaConf.to_container(composed)
    assert checkpoint_data(tiny_checkpoint, root=str(tmp_path)).root == str(tmp_path)


def test_predict_and_evaluate_share_the_base_split_cache(tiny_checkpoint: Path, tmp_path: Path,
                                                          single_thread) -> None:
    """Kills: predict building its own extraction (another cache key, a second extraction of the same split)."""
    from lightning_putm.evaluation.settings import settings_from_config
    from lightning_putm.evaluation.sources import Extraction, base_split_features
    from lightning_putm.features.cache import file_sha256
    from lightning_putm.prediction.checkpoint_splits import checkpoint_split
    from lightning_putm.prediction.settings import PredictSettings

    cache = tmp_path / "cache"
    cfg = load_evaluate_config([f"checkpoint={tiny_checkpoint}", f"feature_cache_dir={cache}", "progress=false",
                                "trainer.accelerator=cpu", "methods=[simpleshot]", f"output_dir={tmp_path / 'run'}"])
    lines: list[str] = []
    evaluated = base_split_features(cfg.data, Extraction.of(settings_from_config(cfg)), "train",
                                    file_sha256(tiny_checkpoint), lines.append)
    assert any("extracting the train split" in line for line in lines)
    settings = PredictSettings(checkpoint=tiny_checkpoint, support=tmp_path, query=tmp_path, method="simpleshot",
                               method_params={}, output=tmp_path / "p.csv", counts_output=tmp_path / "c.csv",
                               base_features="auto", data_root=None, feature_cache_dir=cache, batch_size=8, seed=0,
                               device=torch.device("cpu"), memory_budget_mb=64.0)
    lines.clear()
    predicted = checkpoint_split(settings, "train", lines.append)
    assert predicted == evaluated and lines == [f"base features: reusing the cache {evaluated}"]


def test_a_dataset_option_can_be_set_by_its_dotted_key_and_a_misspelt_one_is_refused_before_any_file(
        tmp_path: Path) -> None:
    """``data.options`` holds each dataset's own options, so its keys are not in the config files: the dotted form
    the docs give (``data.options.allow_pickle=true``, ``data.options.val_classes=[...]``) is accepted, and the
    dataset names the options it has for a misspelt one, before a run folder exists. Kills the dotted form refused
    as an unknown key (it was: only ``data.options={...}`` worked), and any group opened the same way."""
    from lightning_putm.jobs.train import run_train_backbone

    cfg = load_train_config(["data.options.val_classes=[0,1]", "data.options.val_fraction=0.3"])
    assert OmegaConf.to_container(cfg.data.options) == {"val_classes": [0, 1], "val_fraction": 0.3}
    assert load_train_config(["data=cifarfs", "data.options.allow_pickle=true"]).data.options.allow_pickle is True
    with pytest.raises(ConfigError, match=r"has no option\(s\) alow_pickle; its options: base_classes"):
        run_train_backbone([f"checkpoint_dir={tmp_path}", "data.options.alow_pickle=true", "logger=none"],
                           log=lambda _: None)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"unknown config key 'data.optons.val_fraction'.*did you mean data.options"):
        load_train_config(["data.optons.val_fraction=0.3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'data.rooot'.*did you mean data.root"):
        load_train_config(["data.rooot=/x"])  # data itself stays closed
