"""Evaluation from saved checkpoints: Trainer.test + FewShotEvaluationCallback, feature cache, W&B, plots, errors."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from conftest import REPO_ROOT
from lightning_putm.errors import LightningPutmError
from lightning_putm.features.extraction import BackboneFeatures
from lightning_putm.features.files import load_features
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.train import run_train_backbone
from lightning_putm.pretraining.module import S2M2Module
from wandb_records import history, offline_run, run_record, table

pytestmark = pytest.mark.usefixtures("single_thread")

FAST = ["methods=[putm,simpleshot]", "method.putm.em_steps=2", "method.putm.inner_steps=3", "progress=false",
        "shots=[1]", "tasks=4", "data=digits", "base_features=null"]  # the base split is tested on its own below


def quiet(_: str) -> None:
    pass


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


def evaluate(checkpoint: Path, tmp_path: Path, *extra: str) -> tuple[list, list[str]]:
    lines: list[str] = []
    results = run_evaluate([f"checkpoint={checkpoint}", f"output_dir={tmp_path / 'out'}",
                            f"feature_cache_dir={tmp_path / 'cache'}", *FAST, *extra], log=lines.append)
    return results, lines


def test_checkpoint_evaluation_logs_to_wandb_offline_and_writes_csv_and_plots(checkpoint, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("WANDB_MODE", "offline")
    results, lines = evaluate(checkpoint, tmp_path, "alphas=[1,4,balanced]", "logger=wandb", f"wandb.dir={tmp_path}",
                              "wandb.group=study-1", "method.putm.rho=0.7")
    out = tmp_path / "out"
    summary = read_csv(out / "results.csv")
    per_task = read_csv(out / "per_task.csv")
    assert len(results) == len(summary) == 2 * 3  # methods x alphas
    assert len(per_task) == 2 * 3 * 4  # one row per (method, shot, alpha, task)
    assert {(r["method"], r["alpha"], r["task"]) for r in per_task} == {
        (m, a, str(t)) for m in ("putm", "simpleshot") for a in ("1", "4", "balanced") for t in range(4)}
    assert any("extracting the test split of digits" in line for line in lines)

    run = offline_run(tmp_path)  # W&B's own folder convention: <wandb.dir>/wandb, not inside the results folder
    assert not (out / "wandb").exists()
    record = run_record(run)
    assert record["job_type"] == "evaluate" and record["group"] == "study-1"
    run_folder = checkpoint.parent.parent.resolve().name  # <run>: what `latest` points at
    # <dataset>-<backbone>-<run>-<stage>(-last), then the time: which checkpoint, not "best" or "last"
    assert record["display_name"].startswith(f"digits-conv4-{run_folder}-classifier-last-")
    assert record["config"]["method"]["putm"]["rho"] == 0.7  # the full resolved config: filter runs by any key
    assert record["config"]["methods"] == ["putm", "simpleshot"] and record["config"]["output_dir"] == str(out)
    assert "anonymous setting has no effect" not in capfd.readouterr().err  # no warning caused by our settings
    logged: dict[str, float] = {}
    for row in history(run):
        logged.update({k: v for k, v in row.items() if k.startswith("fewshot/") and isinstance(v, (int, float))})
    for row in summary:
        key = f"fewshot/{row['method']}/{row['shots']}shot/alpha_{row['alpha']}"
        assert logged[f"{key}/acc"] == pytest.approx(float(row["accuracy"]), abs=1e-3)
        assert logged[f"{key}/ci95"] == pytest.approx(float(row["ci95"]), abs=1e-3)
    logged_table = table(run, "fewshot/results")
    columns = logged_table["columns"]
    as_rows = [dict(zip(columns, values)) for values in logged_table["data"]]
    assert [(r["method"], str(r["alpha"])) for r in as_rows] == [(r["method"], r["alpha"]) for r in summary]
    assert [r["accuracy"] for r in as_rows] == pytest.approx([float(r["accuracy"]) for r in summary])
    assert list((run / "files" / "media" / "table" / "fewshot" / "accuracy_vs_alpha").glob("1shot_table_*.json"))

    for name in ("accuracy_vs_alpha", "putm_query_counts", "putm_tsne"):
        image = matplotlib.image.imread(out / "plots" / f"{name}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0
        assert list((run / "files" / "media" / "images" / "fewshot" / "plots").glob(f"{name}_*.png"))


def test_feature_cache_is_reused_and_rebuilt_when_the_checkpoint_changes(checkpoint, tmp_path, monkeypatch):
    args = ["alphas=[2]", "logger=none", "plots=false"]
    _, first = evaluate(checkpoint, tmp_path, *args)
    [cache_file] = list((tmp_path / "cache").glob("*.pt"))
    extracted = load_features(cache_file)
    assert extracted.metadata["cache_key"]["dataset"] == "digits" and len(extracted) > 0
    assert any("extracting" in line for line in first)

    def no_backbone(*_args, **_kwargs):
        raise AssertionError("the backbone ran although the cache matched")

    with monkeypatch.context() as patch:
        patch.setattr(BackboneFeatures, "test_step", no_backbone)
        results, second = evaluate(checkpoint, tmp_path, *args)
    assert any("reusing the cache" in line for line in second)
    fresh = read_csv(tmp_path / "out" / "per_task.csv")

    # refresh_features=true extracts again and gets the same features and results
    _, third = evaluate(checkpoint, tmp_path, *args, "refresh_features=true")
    assert any("extracting" in line for line in third)
    assert torch.equal(load_features(cache_file).features, extracted.features)
    assert read_csv(tmp_path / "out" / "per_task.csv") == fresh

    # a changed checkpoint (same path) is a new key: extraction again, a second cache file, other features
    changed = tmp_path / "changed.ckpt"
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    for key, value in payload["state_dict"].items():
        if key.startswith("backbone.") and value.is_floating_point() and value.dim() == 4:
            payload["state_dict"][key] = value * 1.5
            break
    torch.save(payload, changed)
    _, fourth = evaluate(changed, tmp_path, *args)
    assert any("extracting" in line for line in fourth)
    files = sorted((tmp_path / "cache").glob("*.pt"))
    assert len(files) == 2
    other = next(load_features(f) for f in files if f != cache_file)
    assert not torch.equal(other.features, extracted.features)


def test_features_extracted_in_bf16_have_their_own_cache_entry(checkpoint, tmp_path):
    """trainer.precision=bf16-mixed gives other features than fp32, so it must not reuse (or overwrite) the fp32
    entry; full precision keeps the key an older cache wrote (no precision field)."""
    args = ["alphas=[2]", "logger=none", "plots=false"]
    evaluate(checkpoint, tmp_path, *args)
    [full] = list((tmp_path / "cache").glob("*.pt"))
    assert "precision" not in load_features(full).metadata["cache_key"]
    _, lines = evaluate(checkpoint, tmp_path, *args, "trainer.precision=bf16-mixed")
    assert any("extracting" in line for line in lines) and not any("reusing the cache" in line for line in lines)
    [half] = [f for f in (tmp_path / "cache").glob("*.pt") if f != full]
    assert load_features(half).metadata["cache_key"]["precision"] == "bf16-mixed"
    assert not torch.equal(load_features(half).features, load_features(full).features)
    _, lines = evaluate(checkpoint, tmp_path, *args, "trainer.precision=32-true")  # the same key as unset
    assert any("reusing the cache" in line for line in lines)


def test_a_corrupt_cache_file_is_rebuilt(checkpoint, tmp_path):
    args = ["alphas=[2]", "logger=none", "plots=false"]
    evaluate(checkpoint, tmp_path, *args)
    [cache_file] = list((tmp_path / "cache").glob("*.pt"))
    good = load_features(cache_file).features
    cache_file.write_bytes(cache_file.read_bytes()[:100])  # truncated
    with pytest.warns(UserWarning, match="unreadable feature cache"):
        _, lines = evaluate(checkpoint, tmp_path, *args)
    assert any("extracting" in line for line in lines)
    assert torch.equal(load_features(cache_file).features, good)


def test_base_features_from_the_checkpoints_train_split_give_cl2n(checkpoint, tmp_path):
    """base_features=split:train extracts the base split once (cached) and SimpleShot centres on its mean."""
    args = ["alphas=[2]", "logger=none", "plots=false", "methods=[simpleshot]", "tasks=20"]
    results, lines = evaluate(checkpoint, tmp_path, *args, "base_features=split:train")
    assert any("extracting the train split of digits" in line for line in lines)
    [base_file] = list((tmp_path / "cache").glob("digits-train-*.pt"))
    base = load_features(base_file)
    assert base.class_names == [f"digit_{k}" for k in range(5)] and torch.isfinite(base.features).all()
    assert any(f"base-class mean for CL2N: {len(base)} rows of {base_file}" in line for line in lines)
    # the same numbers as passing that file by hand, and not those of plain L2N
    by_file, _ = evaluate(checkpoint, tmp_path / "by_file", *args, f"base_features={base_file}")
    plain, plain_lines = evaluate(checkpoint, tmp_path / "plain", *args)
    assert any("notice: no base_features file given" in line for line in plain_lines)
    assert results[0].accuracies.tolist() == by_file[0].accuracies.tolist()
    assert results[0].accuracies.tolist() != plain[0].accuracies.tolist()
    _, again = evaluate(checkpoint, tmp_path, *args, "base_features=split:train")
    assert any("base features: reusing the cache" in line for line in again)
    assert not any("extracting the train split" in line for line in again)


@pytest.mark.parametrize("methods,named,not_named", [
    ("[putm,simpleshot]", ["simpleshot cannot subtract", "L2N"], ["bavardage", "BAVARDAGE", "bdcspn"]),
    ("[bdcspn,bavardage]", ["bdcspn cannot subtract", "bavardage centres each task on the mean of its own rows"],
     ["simpleshot", "laplacianshot"]),
    ("[bavardage]", ["bavardage centres each task"], ["cannot subtract", "L2N"]),
])
def test_the_cl2n_notice_names_only_the_methods_that_run(methods, named, not_named):
    """Kills: a notice that always mentions BAVARDAGE (or every CL2N method) whatever the run evaluates."""
    from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
    from lightning_putm.evaluation.sources import load_base_statistics

    lines: list[str] = []
    load_base_statistics(settings_from_config(load_evaluate_config([f"methods={methods}", "base_features=null"])),
                         dim=4, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("notice: no base_features file given, so ")
    assert all(text in lines[0] for text in named) and not any(text in lines[0] for text in not_named), lines[0]


def test_bavardage_without_task_centring_is_one_of_the_l2n_methods():
    from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
    from lightning_putm.evaluation.sources import missing_base_notice

    settings = settings_from_config(load_evaluate_config(["methods=[bavardage,putm]", "base_features=null",
                                                          "method.bavardage.task_centring=false"]))
    notice = missing_base_notice(settings)
    assert "bavardage cannot subtract the base-class mean (CL2N) and use plain L2 normalisation" in notice
    assert "centres" not in notice
    assert missing_base_notice(settings_from_config(load_evaluate_config(["methods=[putm,ptmap]"]))) == ""


def _recording(checkpoint: Path, folder: Path, data_config: dict) -> Path:
    """A copy of ``checkpoint`` at ``folder`` whose hyper-parameters record ``data_config``."""
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    payload["hyper_parameters"] = {**payload["hyper_parameters"], "data_config": data_config}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(payload, folder / "best.ckpt")
    return folder / "best.ckpt"


OMNIGLOT_RECORD = {"name": "omniglot", "root": "/data/omniglot", "image_size": 28, "normalize": None,
                   "eval_resize": 1.0, "options": {"scheme": "vinyals_protonets", "rotations": [0, 90, 180, 270],
                                                   "image_size": 28}}


@pytest.mark.parametrize("extra,listed", [
    ([], ["CKPT", "tasks=7"]),
    (["data.eval_batch_size=9"], ["CKPT", "data.eval_batch_size=9", "tasks=7"]),
    (["data=digits", "force_data=true"], ["data=digits", "CKPT", "force_data=true", "tasks=7"]),
])
def test_settings_changed_lists_what_the_user_set_not_what_the_checkpoint_records(checkpoint, tmp_path, extra,
                                                                                   listed):
    """A checkpoint trained on Omniglot: its data group and recorded settings are the run's defaults. Kills: comparing
    with conf/evaluate.yaml's own defaults, which listed 14 data.* keys the user never set."""
    from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
    from lightning_putm.jobs.evaluate import describe

    recorded = _recording(checkpoint, tmp_path / "omniglot" / "conv4" / "run1" / "classifier", OMNIGLOT_RECORD)
    cfg = load_evaluate_config([f"checkpoint={recorded}", "tasks=7", *extra])
    assert cfg.data.name == ("digits" if extra[:1] == ["data=digits"] else "omniglot")
    [line] = [line for line in describe(cfg, settings_from_config(cfg)).splitlines()
              if line.startswith("settings changed from the defaults: ")]
    shown = line.removeprefix("settings changed from the defaults: ").split(", ")
    assert shown == [f"checkpoint={recorded}" if item == "CKPT" else item for item in listed], shown


def test_a_config_file_rerun_lists_the_files_changes_not_the_checkpoints_data(checkpoint, tmp_path):
    """``config=`` file values the user set count as changes; the data the checkpoint records still does not."""
    from lightning_putm.config import to_yaml
    from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
    from lightning_putm.jobs.evaluate import describe

    recorded = _recording(checkpoint, tmp_path / "omniglot" / "conv4" / "run1" / "classifier", OMNIGLOT_RECORD)
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(load_evaluate_config([f"checkpoint={recorded}", "seed=3", "method.putm.rho=0.7"])))
    cfg = load_evaluate_config([f"config={saved}", "tasks=5"])
    line = describe(cfg, settings_from_config(cfg)).splitlines()[-1]
    assert line == (f"settings changed from the defaults: checkpoint={recorded}, tasks=5, seed=3, "
                    "method.putm.rho=0.7")


def test_checkpoint_runs_are_named_by_dataset_backbone_run_and_stage(checkpoint, tmp_path):
    """Every checkpoint is best.ckpt or last.ckpt: the run name comes from the folders train_backbone.py writes."""
    from lightning_putm.evaluation.settings import checkpoint_run_name, load_evaluate_config, settings_from_config

    run_folder = checkpoint.parent.parent.resolve().name
    assert checkpoint.parent.parent.name == "latest" and run_folder != "latest"
    settings = settings_from_config(load_evaluate_config([f"checkpoint={checkpoint}"]))
    assert settings.name == f"digits-conv4-{run_folder}-classifier-last"
    best = tmp_path / "checkpoints" / "cub" / "resnet12" / "2026-01-02_03-04-05" / "s2m2r" / "best.ckpt"
    assert checkpoint_run_name(best) == "cub-resnet12-2026-01-02_03-04-05-s2m2r"
    assert checkpoint_run_name(tmp_path / "models" / "best.ckpt") == "models-best"  # not train_backbone.py's layout
    assert checkpoint_run_name(tmp_path / "mine.ckpt") == "mine"
    named = settings_from_config(load_evaluate_config([f"checkpoint={checkpoint}", "name=mine"]))
    assert named.name == "mine"


@pytest.mark.parametrize("overrides,message", [
    (["base_features=split:train"], "give checkpoint=PATH too"),
    (["CKPT", "base_features=split:test"], "is the evaluated split itself"),
    (["CKPT", "base_features=split:novel"], "unknown split 'novel'"),
])
def test_base_split_errors(checkpoint, tmp_path, overrides, message):
    argv = [str(o).replace("CKPT", f"checkpoint={checkpoint}") for o in overrides]
    with pytest.raises(LightningPutmError, match=message):
        run_evaluate([*FAST, *argv, f"output_dir={tmp_path}", "logger=none"], log=quiet)


def test_base_features_auto_extracts_the_train_split_only_when_a_method_needs_it(checkpoint, tmp_path):
    args = ["alphas=[2]", "logger=none", "plots=false", "tasks=2", "base_features=auto"]
    _, lines = evaluate(checkpoint, tmp_path / "putm", *args, "methods=[putm]")
    assert not any("train split" in line for line in lines)
    _, lines = evaluate(checkpoint, tmp_path / "cl2n", *args, "methods=[putm,laplacianshot]")
    assert any("extracting the train split of digits" in line for line in lines)
    assert any("base-class mean for CL2N" in line for line in lines)


def _bad_checkpoints(checkpoint: Path, folder: Path) -> dict[str, tuple[Path, str]]:
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cases: dict[str, tuple[Path, str]] = {}
    truncated = folder / "truncated.ckpt"
    truncated.write_bytes(checkpoint.read_bytes()[:300])
    cases["truncated"] = (truncated, "cannot read checkpoint")
    noise = folder / "noise.ckpt"
    noise.write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
                      .numpy().tobytes())
    cases["random bytes"] = (noise, "cannot read checkpoint")
    edited = folder / "edited.ckpt"
    torch.save({**payload, "hyper_parameters": {**payload["hyper_parameters"], "backbone_options": {"width": 16}}},
               edited)
    cases["weights of another shape"] = (edited, "do not match the backbone")
    three = folder / "rgb.ckpt"
    module = S2M2Module(backbone="conv4", backbone_options={"width": 8}, in_channels=3, num_classes=5,
                        stage="classifier")
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, three)
    cases["3-channel checkpoint on 1-channel data"] = (three, "trained on 3-channel images")
    no_hparams = folder / "bare.ckpt"
    torch.save({"state_dict": payload["state_dict"]}, no_hparams)
    cases["no hyper-parameters"] = (no_hparams, "no S2M2Module hyper-parameters")
    cases["missing"] = (folder / "absent.ckpt", "checkpoint not found")
    return cases


def test_bad_checkpoints_give_clear_errors(checkpoint, tmp_path):
    for name, (path, message) in _bad_checkpoints(checkpoint, tmp_path).items():
        with pytest.raises(LightningPutmError, match=message):
            evaluate(path, tmp_path, "logger=none", "plots=false", "alphas=[2]")
    with pytest.raises(LightningPutmError, match="holds a conv4 backbone but backbone=resnet12"):
        evaluate(checkpoint, tmp_path, "logger=none", "backbone=resnet12", "refresh_features=true")
    # kills: backbone= checked only when the features are extracted, not when the cache has them
    for _ in range(2):  # the first run may extract; the second surely reuses the cache
        _, lines = evaluate(checkpoint, tmp_path, "logger=none", "plots=false", "alphas=[2]", "backbone=conv4")
    assert any("reusing the cache" in line for line in lines), lines
    with pytest.raises(LightningPutmError, match="holds a conv4 backbone but backbone=resnet12"):
        evaluate(checkpoint, tmp_path, "logger=none", "plots=false", "alphas=[2]", "backbone=resnet12")


class _WritesMarker:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_malicious_checkpoint_is_refused_without_running_code(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    _WritesMarker.marker = str(marker)
    path = tmp_path / "evil.ckpt"
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    payload["hyper_parameters"]["extra"] = _WritesMarker()
    torch.save(payload, path)
    with pytest.raises(LightningPutmError, match="needs code execution to load"):
        evaluate(path, tmp_path, "logger=none", "alphas=[2]")
    assert not marker.exists()


def test_cli_checkpoint_errors_exit_2_without_traceback(tmp_path):
    done = subprocess.run([sys.executable, str(REPO_ROOT / "evaluate.py"), f"checkpoint={tmp_path / 'nope.ckpt'}",
                           "logger=none"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert "checkpoint not found" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, str(REPO_ROOT / "evaluate.py"), "checkpoint=x.ckpt", "features=y.pt"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and "either features=<file> or checkpoint=<ckpt>" in done.stderr


def test_pretraining_runs_the_fewshot_callback_every_k_validation_epochs(tmp_path):
    """The check runs at epoch 2 of 2 only, says what it will do first and what it cost after, and CL2N's base mean
    is the train split's features with the checked weights (eval mode, no augmentation): those of last.ckpt.

    Kills: a check every epoch; no plan or cost line; SimpleShot without base features (the notice); base features
    taken from training batches (augmented), in train mode (BatchNorm batch statistics) or from other weights."""
    from lightning_putm.data.datamodule import FewShotDataModule
    from lightning_putm.pretraining.checkpoints import load_checkpoint_backbone

    lines: list[str] = []
    run_train_backbone(["logger=csv", f"log_dir={tmp_path / 'logs'}", "trainer.enable_progress_bar=false",
                        "trainer.enable_model_summary=false", "trainer.accelerator=cpu", "backbone.width=8",
                        "stages=[classifier]", "trainer.max_epochs=2", "val_episodes.tasks=5", "run_test=true",
                        "test_episodes.tasks=5", f"checkpoint_dir={tmp_path / 'ck'}", "fewshot_eval.every_n_epochs=2",
                        "fewshot_eval.methods=[putm,simpleshot]", "fewshot_eval.tasks=3",
                        "fewshot_eval.overrides=[method.putm.em_steps=1,method.putm.inner_steps=2]"],
                       log=lines.append)
    folder = tmp_path / "logs" / "fewshot" / "digits" / "classifier"
    assert [p.name for p in sorted(folder.iterdir())] == ["base_features_train.pt", "val_epoch_0001"]  # epoch 2 only
    summary = read_csv(folder / "val_epoch_0001" / "results.csv")
    assert {(r["method"], r["alpha"]) for r in summary} == {(m, a) for m in ("putm", "simpleshot") for a in ("2", "balanced")}
    [metrics_file] = list((tmp_path / "logs").rglob("metrics.csv"))
    logged = [r for r in read_csv(metrics_file) if r.get("val_fewshot/putm/1shot/alpha_2/acc")]
    assert len(logged) == 1 and logged[0]["epoch"] == "1"
    putm = next(r for r in summary if r["method"] == "putm" and r["alpha"] == "2")
    assert float(logged[0]["val_fewshot/putm/1shot/alpha_2/acc"]) == pytest.approx(float(putm["accuracy"]), abs=1e-3)
    [plan] = [line for line in lines if line.startswith("few-shot check after")]
    assert "putm, simpleshot on shots [1] x alphas [2, balanced] x 3 tasks" in plan and "base features" in plan
    assert len([line for line in lines if line.startswith("few-shot check took")]) == 1
    assert not any("no base_features" in line for line in lines)
    [base_line] = [line for line in lines if line.startswith("base-class mean for CL2N")]
    assert str(folder / "base_features_train.pt") in base_line
    base = load_features(folder / "base_features_train.pt")
    [last] = list((tmp_path / "ck").rglob("classifier/last.ckpt"))  # the weights of the check (no step after it)
    backbone, _ = load_checkpoint_backbone(last, in_channels=1)
    data = FewShotDataModule("digits", image_size=8, eval_batch_size=512, eval_resize=1.0)
    train = data.split("train")
    with torch.no_grad():
        expected = torch.cat([backbone(images) for images, _, _ in data.eval_loader("train")])
    assert len(base) == len(train) and torch.equal(base.labels, train.labels.long())
    assert torch.allclose(base.features, expected, atol=1e-5)


def test_wandb_logs_offline_without_credentials_and_never_prints_the_key(tmp_path, monkeypatch):
    from lightning_putm.errors import ConfigError
    from lightning_putm.loggers import resolve_wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    notices: list[str] = []
    assert resolve_wandb_mode(None, notices.append) == "offline"
    assert "no W&B credentials" in notices[0]
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    notices.clear()
    assert resolve_wandb_mode(None, notices.append) == "online" and not notices
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode(None, notices.append) == "offline"
    assert resolve_wandb_mode("disabled", notices.append) == "disabled"
    with pytest.raises(ConfigError, match="wandb.mode must be"):
        resolve_wandb_mode("sometimes", notices.append)
    assert all(secret not in line for line in notices)


def test_nan_features_stop_the_run_and_are_not_cached(checkpoint, tmp_path):
    """Kills: the feature cache written before the NaN check (the next run would reuse the broken features)."""
    payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    name = next(k for k, v in payload["state_dict"].items() if k.startswith("backbone.") and v.is_floating_point()
                and v.dim() > 1)
    payload["state_dict"][name] = torch.full_like(payload["state_dict"][name], float("nan"))
    broken = tmp_path / "nan" / "best.ckpt"
    broken.parent.mkdir()
    torch.save(payload, broken)
    with pytest.raises(LightningPutmError, match="contain NaN or Inf"):
        evaluate(broken, tmp_path, "logger=none", "plots=false", "alphas=[2]", "base_features=null")
    assert not list((tmp_path / "cache").rglob("*.pt"))
