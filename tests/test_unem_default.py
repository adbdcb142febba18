"""UNEM's default (``method.unem.learned: auto``) and ``fit-unem``'s choice of queries.

* ``evaluate.py checkpoint=...`` fits UNEM on the checkpoint's validation classes once, caches the result by its
  inputs and reuses it; a changed input fits again; the run's provenance names the file;
* a fit less accurate than the untrained start on held-out validation tasks is not used;
* without validation classes (the demo, a feature file, the val split evaluated itself) the default is the
  untrained start, said in one notice;
* ``learned=mini_resnet18`` (the old default, the authors' published values) gives the numbers it gave before;
* ``fit-unem`` takes as many queries as the classes hold instead of stopping.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_clustered_features
from lightning_putm.errors import DataError
from lightning_putm.evaluation import unem_default
from lightning_putm.evaluation.unem_default import CACHE_FOLDER, fit_default, fit_queries
from lightning_putm.features.files import FeatureSet, save_features
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.methods.unem import UNEMParams, load_params
from lightning_putm.studies import fit_unem

pytestmark = pytest.mark.usefixtures("single_thread")

QUICK = ["methods=[unem]", "logger=none", "plots=false", "progress=false", "tasks=4", "shots=[1]", "alphas=[2]",
         "base_features=null", "method.unem.fit_tasks=6"]


def evaluate(folder: Path, *extra: str) -> tuple[list, list[str]]:
    lines: list[str] = []
    results = run_evaluate([*QUICK, f"output_dir={folder}", *extra], log=lines.append)
    return results, lines


def count_fits(monkeypatch) -> list[int]:
    """The fits run from now on (the real fit still runs: its result is what the cache holds)."""
    calls: list[int] = []
    real = unem_default.fit_params
    monkeypatch.setattr(unem_default, "fit_params", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def assert_params_close(actual: dict, expected: dict) -> None:
    """UNEM's parameters as dictionaries of numbers and lists, equal key for key up to float rounding (pytest.approx
    takes no nested containers)."""
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value), key


def provenance(folder: Path) -> dict:
    return yaml.safe_load((folder / "config.yaml").read_text())["provenance"]


def test_the_default_fits_on_the_checkpoints_validation_classes_once_and_refits_when_an_input_changes(
        tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """Kills: a default that never fits (the untrained start or the published values where validation classes
    exist), a fit on the evaluated (test) split, a cache that is not read back (a second fit), one that is served
    for other inputs (seed, fit_tasks), results that do not use the fitted file, a provenance that does not name it,
    a choice between fit and untrained start that contradicts the held-out accuracies it records."""
    calls = count_fits(monkeypatch)
    cache = tmp_path / "cache"
    source = [f"checkpoint={tiny_checkpoint}", f"feature_cache_dir={cache}"]
    results, lines = evaluate(tmp_path / "a", *source)
    assert calls == [1]
    assert any("extracting the val split of digits" in line for line in lines), lines
    assert not any(line.startswith("notice: unem") for line in lines)
    [file] = (cache / CACHE_FOLDER).glob("auto-*-1shot.json")
    meta = json.loads(file.read_text())["meta"]
    assert meta["shots"] == 1 and meta["fit"]["tasks"] == 6 and meta["held_out"]["tasks"] == 6
    assert "digits/val" in meta["source"]  # the validation split, not the evaluated test split
    fitted, initial = meta["held_out_accuracy"]
    assert meta["chosen"] == ("fitted" if fitted >= initial else "initial")
    used = load_params(file)
    expected = meta["fitted"] if meta["chosen"] == "fitted" else UNEMParams.initial().to_dict()
    assert_params_close(used.to_dict(), expected)
    assert results[0].learned["params"]["t2"] == pytest.approx(used.t2.tolist())
    assert provenance(tmp_path / "a")["learned"]["unem"]["1-shot"].startswith(str(file))

    results_again, lines = evaluate(tmp_path / "b", *source)
    assert calls == [1] and any("reusing" in line and str(file) in line for line in lines), lines
    assert torch.equal(results_again[0].accuracies, results[0].accuracies)
    evaluate(tmp_path / "c", *source, "seed=1")  # other validation tasks: another key
    assert calls == [1, 1]
    evaluate(tmp_path / "d", *source, "method.unem.fit_tasks=7")
    assert calls == [1, 1, 1] and len(list((cache / CACHE_FOLDER).glob("*.json"))) == 3


def test_a_fit_below_the_untrained_start_on_held_out_tasks_is_not_used(tmp_path: Path, monkeypatch) -> None:
    """A fit that ruins UNEM (a class-balance weight of 50 from the second layer on pulls every query into the
    largest class) must lose to the untrained start on the held-out validation tasks. Kills: no check (the fit
    used whatever it is), the comparison inverted, a cache entry holding the rejected values."""
    ruinous = UNEMParams.from_values(1.0, [1.0] + [50.0] * 9, [-5.0] * 10)
    monkeypatch.setattr(unem_default, "fit_params", lambda *a, **k: (ruinous, [2.0, 1.0]))
    validation = make_clustered_features(classes=8, per_class=30, dim=16, spread=0.6)
    fit = fit_default(validation, 1, 5, 25, 0, "none", tmp_path, log=lambda _: None, tasks=40)
    assert not fit.fitted and fit.fitted_accuracy < fit.initial_accuracy - 10
    assert load_params(fit.path).to_dict() == UNEMParams.initial().to_dict()
    meta = json.loads(fit.path.read_text())["meta"]
    assert meta["chosen"] == "initial" and meta["fitted"]["gamma"][1] == 50.0


def test_the_cache_is_keyed_by_the_validation_features_content(tmp_path: Path, monkeypatch) -> None:
    """A copy of the same features and labels (another object, other names, no metadata) reuses the fit; one
    feature value or two labels changed fit again, into another file. Kills: a key of the settings alone (a
    changed checkpoint served the old fit), one over the features but not the labels, one tied to the object or
    its metadata (the same content fitted twice)."""
    calls = count_fits(monkeypatch)
    validation = make_clustered_features(classes=8, per_class=30, dim=16, spread=0.6)

    def fit(features: torch.Tensor, labels: torch.Tensor, names: list[str]):
        return fit_default(FeatureSet(features, labels, names), 1, 5, 15, 0, "none", tmp_path, log=lambda _: None,
                           tasks=6)

    first = fit(validation.features, validation.labels, validation.class_names)
    again = fit(validation.features.clone(), validation.labels.clone(), [f"other_{c}" for c in range(8)])
    assert calls == [1] and again.reused and again.path == first.path
    assert_params_close(again.params.to_dict(), first.params.to_dict())
    nudged = validation.features.clone()
    nudged[3, 2] += 1e-3
    changed = fit(nudged, validation.labels, validation.class_names)
    swapped = validation.labels.clone()
    swapped[[0, -1]] = swapped[[-1, 0]]  # one image of class 0 and one of class 7 trade labels
    relabelled = fit(validation.features, swapped, validation.class_names)
    assert calls == [1, 1, 1] and not changed.reused and not relabelled.reused
    assert len({first.path, changed.path, relabelled.path}) == 3


@pytest.mark.parametrize("where", ["demo", "feature file", "val split"])
def test_without_validation_classes_the_default_is_the_untrained_start_with_one_notice(
        where: str, tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """Kills: a fit on the evaluated classes (split=val), a fit attempted where no validation classes exist, a
    default other than t1 = gamma = t2 = 1 there, the notice missing or repeated per setting."""
    source = {"demo": [], "val split": [f"checkpoint={tiny_checkpoint}", "split=val",
                                        f"feature_cache_dir={tmp_path / 'cache'}"]}.get(where)
    if source is None:
        path = save_features(make_clustered_features(classes=6, per_class=30), tmp_path / "novel.pt")
        source = [f"features={path}"]
    calls = count_fits(monkeypatch)
    extra = [*source, "shots=[1,5]", "alphas=[2,balanced]"]
    results, lines = evaluate(tmp_path / "auto", *extra)
    notices = [line for line in lines if line.startswith("notice: unem")]
    assert calls == [] and len(notices) == 1 and "untrained start" in notices[0]
    assert {"demo": "digits pixels", "feature file": "feature file", "val split": "val split itself"}[where] in notices[0]
    initial, _ = evaluate(tmp_path / "initial", *extra, "method.unem.learned=initial")
    assert [r.accuracies.tolist() for r in results] == [r.accuracies.tolist() for r in initial]
    assert results[0].learned["params"] == initial[0].learned["params"]
    assert "untrained start" in provenance(tmp_path / "auto")["learned"]["unem"]["1-shot"]


#: Correct queries (of 75) per task of UNEM with ``learned=mini_resnet18``, the default until 2026-11-28, on the
#: first 20 demo tasks at 1 shot, α = 2: recorded by ``evaluate.py`` before ``auto`` existed (one thread).
OLD_DEFAULT_CORRECT = [64, 51, 57, 57, 74, 57, 41, 59, 38, 51, 59, 39, 51, 71, 74, 67, 44, 66, 50, 68]


def test_the_published_values_give_the_numbers_of_the_old_default(tmp_path: Path) -> None:
    """The untrained start gives other counts on tasks 0, 1 and 10 (67, 50, 60). Kills: the named choice rerouted
    to ``auto`` or ``initial``, or any change of its results."""
    results, lines = evaluate(tmp_path / "run", "tasks=20", "method.unem.learned=mini_resnet18")
    correct = (results[0].accuracies.double() * 75).round().long().tolist()
    assert correct == OLD_DEFAULT_CORRECT
    assert not any(line.startswith("notice: unem") for line in lines)
    assert provenance(tmp_path / "run")["learned"]["unem"]["1-shot"] == "learned mini_resnet18"


def test_fit_queries_keeps_the_count_the_classes_hold_and_lowers_it_otherwise() -> None:
    """20 images per class (Omniglot's size). Kills: a count lowered although it fits, one that still cannot be
    drawn, a balanced count that is no multiple of the ways."""
    labels = torch.arange(8).repeat_interleave(20)
    assert fit_queries(labels, 5, 1, 15, [2.0, None], 50, 0) == 15
    lowered = fit_queries(labels, 5, 5, 75, [2.0], 50, 0)
    assert 5 <= lowered < 75
    balanced = fit_queries(labels, 5, 5, 77, [2.0, None], 50, 0)
    assert balanced % 5 == 0 and balanced <= 75
    with pytest.raises(DataError):
        fit_queries(labels, 5, 21, 15, [2.0], 50, 0)  # no class holds 21 support images


def test_fit_unem_chooses_the_queries_the_classes_hold(tmp_path: Path, capsys) -> None:
    """``fit-unem`` on classes of 20 images at 5 shots: the reference's 75 queries cannot be drawn. Kills: stopping
    with an error under ``--queries auto``, a count printed but not used, an explicit ``--queries`` silently
    changed instead of refused with one that works."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(8).repeat_interleave(20)
    features = torch.rand(8, 6, generator=generator)[labels] + 0.3 * torch.randn(160, 6, generator=generator)
    path = save_features(FeatureSet(features, labels, [f"c{i}" for i in range(8)]), tmp_path / "val.pt")
    out = tmp_path / "unem_{shots}shot.json"
    fit_unem.main(["--features", str(path), "--shots", "5", "--tasks", "5", "--iterations", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    meta = json.loads((tmp_path / "unem_5shot.json").read_text())["meta"]
    chosen = meta["episodes"]["queries"]
    assert chosen < 75 and f"using {chosen}, the largest that can" in printed, printed
    with pytest.raises(DataError, match=r"--queries=\d+ works"):
        fit_unem.main(["--features", str(path), "--shots", "5", "--tasks", "5", "--iterations", "2", "--queries", "75",
                       "--out", str(tmp_path / "explicit.json")])
    assert not (tmp_path / "explicit.json").exists()
