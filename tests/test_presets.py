"""Named presets of a method's values (``method.putm.preset=paper``): applied under explicit keys, recorded, checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_putm.config import conf_dir
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.presets import preset_options
from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
from lightning_putm.methods import build_method


def putm_params(*overrides: str) -> dict:
    return settings_from_config(load_evaluate_config(["methods=[putm]", *overrides])).method_params["putm"]


def test_reference_is_the_default_and_changes_nothing():
    defaults = yaml.safe_load((conf_dir() / "method" / "putm.yaml").read_text())
    assert defaults["preset"] == "reference"
    params = putm_params()
    assert "preset" not in params  # the preset's name is config, not a PUTM argument
    assert params == {k: v for k, v in defaults.items() if k != "preset"}
    assert putm_params("method.putm.preset=reference") == params


def test_paper_preset_sets_the_papers_values_and_algorithm_1():
    paper = putm_params("method.putm.preset=paper")
    assert (paper["beta"], paper["rho"], paper["inertia"], paper["reinit_navigator"]) == (0.5, 0.2, 0.1, True)
    settings = build_method("putm", paper, shots=1, balanced=True).settings
    assert (settings.beta, settings.rho, settings.inertia, settings.reinit_navigator) == (0.5, 0.2, 0.1, True)
    assert paper["em_steps"] == putm_params()["em_steps"]  # keys the preset does not name keep their defaults


@pytest.mark.parametrize("order", ["preset_first", "preset_last"])
def test_explicit_keys_win_over_the_preset_in_any_order(order):
    overrides = ["method.putm.preset=paper", "method.putm.beta=0.7"]
    params = putm_params(*(overrides if order == "preset_first" else overrides[::-1]))
    assert params["beta"] == 0.7 and params["rho"] == 0.2


def test_fast_preset_cuts_the_solver_steps_and_nothing_else():
    fast, defaults = putm_params("method.putm.preset=fast"), putm_params()
    assert (fast["em_steps"], fast["inner_steps"]) == (8, 30)
    assert {k: v for k, v in fast.items() if k not in ("em_steps", "inner_steps")} == \
        {k: v for k, v in defaults.items() if k not in ("em_steps", "inner_steps")}
    settings = build_method("putm", fast, shots=1, balanced=False).settings
    assert (settings.em_steps, settings.inner_steps) == (8, 30)


def test_support_anchored_preset_has_fewer_steps_and_heavier_support_rows_that_reach_the_m_step():
    recommended, defaults = putm_params("method.putm.preset=support_anchored"), putm_params()
    assert (recommended["em_steps"], recommended["inner_steps"], recommended["support_weight"]) == (20, 10, 10.0)
    assert defaults["support_weight"] == 1.0
    changed = ("em_steps", "inner_steps", "support_weight")
    assert {k: v for k, v in recommended.items() if k not in changed} == \
        {k: v for k, v in defaults.items() if k not in changed}
    settings = build_method("putm", recommended, shots=1, balanced=True).settings
    assert (settings.support_weight, settings.em_steps, settings.inner_steps) == (10.0, 20, 10)


def test_bad_presets_are_one_clear_error():
    with pytest.raises(ConfigError, match=r"method.putm.preset.*one of fast, paper, reference, support_anchored.*'nope'"):
        putm_params("method.putm.preset=nope")
    with pytest.raises(ConfigError, match=r"method.simpleshot.preset.*no presets.*putm"):
        putm_params("method.simpleshot.preset=paper")


def test_the_renamed_recommended_preset_says_its_new_name_and_why():
    """Kills: `recommended` still accepted (a name that promised more than the preset gave on unseen features), or
    rejected with only the list of presets (the user is not told it was renamed, nor what to use)."""
    assert "recommended" not in preset_options("putm")
    with pytest.raises(ConfigError, match=r"preset=recommended` is now `method.putm.preset=support_anchored`.*defaults "
                                          r"are the recommended values.*tune"):
        putm_params("method.putm.preset=recommended")


def test_every_shipped_preset_builds_and_names_only_known_keys():
    defaults = yaml.safe_load((conf_dir() / "method" / "putm.yaml").read_text())
    assert {"reference", "paper", "fast", "support_anchored"} <= set(preset_options("putm"))
    for preset in preset_options("putm"):
        values = yaml.safe_load((conf_dir() / "method" / "presets" / "putm" / f"{preset}.yaml").read_text()) or {}
        assert set(values) <= set(defaults) - {"preset"}, preset
        build_method("putm", putm_params(f"method.putm.preset={preset}"), shots=5, balanced=False)


def test_rerun_from_a_saved_config_keeps_the_runs_values(tmp_path: Path):
    cfg = load_evaluate_config(["methods=[putm]", "method.putm.preset=paper", "method.putm.rho=0.4"])
    saved = tmp_path / "config.yaml"
    from omegaconf import OmegaConf
    saved.write_text(OmegaConf.to_yaml(cfg))
    again = settings_from_config(load_evaluate_config([f"config={saved}"])).method_params["putm"]
    assert again["rho"] == 0.4 and again["beta"] == 0.5  # the saved value, not the preset's 0.2 applied again
    reset = settings_from_config(load_evaluate_config([f"config={saved}", "method.putm.preset=reference"]))
    assert reset.method_params["putm"] == putm_params()  # naming a preset replaces the saved section whole
