"""S2M2 pretraining: training steps, resume, DDP, checkpoints and the train_backbone config (lightning_putm.pretraining).

Runs use the digits demo with a narrow Conv-4 and a few batches so the whole file stays quick on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from wandb_records import run_record

from lightning_putm.pretraining.checkpoints import AtomicCheckpointIO, read_checkpoint
from helpers.cli import run_in_process
from lightning_putm.cli import run_cli
from lightning_putm.data import FewShotDataModule, sample_episode_bank
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.models import Mixup
from lightning_putm.pretraining.module import STAGES, S2M2Module, ncm_task_accuracy
from lightning_putm.pretraining.checkpoints import init_from_checkpoint, load_backbone
from lightning_putm.pretraining.settings import load_train_config, settings_from_config
from lightning_putm.jobs.train import run_train_backbone

REPO = Path(__file__).resolve().parents[1]
QUIET = ["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         "trainer.accelerator=cpu", "backbone.width=8", "val_episodes.tasks=10", "test_episodes.tasks=10"]


def quiet(_: str) -> None:
    pass


pytestmark = pytest.mark.usefixtures("single_thread")


def script_main():
    """``main`` of train_backbone.py, loaded from its file (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location("train_backbone_script", REPO / "train_backbone.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def small_module(stage: str, **kwargs) -> S2M2Module:
    return S2M2Module("conv4", {"width": 8}, in_channels=1, num_classes=5, stage=stage, **kwargs)


# ------------------------------------------------------------------------------------------- training steps
class _LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("stage", STAGES)
def test_one_step_per_stage_changes_weights_with_a_finite_loss(stage: str) -> None:
    pl.seed_everything(0, verbose=False)
    module = small_module(stage)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    recorder = _LossRecorder()
    trainer = pl.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         callbacks=[recorder])
    trainer.fit(module, datamodule=FewShotDataModule("digits", image_size=8, batch_size=16))
    assert len(recorder.losses) == 1 and torch.isfinite(torch.tensor(recorder.losses)).all()
    after = module.state_dict()
    changed = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
    expected = {"backbone", "classifier"} | ({"rotation_head"} if stage != "classifier" else set())
    assert changed == expected


def test_s2m2r_mixes_at_every_configured_layer_with_beta_lambdas(monkeypatch) -> None:
    module = small_module("s2m2r", mix_layers=[0, 1, 2, 3])
    seen: list[Mixup] = []
    forward = module.backbone.forward

    def spy(x, mixup=None):
        if mixup is not None:
            seen.append(mixup)
        return forward(x, mixup)

    monkeypatch.setattr(module.backbone, "forward", spy)
    torch.manual_seed(0)
    images, labels = torch.rand(8, 1, 8, 8), torch.arange(8) % 5
    for _ in range(40):
        loss = module.training_step((images, labels), 0)
        assert torch.isfinite(loss)
    assert {m.layer for m in seen} == {0, 1, 2, 3}
    lambdas = torch.tensor([m.lam for m in seen])
    assert 0 < lambdas.min() and lambdas.max() < 1 and abs(float(lambdas.mean()) - 0.5) < 0.15


def test_module_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="unknown stage"):
        small_module("mixup")
    with pytest.raises(ConfigError, match="mix_layers"):
        small_module("s2m2r", mix_layers=[7])


def test_ncm_accuracy_on_separable_features() -> None:
    labels = torch.arange(6).repeat_interleave(10)
    features = torch.nn.functional.one_hot(labels, 6).float() * 5 + 0.1 * torch.rand(60, 6)
    bank = sample_episode_bank(labels, 5, 1, 25, None, 20, 0)
    assert torch.all(ncm_task_accuracy(features, bank) == 1.0)
    assert torch.all(ncm_task_accuracy(features, bank, "l2") == 1.0)
    with pytest.raises(ConfigError):
        ncm_task_accuracy(features, bank, "cl2n")


# ------------------------------------------------------------------------------------------- resume
def test_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    """Train 3 epochs; versus 1 epoch, stop, resume to 3 (deterministic CPU mode): identical weights and state."""
    common = QUIET + ["stages=[s2m2r]", "trainer.deterministic=true", "trainer.limit_train_batches=3",
                      "run_test=false", "data.augment.crop_padding=1"]
    run_train_backbone(common + [f"checkpoint_dir={tmp_path / 'a'}", "trainer.max_epochs=3"], log=quiet)
    run_train_backbone(common + [f"checkpoint_dir={tmp_path / 'b'}", "trainer.max_epochs=1"], log=quiet)
    interrupted = read_checkpoint(tmp_path / "b/digits/conv4/latest/s2m2r/last.ckpt")
    assert interrupted["global_step"] == 3
    run_train_backbone(common + [f"checkpoint_dir={tmp_path / 'b'}", "trainer.max_epochs=3", "resume=true"], log=quiet)
    a = read_checkpoint(tmp_path / "a/digits/conv4/latest/s2m2r/last.ckpt")
    b = read_checkpoint(tmp_path / "b/digits/conv4/latest/s2m2r/last.ckpt")
    assert len(list((tmp_path / "b/digits/conv4").iterdir())) == 2  # resume continued the run: one folder + latest
    assert a["global_step"] == b["global_step"] == 9 and a["epoch"] == b["epoch"] == 2
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    state_a, state_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert all(torch.equal(state_a[k]["exp_avg"], state_b[k]["exp_avg"]) for k in state_a)
    assert not torch.equal(a["state_dict"]["backbone.blocks.0.conv.weight"],
                           interrupted["state_dict"]["backbone.blocks.0.conv.weight"])


def test_resume_without_a_last_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="resume=true but there is no .*digits/conv4/latest to resume from"):
        run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "resume=true"], log=quiet)
    with pytest.raises(DataError, match="resume=true but there is no .*mine/rotation/last.ckpt"):
        run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "resume=true", "run=mine"], log=quiet)
    assert not (tmp_path / "digits").exists()  # nothing created before the error



def test_resume_from_an_unreadable_checkpoint_is_refused_before_the_recorded_config_changes(tmp_path: Path) -> None:
    """An empty ``last.ckpt`` (a disk that filled up): a clear error, and the run's ``config.yaml`` as it was.
    Kills the check made after ``config.yaml`` is written again (it was: the recorded config was overwritten)."""
    stage = tmp_path / "digits" / "conv4" / "mine" / "rotation"
    stage.mkdir(parents=True)
    (stage / "last.ckpt").write_bytes(b"")
    recorded = stage.parent / "config.yaml"
    recorded.write_text("recorded: true\n")
    with pytest.raises(DataError, match=r"cannot read checkpoint|not a complete PyTorch checkpoint"):
        run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "resume=true", "run=mine"], log=quiet)
    assert recorded.read_text() == "recorded: true\n"


# ------------------------------------------------------------------------------------------- stages and CLI
def test_two_stages_chain_and_write_loadable_checkpoints(tmp_path: Path, capsys) -> None:
    main = script_main()  # the script's entry point, through run_cli
    args = QUIET + [f"checkpoint_dir={tmp_path}", "trainer.max_epochs=1", "trainer.limit_train_batches=2"]
    assert run_cli(main, args) == 0
    out = capsys.readouterr().out
    run = (tmp_path / "digits/conv4/latest").resolve()  # <checkpoint_dir>/<dataset>/<backbone>/<run>
    rotation, s2m2r = run / "rotation", run / "s2m2r"
    assert f"[s2m2r] starting from {rotation / 'best.ckpt'}" in out
    assert f"last checkpoint {s2m2r / 'last.ckpt'}" in out and "test: 5-way 1-shot" in out
    for folder in (rotation, s2m2r):
        assert sorted(p.name for p in folder.iterdir()) == ["best.ckpt", "last.ckpt"]
    assert (run / "config.yaml").is_file()
    backbone = load_backbone(s2m2r / "last.ckpt")
    assert not backbone.training and backbone(torch.rand(2, 1, 8, 8)).shape == (2, 8)
    # Stage 2 really started from stage 1: its weights before training equal stage 1's best.
    fresh = small_module("s2m2r")
    init_from_checkpoint(fresh, rotation / "best.ckpt")
    best = read_checkpoint(rotation / "best.ckpt")["state_dict"]
    assert all(torch.equal(fresh.state_dict()[k], best[k]) for k in best)


def test_init_from_a_mismatched_checkpoint_is_refused(tmp_path: Path) -> None:
    run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "stages=[classifier]", "trainer.max_epochs=1",
                                "trainer.limit_train_batches=1", "run_test=false"], log=quiet)
    wider = S2M2Module("conv4", {"width": 16}, in_channels=1, num_classes=5, stage="s2m2r")
    with pytest.raises(DataError, match="does not match this backbone"):
        init_from_checkpoint(wider, tmp_path / "digits/conv4/latest/classifier/last.ckpt")


def test_cli_user_errors_exit_with_a_message(capsys) -> None:
    main = script_main()
    assert run_cli(main, ["data=omniglot"]) == 2
    assert "data.root" in capsys.readouterr().err
    assert run_cli(main, ["trainer.bogus=1"]) == 2
    assert "unknown Trainer argument 'trainer.bogus'" in capsys.readouterr().err


def test_config_overrides_and_strict_keys() -> None:
    cfg = load_train_config(["data=omniglot", "data.root=/x", "backbone=wrn28_10", "backbone.dropout=0.3",
                             "trainer.max_epochs=7", "trainer.gradient_clip_val=1.5", "trainer.strategy=ddp"])
    assert cfg.data.name == "omniglot" and cfg.data.root == "/x" and cfg.backbone.dropout == 0.3
    settings = settings_from_config(cfg)
    # Omniglot's recipe trains the classifier stage: its rotations are classes, so rotation stages would contradict
    assert settings.stages == ["classifier"] and settings.epochs == {"classifier": 7}
    assert settings.trainer["gradient_clip_val"] == 1.5
    assert settings.backbone == "wrn28_10" and settings.backbone_options["dropout"] == 0.3
    assert settings.stage_dir("s2m2r") == Path("checkpoints/omniglot/wrn28_10/latest/s2m2r").absolute()
    auto = settings_from_config(load_train_config(["data=miniimagenet"]))
    assert auto.backbone == "wrn28_10" and auto.epochs == {"rotation": 400, "s2m2r": 100}
    for bad, message in [(["lrate=1"], "unknown config key 'lrate'"),
                         (["data.rooot=/x"], "unknown config key 'data.rooot'"),
                         (["backbone.dropout=0.1"], "unknown config key 'backbone.dropout'"),  # conv4 has none
                         (["data=imagenet"], "unknown data 'imagenet'"),
                         (["backbone=vgg"], "unknown backbone 'vgg'"),
                         (["trainer.logger=true"], "use logger=auto|wandb|csv|none"),
                         (["trainer.callbacks=[]"], "set by train_backbone.py"),
                         (["data.name=cub"], "data=<name>")]:
        with pytest.raises(ConfigError, match=message):
            load_train_config(bad)
    for bad, message in [(["stages=[mixup]"], "stages"), (["lr=-1"], "lr"), (["logger=tensorboard"], "logger"),
                         (["val_episodes.alpha=-2"], "val_episodes.alpha")]:
        with pytest.raises(ConfigError, match=message):
            settings_from_config(load_train_config(bad))


def test_one_stage_may_be_named_without_brackets() -> None:
    """``stages=rotation`` is ``stages=[rotation]`` (it was refused: "got ["['rotation']"]"), and a typo in the bare
    form still gets its hint."""
    assert settings_from_config(load_train_config(["stages=rotation"])).stages == ["rotation"]
    assert settings_from_config(load_train_config(["stages=[rotation,s2m2r]"])).stages == ["rotation", "s2m2r"]
    with pytest.raises(ConfigError, match=r"got 'rotaton'; did you mean rotation\?"):
        settings_from_config(load_train_config(["stages=rotaton"]))


def test_the_in_training_checks_base_features_are_the_train_split_or_none() -> None:
    """``fewshot_eval.base_features``: split:train (default) makes the stage's callback extract the train split at
    each check; null leaves CL2N off (the notice says so); a feature file is refused, naming the key.

    Kills: a default without base features (SimpleShot's silent L2N fallback); null still extracting; a file from
    another backbone accepted, or slipped in through fewshot_eval.overrides (the check would silently replace it)."""
    from lightning_putm.evaluation.callback import FewShotEvaluationCallback
    from lightning_putm.pretraining.stages import SplitFeatures, build_stage_trainer

    def check_callback(overrides: list[str]) -> FewShotEvaluationCallback:
        settings = settings_from_config(load_train_config(["fewshot_eval.every_n_epochs=1", *overrides]))
        settings.run_folder = Path("unused")
        trainer = build_stage_trainer(settings, "rotation", True, logger=False, say=lambda _: None)
        [callback] = [c for c in trainer.callbacks if isinstance(c, FewShotEvaluationCallback)]
        return callback

    default = check_callback([])
    assert isinstance(default.base_features_from, SplitFeatures) and default.base_features_from.split == "train"
    assert default.base_features_from.path.name == "base_features_train.pt"
    assert default.settings.methods == ["simpleshot"] and default.settings.base_features is None
    assert check_callback(["fewshot_eval.base_features=null"]).base_features_from is None
    with pytest.raises(ConfigError, match=r"fewshot_eval.base_features must be split:train .* or null .*got 'b.pt'"):
        settings_from_config(load_train_config(["fewshot_eval.every_n_epochs=1", "fewshot_eval.base_features=b.pt"]))
    with pytest.raises(ConfigError, match="give the base features as fewshot_eval.base_features"):
        settings_from_config(load_train_config(["fewshot_eval.every_n_epochs=1",
                                                "fewshot_eval.overrides=[base_features=b.pt]"]))


# ------------------------------------------------------------------------------------------- Trainer options
def test_validation_limited_to_part_of_the_split_finishes_with_last_as_best(tmp_path: Path) -> None:
    """limit_val_batches leaves val/acc uncomputed; the run used to die with `could not find the monitored key`."""
    lines: list[str] = []
    with pytest.warns(UserWarning, match=r"val: only part of the split was evaluated .*best.ckpt is not updated"):
        results = run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "stages=[classifier]",
                                              "trainer.max_epochs=2", "trainer.limit_train_batches=3",
                                              "trainer.limit_val_batches=2", "data.eval_batch_size=16",
                                              "run_test=false"], log=lines.append)
    stage = (tmp_path / "digits/conv4/latest/classifier").resolve()
    assert sorted(p.name for p in stage.iterdir()) == ["last.ckpt"]
    assert results[0].best == results[0].last == stage / "last.ckpt" and results[0].best_score is None
    assert read_checkpoint(stage / "last.ckpt")["epoch"] == 1  # both epochs trained
    assert any("[classifier] no epoch computed val/acc" in line and "best = last" in line for line in lines)


def test_last_checkpoint_holds_the_final_epoch_whatever_the_validation_schedule(tmp_path: Path) -> None:
    """Lightning saved `last` only after a validation: with check_val_every_n_epoch=2 the third epoch was lost."""
    results = run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "stages=[classifier]", "trainer.max_epochs=3",
                                          "trainer.limit_train_batches=2", "trainer.check_val_every_n_epoch=2",
                                          "run_test=false"], log=quiet)
    last = read_checkpoint(results[0].last)
    assert (last["epoch"], last["global_step"]) == (2, 6)
    assert read_checkpoint(results[0].best)["epoch"] == 1  # the one validated epoch


@pytest.mark.parametrize(("option", "message"), [
    ("trainer.fast_dev_run=true", r"trainer.fast_dev_run=True writes no checkpoint.*trainer.max_epochs=1"),
    ("trainer.limit_train_batches=0", r"trainer.limit_train_batches=0 trains nothing"),
    ("trainer.max_steps=0", r"trainer.max_steps=0 trains nothing"),
])
def test_trainer_options_that_would_write_no_checkpoint_are_refused_before_the_run(tmp_path: Path, option: str,
                                                                                     message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "stages=[classifier]", option], log=quiet)
    assert not (tmp_path / "digits").exists()


def test_a_batch_fraction_below_one_batch_is_refused_before_the_run_folder(tmp_path: Path) -> None:
    """0.1 % of 11 training batches is less than one batch (Lightning would refuse it only inside fit, after the run
    folder, its config and the latest link exist): one clear error naming the smallest fraction, and nothing
    written. Kills the check missing (the run folder appears) or off by the rule (0.1 of 11 is one batch: runs)."""
    outcome = run_in_process("train_backbone", QUIET + [f"checkpoint_dir={tmp_path}", "stages=[classifier]",
                                                         "trainer.limit_train_batches=0.001", "run_test=false"])
    assert outcome.user_error_problem(r"^error: trainer.limit_train_batches=0.001 is less than one of the \d+ train "
                                      r"batches; use at least 0\.\d+") is None, outcome.stderr
    assert not (tmp_path / "digits").exists()
    with pytest.raises(ConfigError, match=r"trainer.limit_val_batches=0.01 is less than one of the \d+ val batches"):
        run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "stages=[classifier]",
                                    "trainer.limit_val_batches=0.01"], log=quiet)
    assert not (tmp_path / "digits").exists()
    results = run_train_backbone(QUIET + [f"checkpoint_dir={tmp_path}", "stages=[classifier]", "trainer.max_epochs=1",
                                          "trainer.limit_train_batches=0.1", "run_test=false"], log=quiet)
    assert results and list(tmp_path.rglob("last.ckpt"))


def test_the_progress_bar_shows_stage_and_epoch_instead_of_the_logger_version(tmp_path: Path, capsys,
                                                                              monkeypatch) -> None:
    """The CSV logger's version is the stage name, which Lightning's bar showed cut to `v_num=fier`."""
    import lightning_putm.pretraining.stages as stages

    monkeypatch.setattr(stages, "on_terminal", lambda: True)  # the bar is drawn on a terminal only
    args = [a for a in QUIET if a not in ("logger=none", "trainer.enable_progress_bar=false")]
    run_train_backbone(args + ["logger=csv", f"log_dir={tmp_path / 'logs'}", f"checkpoint_dir={tmp_path}",
                               "stages=[classifier]", "trainer.max_epochs=2", "trainer.limit_train_batches=2",
                               "run_test=false"], log=quiet)
    bar = capsys.readouterr().out  # Lightning's bar writes to stdout
    assert "[classifier] epoch 1/2" in bar and "[classifier] epoch 2/2" in bar and "train/loss" in bar
    assert "v_num" not in bar


def test_piped_training_prints_one_line_per_epoch_and_no_bar(tmp_path: Path, capsys) -> None:
    """Not a terminal (a pipe, a job log): no bar redraws (carriage returns) but one line per epoch with the loss,
    the validation accuracy and the time left. Kills: the bar drawn into a pipe, or no progress at all there."""
    args = [a for a in QUIET if a != "trainer.enable_progress_bar=false"]
    lines: list[str] = []
    run_train_backbone(args + [f"checkpoint_dir={tmp_path}", "stages=[classifier]", "trainer.max_epochs=2",
                               "trainer.limit_train_batches=2", "run_test=false"], log=lines.append)
    captured = capsys.readouterr()
    assert "\r" not in captured.out + captured.err and "epoch 1/2" not in captured.out + captured.err
    epochs = [line for line in lines if line.startswith("[classifier] epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["[classifier] epoch 1/2", "[classifier] epoch 2/2"]
    assert all("train/loss" in line and "val/acc" in line and "ETA" in line for line in epochs)
    assert any(line.startswith("train_backbone: digits / conv4, stages [classifier] ") for line in lines)


# ------------------------------------------------------------------------------------------- checkpoints
def test_atomic_checkpoint_io_never_leaves_a_partial_file(tmp_path: Path, monkeypatch) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "ck" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.ones(2))

    def broken_save(obj, handle, *args, **kwargs):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, path)
    monkeypatch.undo()
    assert torch.equal(read_checkpoint(path)["state_dict"]["w"], torch.ones(2))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


class _Payload:  # unpickling this needs code execution: weights_only loading must refuse it
    def __reduce__(self):
        return (os.getcwd, ())


def test_checkpoints_are_read_with_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as handle:
        pickle.dump({"state_dict": {}, "x": _Payload()}, handle)
    with pytest.raises(DataError, match="needs code execution"):
        read_checkpoint(path)
    with pytest.raises(pickle.UnpicklingError):
        AtomicCheckpointIO().load_checkpoint(path)
    with pytest.raises(DataError, match="not found"):
        read_checkpoint(tmp_path / "missing.ckpt")


# ------------------------------------------------------------------------------------------- DDP and W&B
def test_two_process_cpu_ddp_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    """2 processes, gloo backend, through the real script (Lightning relaunches it per rank): ~20 s. The few-shot
    check at epoch 2 runs on both: its base features (each process extracts a shard of the train split, gathered)
    are every train row once, as one process computes them from last.ckpt.

    Kills: a shard's rows missing or placed wrongly; only rank 0 extracting (the collective would hang)."""
    command = [sys.executable, str(REPO / "train_backbone.py"), *QUIET, "stages=[rotation]",
               "trainer.devices=2", "trainer.strategy=ddp", "trainer.max_epochs=2", "trainer.limit_train_batches=2",
               f"checkpoint_dir={tmp_path}", "run_test=false", "fewshot_eval.every_n_epochs=2", "fewshot_eval.tasks=3",
               f"log_dir={tmp_path / 'logs'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MEMBER: 2/2" in done.stderr + done.stdout  # two processes ran
    checkpoint = read_checkpoint(tmp_path / "digits/conv4/latest/rotation/last.ckpt")
    assert checkpoint["global_step"] == 4 and checkpoint["epoch"] == 1
    assert len([p for p in (tmp_path / "digits/conv4").iterdir() if p.name != "latest"]) == 1  # ranks agreed
    backbone = load_backbone(tmp_path / "digits/conv4/latest/rotation/best.ckpt")
    assert backbone(torch.rand(3, 1, 8, 8)).shape == (3, 8)
    from lightning_putm.features.files import load_features

    fewshot = tmp_path / "logs" / "fewshot" / "digits" / "rotation"
    assert (fewshot / "val_epoch_0001" / "results.csv").is_file()
    base = load_features(fewshot / "base_features_train.pt")
    data = FewShotDataModule("digits", image_size=8, eval_batch_size=512, eval_resize=1.0)
    last = load_backbone(tmp_path / "digits/conv4/latest/rotation/last.ckpt")
    with torch.no_grad():
        expected = torch.cat([last(images) for images, _, _ in data.eval_loader("train")])
    assert torch.equal(base.labels, data.split("train").labels) and torch.allclose(base.features, expected, atol=1e-5)


def test_wandb_offline_logging_needs_no_key(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = [a for a in QUIET if a != "logger=none"] + [
        "logger=wandb", f"log_dir={tmp_path / 'logs'}", f"checkpoint_dir={tmp_path}", f"wandb.dir={tmp_path / 'logs'}",
        "trainer.max_epochs=1", "trainer.limit_train_batches=2", "run_test=false"]
    run_train_backbone(args, log=quiet)
    runs = sorted((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(any(run.glob("*.wandb")) for run in runs)  # one W&B run per stage
    records = sorted((run_record(run) for run in runs), key=lambda r: r["job_type"])
    folder = (tmp_path / "digits/conv4/latest").resolve().name
    # the stages of one pretraining sit together: one group named after the run, job_type = the stage
    assert [r["job_type"] for r in records] == ["train-rotation", "train-s2m2r"]
    assert {r["group"] for r in records} == {f"digits-conv4-{folder}"}
    assert records[0]["config"]["lr"] == 0.001 and records[0]["config"]["data"]["name"] == "digits"


@pytest.mark.slow
def test_demo_without_arguments_trains_and_writes_checkpoints(tmp_path: Path) -> None:
    """`python train_backbone.py` with no arguments: digits demo, about a minute on 2 free cores."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LIGHTNING_PUTM_CONF": str(REPO / "conf")}
    done = subprocess.run([sys.executable, str(REPO / "train_backbone.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("rotation", "s2m2r"):
        assert (tmp_path / "checkpoints/digits/conv4/latest" / stage / "last.ckpt").is_file()
    run = (tmp_path / "checkpoints/digits/conv4/latest").resolve()
    assert f"last checkpoint {run / 's2m2r' / 'last.ckpt'}" in done.stdout
