"""``checkpoint=timm:<model name>``: a pretrained timm model as the backbone of ``evaluate.py`` and its ``predict``.

No network anywhere: every test runs with ``HF_HUB_OFFLINE=1`` and an empty hub cache in tmp. The "pretrained"
weights are those of ``timm.create_model(..., pretrained=False)`` saved to a local file (.safetensors and .pth), so
the tests know exactly which weights the features must come from. ``test_byobnet`` (timm's tiny test network,
256-d post-ReLU features) keeps extraction to seconds; the digits are cut to two novel and two base classes.
"""

from __future__ import annotations

import csv
import os
import socket
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from lightning_putm.data.registry import read_split
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.features.cache import file_sha256
from lightning_putm.methods.calibration import scale_probabilities
from lightning_putm.features.files import FeatureSet, load_features, save_features
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.predict import run_predict

pytestmark = pytest.mark.usefixtures("single_thread")  # small tensor ops: no OpenMP spin-waits on 2 busy cores
timm = pytest.importorskip("timm")
from safetensors.torch import save_file  # noqa: E402  (installed with timm)

MODEL = "test_byobnet"
TAGGED = "test_byobnet.r160_in1k"  # its pretrained tag: the name the hub cache is keyed by
DIGITS = {"novel_classes": [5, 6], "base_classes": [0, 1]}
DATA = ["data=digits", "data.options={novel_classes: [5,6], base_classes: [0,1]}", "ways=2"]
FAST = ["methods=[simpleshot,putm]", "method.putm.em_steps=2", "method.putm.inner_steps=3", "shots=[1]",
        "alphas=[2]", "tasks=3", "progress=false", "logger=none", "plots=false", *DATA]


def model_with_seed(seed: int, name: str = MODEL, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, **kwargs).eval()


def offline_environment(patch: pytest.MonkeyPatch, folder: Path) -> None:
    """No download can happen: offline mode, and empty hub and torch hub caches of our own."""
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("HF_HUB_CACHE", str(folder / "hub"))
    patch.setenv("TORCH_HOME", str(folder / "torch"))


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path) -> None:
    offline_environment(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[str, Path]:
    """Two different weight sets of the model (seed 0 as safetensors, seed 1 as a torch.save'd state dict)."""
    folder = tmp_path_factory.mktemp("weights")
    save_file(model_with_seed(0).state_dict(), str(folder / "a.safetensors"))
    torch.save(model_with_seed(1).state_dict(), folder / "b.pth")
    return {"a": folder / "a.safetensors", "b": folder / "b.pth"}


def evaluate(folder: Path, cache: Path, *extra: str) -> tuple[list, list[str]]:
    lines: list[str] = []
    results = run_evaluate([f"checkpoint=timm:{MODEL}", f"output_dir={folder}", f"feature_cache_dir={cache}", *FAST,
                            *extra], log=lines.append)
    return results, lines


@pytest.fixture(scope="module")
def first_run(weights, tmp_path_factory, single_thread) -> dict:
    """One evaluation from the safetensors file with base_features=split:train: both splits extracted and cached."""
    folder = tmp_path_factory.mktemp("first_run")
    with pytest.MonkeyPatch.context() as patch:
        offline_environment(patch, folder)
        results, lines = evaluate(folder / "out", folder / "cache", f"pretrained_file={weights['a']}",
                                  "base_features=split:train")
    return {"results": results, "lines": lines, "cache": folder / "cache", "out": folder / "out"}


def cache_file(cache: Path, split: str, sha: str) -> Path:
    found = sorted(cache.glob(f"digits-{split}-{sha[:12]}-*.pt"))
    assert len(found) == 1, found
    return found[0]


@torch.no_grad()
def reference_features(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """What the features must be: each in-memory [1, 8, 8] digit as an 8-bit RGB image through the model's own
    timm preprocessing, then the pooled pre-logits (the classifier removed)."""
    model.reset_classifier(0)
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model), is_training=False)
    rgb = [Image.fromarray((image[0] * 255).round().to(torch.uint8).numpy(), "L").convert("RGB") for image in images]
    return model(torch.stack([transform(image) for image in rgb]))


def test_evaluation_extracts_the_models_features_with_its_own_preprocessing(first_run, weights):
    """Kills: reading the data's own 8×8 transform, random weights instead of the file's, keeping the classifier
    (1000-d logits), a cache key without the weights' content hash or the model's name."""
    results, lines, cache = first_run["results"], first_run["lines"], first_run["cache"]
    assert {(r.method, r.shots) for r in results} == {("simpleshot", 1), ("putm", 1)}
    assert all(len(r.accuracies) == 3 and bool(((r.accuracies >= 0) & (r.accuracies <= 1)).all()) for r in results)
    assert any(f"timm:{MODEL}: weights from pretrained_file={weights['a']}" in line for line in lines)
    assert any("base features: extracting the train split of digits" in line for line in lines)
    assert any("features: extracting the test split of digits" in line for line in lines)
    sha = file_sha256(weights["a"])
    test = load_features(cache_file(cache, "test", sha))
    train = load_features(cache_file(cache, "train", sha))
    assert test.metadata["cache_key"]["model"] == MODEL and test.metadata["cache_key"]["checkpoint_sha256"] == sha
    assert "TimmPreprocess" in test.metadata["cache_key"]["transform"]
    split = read_split("digits", None, "test", **DIGITS)
    assert test.features.shape == (len(split), 256) and len(train) == len(read_split("digits", None, "train", **DIGITS))
    expected = reference_features(model_with_seed(0), split.images[:6])
    assert torch.allclose(test.features[:6], expected, atol=1e-4, rtol=1e-4)


def test_a_rerun_from_its_config_and_from_the_hub_cache_reuses_the_cached_features(first_run, weights, tmp_path):
    """The same weights reached another way (the saved config.yaml; the hub cache instead of pretrained_file) are
    the same cache entries: nothing is extracted again. Kills a key on the file's path instead of its content."""
    results, lines = evaluate(tmp_path / "again", first_run["cache"], f"config={first_run['out'] / 'config.yaml'}")
    assert not any("extracting" in line for line in lines)
    assert sum("reusing the cache" in line for line in lines) == 2  # base (train) and evaluated (test) split
    assert [r.accuracies.tolist() for r in results] == [r.accuracies.tolist() for r in first_run["results"]]

    snapshot = Path(os.environ["HF_HUB_CACHE"]) / f"models--timm--{TAGGED}"  # the hub cache's own layout
    revision = "0" * 40
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text(revision)
    (snapshot / "snapshots" / revision).mkdir(parents=True)
    (snapshot / "snapshots" / revision / "model.safetensors").write_bytes(weights["a"].read_bytes())
    _, lines = evaluate(tmp_path / "hub", first_run["cache"], "methods=[simpleshot]", "base_features=null")
    assert any("weights from the Hugging Face hub cache" in line for line in lines)
    assert not any("extracting" in line for line in lines) and any("reusing the cache" in line for line in lines)


def test_other_weights_give_other_features_and_their_own_cache_entry(first_run, weights, tmp_path):
    """Kills a cache that mixes weight files (the .pth of another seed must be extracted anew and differ)."""
    cache = first_run["cache"]
    _, lines = evaluate(tmp_path / "b", cache, f"pretrained_file={weights['b']}", "methods=[simpleshot]",
                        "base_features=null")
    assert any("features: extracting the test split" in line for line in lines)
    a = load_features(cache_file(cache, "test", file_sha256(weights["a"])))
    b = load_features(cache_file(cache, "test", file_sha256(weights["b"])))
    assert a.features.shape == b.features.shape and not torch.allclose(a.features, b.features)
    split = read_split("digits", None, "test", **DIGITS)
    assert torch.allclose(b.features[:4], reference_features(model_with_seed(1), split.images[:4]), atol=1e-4,
                          rtol=1e-4)


def test_weights_without_a_classifier_load_and_give_the_same_features(tmp_path):
    """A state dict saved from ``num_classes=0`` (no head) is complete for the feature extractor. Kills building
    the model with timm's 1000 classes regardless of the file (strict loading would fail)."""
    from lightning_putm.models.timm_pretrained import TimmWeights, load_timm_backbone

    full = model_with_seed(3).state_dict()
    headless = model_with_seed(4, num_classes=0).state_dict()
    assert set(headless) < set(full)  # the same keys less the classifier's
    save_file({k: full[k] for k in headless}, str(tmp_path / "headless.safetensors"))
    torch.save(full, tmp_path / "full.pth")
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        one = load_timm_backbone(TimmWeights(MODEL, tmp_path / "headless.safetensors", "test"))(x)
        two = load_timm_backbone(TimmWeights(MODEL, tmp_path / "full.pth", "test"))(x)
    assert one.shape == (2, 256) and torch.allclose(one, two)


# --------------------------------------------------------------------------------------------------- predict
def digit_folders(root: Path) -> tuple[Path, Path]:
    """support/<digit>/ (2 images each) and query/ (3 per digit) as grayscale PNGs of scikit-learn's digits."""
    split = read_split("digits", None, "test", **DIGITS)
    support, query = root / "support", root / "query"
    for label, name in enumerate(split.class_names):
        rows = torch.nonzero(split.labels == label).flatten()[:5].tolist()
        for count, row in enumerate(rows):
            folder = support / f"digit_{name}" if count < 2 else query
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (split.images[row, 0] * 255).round().to(torch.uint8).numpy()
            Image.fromarray(pixels, "L").resize((32, 32)).save(folder / f"{name}_{count}.png")
    return support, query


def test_predict_with_a_timm_model_labels_grayscale_folders(weights, tmp_path):
    """Grayscale PNGs go through the model's RGB preprocessing; CL2N falls back to L2N with a notice (a timm model
    records no base classes). Kills a reader that keeps one channel (the stem expects three) or the data transform."""
    support, query = digit_folders(tmp_path)
    lines: list[str] = []
    output = tmp_path / "out" / "predictions.csv"
    result = run_predict([f"checkpoint=timm:{MODEL}", f"pretrained_file={weights['b']}", f"support={support}",
                          f"query={query}", f"output={output}", "method=simpleshot"], log=lines.append)
    assert result.probabilities.shape == (6, 2)
    assert torch.allclose(result.probabilities.sum(1), torch.ones(6), atol=1e-5)
    with open(output, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(r["file"] for r in rows) == sorted(p.name for p in query.iterdir())
    assert any(f"timm:{MODEL} (weights from pretrained_file={weights['b']})" in line for line in lines)
    assert any(f"timm:{MODEL} preprocessing: RGB" in line for line in lines)
    assert result.normalisation.startswith("L2N") and any("notice" in line and "timm" in line for line in lines)


def test_predict_with_a_timm_model_calibrates_on_a_given_feature_file_or_says_it_cannot(weights, tmp_path):
    """auto: a timm model records no validation classes, so the probabilities stay raw and a notice says how to
    calibrate; calibration=<labelled feature file> fits the temperature on it."""
    support, query = digit_folders(tmp_path)
    args = [f"checkpoint=timm:{MODEL}", f"pretrained_file={weights['b']}", f"support={support}", f"query={query}",
            f"output={tmp_path / 'out' / 'p.csv'}", f"feature_cache_dir={tmp_path / 'cache'}", "method=protonet"]
    lines: list[str] = []
    raw = run_predict(args, log=lines.append)
    assert raw.calibration is None and torch.equal(raw.probabilities, raw.raw_probabilities)
    assert any(line.startswith("notice: probabilities are the method's own (uncalibrated): a timm model") and
               "calibration=<feature file" in line for line in lines)
    generator = torch.Generator().manual_seed(0)
    centres = torch.rand(6, 256, generator=generator)
    separable = FeatureSet(centres.repeat_interleave(10, 0) + 0.3 * torch.rand(60, 256, generator=generator),
                           torch.arange(6).repeat_interleave(10), [f"c{i}" for i in range(6)])
    lines.clear()  # every calibration query right: no temperature fits (the search would end at T = 0.0003)
    kept = run_predict(args + [f"calibration={save_features(separable, tmp_path / 'separable.pt')}",
                                "calibration_tasks=20"], log=lines.append)
    assert kept.calibration is None and torch.equal(kept.probabilities, kept.raw_probabilities)
    assert any("labelled every query of the 20 tasks of separable.pt correctly" in line for line in lines), lines
    labelled = FeatureSet(centres.repeat_interleave(10, 0) + torch.randn(60, 256, generator=generator),
                          torch.arange(6).repeat_interleave(10), [f"c{i}" for i in range(6)])
    path = save_features(labelled, tmp_path / "labelled.pt")
    lines.clear()
    fitted = run_predict(args + [f"calibration={path}", "calibration_tasks=20"], log=lines.append)
    assert fitted.calibration is not None and fitted.calibration.tasks == 20
    assert torch.allclose(fitted.probabilities, scale_probabilities(raw.raw_probabilities,
                                                                    fitted.calibration.temperature))
    assert any(line.startswith("calibration: protonet on 20 labelled tasks of labelled.pt") for line in lines)
    single = save_features(FeatureSet(centres, torch.arange(6), [f"c{i}" for i in range(6)]), tmp_path / "single.pt")
    elsewhere = tmp_path / "other" / "p.csv"
    with pytest.raises(DataError, match=r"calibration=.*single\.pt: .*class"):  # one image per class: no task
        run_predict([*args[:4], f"output={elsewhere}", *args[5:], f"calibration={single}"])
    assert not elsewhere.parent.exists()
    one_class = save_features(FeatureSet(centres[:3], torch.zeros(3, dtype=torch.long), ["c0"]), tmp_path / "one.pt")
    with pytest.raises(DataError, match=r"one\.pt has 1 classes but the task has 2"):
        run_predict([*args[:4], f"output={elsewhere}", *args[5:], f"calibration={one_class}"])
    assert not elsewhere.parent.exists()


def test_predict_refuses_a_base_split_for_a_timm_model_before_writing(weights, tmp_path):
    support, query = digit_folders(tmp_path)
    output = tmp_path / "out" / "predictions.csv"
    with pytest.raises(ConfigError, match="base_features=split:train: a timm model records no training data"):
        run_predict([f"checkpoint=timm:{MODEL}", f"pretrained_file={weights['a']}", f"support={support}",
                     f"query={query}", f"output={output}", "method=simpleshot", "base_features=split:train"])
    assert not output.parent.exists()


# ---------------------------------------------------------------------------------------------------- errors
def refused(tmp_path: Path, error: type, match: str, *extra: str) -> None:
    """``evaluate.py`` stops with ``error`` before any run folder or cache file exists."""
    with pytest.raises(error, match=match):
        evaluate(tmp_path / "out", tmp_path / "cache", *extra)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_an_unknown_model_name_gets_the_closest_timm_names(tmp_path):
    with pytest.raises(ConfigError, match=r"timm has no model 'test_byobnett'; did you mean timm:test_byobnet\b"):
        run_evaluate([f"checkpoint=timm:{MODEL}t", f"output_dir={tmp_path / 'out'}", *FAST])
    with pytest.raises(ConfigError, match=r"no pretrained tag 'r161_in1k'; did you mean timm:test_byobnet.r160_in1k"):
        run_evaluate([f"checkpoint=timm:{MODEL}.r161_in1k", f"output_dir={tmp_path / 'out'}", *FAST])
    with pytest.raises(ConfigError, match="timm has no model 'resnet5O'"):
        run_predict(["checkpoint=timm:resnet5O", f"support={tmp_path}", f"query={tmp_path}"])
    assert not (tmp_path / "out").exists()


def test_no_weights_offline_is_one_line_naming_the_fixes(tmp_path):
    """Nothing cached, HF_HUB_OFFLINE=1: no download is attempted, the message says pretrained_file= or the cache."""
    refused(tmp_path, DataError, r"not in the hub cache .* HF_HUB_OFFLINE=1 forbids downloads; pass "
                                 r"pretrained_file=<weights file of test_byobnet>, or run once with network access")


def test_no_network_is_found_quickly_without_the_offline_flag(tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE the hub's host is probed once (here a closed local port: refused at once) instead of
    the hub client's minute of retries."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    refused(tmp_path, DataError, rf"there is no network \(127.0.0.1:{port} does not answer")
    assert time.monotonic() - start < 10


def test_a_pretrained_file_that_does_not_exist_or_without_a_timm_model_is_refused(tmp_path):
    refused(tmp_path, ConfigError, "pretrained_file=.*missing.safetensors: file not found",
            f"pretrained_file={tmp_path / 'missing.safetensors'}")
    with pytest.raises(ConfigError, match="use it with checkpoint=timm:<model name>"):
        run_evaluate([f"checkpoint={tmp_path / 'best.ckpt'}", f"pretrained_file={tmp_path}", *FAST])


def test_weights_of_another_model_name_the_file_and_the_keys(tmp_path):
    """Kills a non-strict load (timm drops the classifier and loads the rest leniently: a partial file would give
    silently random layers)."""
    other = tmp_path / "resnet.safetensors"
    save_file(model_with_seed(0, "test_resnet").state_dict(), str(other))
    refused(tmp_path, DataError, rf"pretrained weights {other} do not fit timm:{MODEL} \(\d+ missing key\(s\): .*; "
                                 r"\d+ unexpected key\(s\)", f"pretrained_file={other}")
    partial = tmp_path / "partial.pth"
    state = model_with_seed(0).state_dict()
    dropped = sorted(k for k in state if k.startswith("stages.3.0.conv3_1x1"))
    torch.save({k: v for k, v in state.items() if k not in dropped}, partial)
    refused(tmp_path, DataError, rf"do not fit timm:{MODEL} \({len(dropped)} missing key\(s\): {dropped[0]}",
            f"pretrained_file={partial}")


def pickled_code() -> None:
    """A module-level function: pickling it stores a reference that only unsafe loading would import."""


def test_unreadable_or_unsafe_weight_files_are_refused(tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(b"\x00" * 5)
    refused(tmp_path, DataError, f"cannot read pretrained weights {truncated}", f"pretrained_file={truncated}")
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"weight": torch.zeros(1), "hook": pickled_code}, unsafe)
    refused(tmp_path, DataError, f"pretrained weights {unsafe} cannot be loaded safely", f"pretrained_file={unsafe}")
