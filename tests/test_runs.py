"""Runs a researcher can trust and find again (issue 14): one test per observation of a new user's first hour.

1. nothing a previous run wrote is replaced (run folders, versioned checkpoints, a named folder replaced whole);
2. a checkpoint knows its data and refuses other data unless forced;
3. W&B: no orphan run from a config that fails (config, name, group and job type: test_evaluate_checkpoint.py,
   test_pretrain.py);
4. errors name the key before any side effect; Trainer errors are one readable line;
5. ``--help`` lists every key, and a run can be re-run from its saved ``config.yaml``;
6. quiet by default (evaluation: test_evaluate.py; pretraining here);
7. traps: Omniglot's validation split, files 0644, Ctrl-C exits 130 resumably, one CSV log folder across a resume.
"""

from __future__ import annotations

import csv
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT
from helpers.cli import run_in_process, run_script
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.settings import load_evaluate_config
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.train import run_train_backbone
from lightning_putm.pretraining.checkpoints import read_checkpoint
from lightning_putm.runs import RUN_DIR_ENV
from test_datasets import make_omniglot

FAST = ["methods=[putm,simpleshot]", "method.putm.em_steps=1", "method.putm.inner_steps=2", "tasks=2", "shots=[1]",
        "alphas=[2]", "queries=10", "logger=none", "progress=false", "device=cpu"]
TRAIN = ["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         "trainer.accelerator=cpu", "backbone.width=8", "stages=[classifier]", "trainer.max_epochs=1",
         "trainer.limit_train_batches=2", "val_episodes.tasks=5", "run_test=false"]


def quiet(_: str) -> None:
    pass


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


# ------------------------------------------------------------------------------------------- 1. nothing replaced
def test_each_evaluation_gets_its_own_folder_and_latest_points_at_the_newest(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_evaluate([*FAST], quiet)
    run_evaluate([*FAST, "methods=[simpleshot]", "name=second"], quiet)
    folders = sorted(p for p in (tmp_path / "outputs/evaluate").glob("20*/*") if p.is_dir())
    assert len(folders) == 2 and folders[1].name.endswith("-second")
    assert {r["method"] for r in read_rows(folders[0] / "results.csv")} == {"putm", "simpleshot"}  # untouched
    assert {r["method"] for r in read_rows(folders[1] / "results.csv")} == {"simpleshot"}
    assert (tmp_path / "outputs/evaluate/latest").resolve() == folders[1].resolve()
    assert RUN_DIR_ENV not in os.environ  # the folder choice does not leak into the next run of this process


def test_a_named_folder_is_replaced_whole(tmp_path) -> None:
    out = tmp_path / "mine"
    run_evaluate([*FAST, f"output_dir={out}", "plots=true"], quiet)
    assert (out / "plots" / "putm_query_counts.png").is_file()
    run_evaluate([*FAST, f"output_dir={out}", "plots=true", "methods=[simpleshot]"], quiet)
    assert {r["method"] for r in read_rows(out / "results.csv")} == {"simpleshot"}
    # no stale PUTM figures, and no stale stored PUTM settings a later resume could pick up
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["accuracy_vs_alpha.pdf", "accuracy_vs_alpha.png"]
    assert sorted(p.name for p in (out / "settings").iterdir()) == ["simpleshot-1shot-alpha_2.pt"]


def test_retraining_never_replaces_an_earlier_checkpoint(tmp_path) -> None:
    run_train_backbone([*TRAIN, f"checkpoint_dir={tmp_path}"], quiet)
    first = (tmp_path / "digits/conv4/latest").resolve()
    before = (first / "classifier" / "last.ckpt").read_bytes()
    time.sleep(1.1)  # a new timestamp (a clash within the same second gets a -2 suffix anyway)
    run_train_backbone([*TRAIN, f"checkpoint_dir={tmp_path}", "seed=3"], quiet)
    second = (tmp_path / "digits/conv4/latest").resolve()
    assert second != first and (first / "classifier" / "last.ckpt").read_bytes() == before
    assert (second / "classifier" / "last.ckpt").is_file() and (second / "config.yaml").is_file()


# ------------------------------------------------------------------------------------------- 2. checkpoints know their data
def test_a_checkpoint_records_its_data_and_evaluation_uses_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    recorded = read_checkpoint(tiny_checkpoint)["hyper_parameters"]["data_config"]
    assert recorded["name"] == "digits" and "options" in recorded and "image_size" in recorded
    payload = read_checkpoint(tiny_checkpoint)
    payload["hyper_parameters"]["data_config"] = {"name": "omniglot", "root": "/data/omniglot", "image_size": 28,
                                                  "options": {"scheme": "vinyals", "rotations": [0], "image_size": 28}}
    other = tmp_path / "omniglot.ckpt"
    torch.save(payload, other)
    cfg = load_evaluate_config([f"checkpoint={other}"])  # no data=: the checkpoint's own data, its settings
    assert cfg.data.name == "omniglot" and cfg.data.root == "/data/omniglot" and cfg.data.options.rotations == [0]
    assert load_evaluate_config([f"checkpoint={other}", "data.root=/elsewhere"]).data.root == "/elsewhere"


def test_other_data_than_the_checkpoint_records_is_refused_unless_forced(tiny_checkpoint, tmp_path) -> None:
    with pytest.raises(ConfigError, match="trained on data=digits but data=omniglot.*force_data=true"):
        load_evaluate_config([f"checkpoint={tiny_checkpoint}", "data=omniglot"])
    forced = load_evaluate_config([f"checkpoint={tiny_checkpoint}", "data=omniglot", "force_data=true"])
    assert forced.data.name == "omniglot"
    outcome = run_in_process("evaluate", [*FAST, f"checkpoint={tiny_checkpoint}", "data=omniglot",
                                          f"output_dir={tmp_path / 'out'}"])
    assert outcome.returncode == 2 and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- 3 + 4. early errors
@pytest.mark.parametrize(("override", "pattern"), [
    ("method.putm.rho=high", r"method\.putm\.rho must lie in \[0, 1\], got 'high'"),
    ("base_features=/no/such/base.pt", r"base_features: file not found: /no/such/base.pt"),
    ("trainer.accelerator=gpu", r"^error: invalid trainer options \(accelerator=gpu, .*\): "),
])
def test_late_failing_configs_fail_first_with_no_run_folder_and_no_wandb_run(tmp_path, monkeypatch, override,
                                                                               pattern) -> None:
    if override.startswith("trainer.") and torch.cuda.is_available():
        pytest.skip("a GPU is present: trainer.accelerator=gpu is valid here")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = [a for a in FAST if a != "logger=none"] + ["logger=wandb", f"wandb.dir={tmp_path}", override]
    outcome = run_in_process("evaluate", args)
    assert outcome.returncode == 2 and outcome.user_error_problem(pattern) is None, outcome.stderr
    assert "{" not in outcome.error_lines[0]  # no raw dict
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "outputs").exists()  # no orphan W&B run, no folder


# ------------------------------------------------------------------------------------------- 5. help and re-runs
def test_help_lists_every_key_with_type_and_default(capsys) -> None:
    assert run_in_process("evaluate", ["--help"]).returncode == 0
    text = run_in_process("evaluate", ["--help"]).stdout
    for key in ("checkpoint", "output_dir", "wandb.group", "memory_budget_mb", "method.putm.rho",
                "method.ptmap.alpha" if "method.ptmap.alpha" in text else "method.ptmap.", "force_data"):
        assert key in text, key
    lines = text.splitlines()  # a row: its line and the wrapped lines of its meaning below it
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("memory_budget_mb"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("   ")), len(lines))
    row = " ".join(lines[start:end])
    assert "float|auto" in lines[start] and "2048" in lines[start] and "chunked" in row  # type, default, meaning
    train = run_in_process("train_backbone", ["-h"]).stdout
    assert "data.epochs" in train and "backbone.width" in train and "run " in train


def test_a_run_reruns_from_its_saved_config(tmp_path) -> None:
    first = tmp_path / "first"
    run_evaluate([*FAST, "seed=5", f"output_dir={first}", "methods=[putm,ptmap]"], quiet)
    outcome = run_in_process("evaluate", ["--config", str(first / "config.yaml"), f"output_dir={tmp_path / 'again'}"])
    assert outcome.returncode == 0, outcome.stderr
    assert (tmp_path / "again" / "per_task.csv").read_bytes() == (first / "per_task.csv").read_bytes()
    changed = run_evaluate([f"config={first / 'config.yaml'}", "seed=6", f"output_dir={tmp_path / 'six'}"], quiet)
    assert {r.method for r in changed} == {"putm", "ptmap"}  # the record's settings, with an override on top
    with pytest.raises(ConfigError, match="config=.*file not found"):
        load_evaluate_config([f"config={tmp_path / 'none.yaml'}"])


# ------------------------------------------------------------------------------------------- 6. quiet pretraining
def test_pretraining_prints_a_summary_not_the_whole_config(tmp_path) -> None:
    lines: list[str] = []
    run_train_backbone([*TRAIN, f"checkpoint_dir={tmp_path}"], lines.append)
    assert not any("effective config" in line for line in lines)
    assert any(line.startswith("train_backbone: digits / conv4, stages [classifier]") for line in lines)


# ------------------------------------------------------------------------------------------- 7. traps
def test_omniglot_has_a_validation_split_held_out_of_the_training_characters(tmp_path) -> None:
    from lightning_putm.data import read_split

    root = make_omniglot(tmp_path / "omniglot")
    for character in ("images_background/Armenian/character01", "images_background/Hebrew/character02"):
        folder = root / "omniglot-py" / character
        folder.mkdir(parents=True)
        (folder / "0001_01.png").write_bytes((root / "omniglot-py" / "images_background/Latin/character01").joinpath(
            next(p.name for p in (root / "omniglot-py/images_background/Latin/character01").iterdir())).read_bytes())
    val = read_split("omniglot", root, "val", scheme="vinyals_protonets", rotations=[0])
    train = read_split("omniglot", root, "train", scheme="vinyals_protonets", rotations=[0])
    assert sorted(n.rsplit("/", 1)[0] for n in val.class_names) == [
        "images_background/Armenian/character01", "images_background/Hebrew/character02"]
    assert not {n.split("/")[1] for n in train.class_names} & {"Armenian", "Hebrew"}
    full = read_split("omniglot", root, "train", scheme="vinyals", rotations=[0])
    assert full.num_classes == train.num_classes + val.num_classes  # held out OF the Vinyals training characters
    assert load_evaluate_config(["data=omniglot"]).data.options.scheme == "vinyals_protonets"


def test_checkpoints_and_caches_are_written_with_the_usual_permissions(tmp_path, tiny_checkpoint) -> None:
    previous = os.umask(0o022)
    try:
        run_train_backbone([*TRAIN, f"checkpoint_dir={tmp_path / 'ck'}"], quiet)
        run_evaluate([*FAST, f"checkpoint={tiny_checkpoint}", f"feature_cache_dir={tmp_path / 'cache'}",
                      f"output_dir={tmp_path / 'out'}"], quiet)
    finally:
        os.umask(previous)
    files = [*(tmp_path / "ck").rglob("*.ckpt"), *(tmp_path / "cache").glob("*.pt")]
    assert len(files) >= 3 and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o644}


def test_ctrl_c_in_training_exits_130_with_a_resumable_checkpoint_and_one_log_folder(tmp_path: Path) -> None:
    """A real Ctrl-C from outside once the first epoch's checkpoint exists; then resume=true finishes in the same run
    and log folder. Wherever it lands (often inside a checkpoint save, which used to end in a RuntimeError traceback
    and exit 1) it exits 130; tests/test_checkpoint_interrupts.py sends it at each exact point of a save."""
    args = [a for a in TRAIN if a not in ("logger=none", "trainer.max_epochs=1", "trainer.limit_train_batches=2")]
    args += ["logger=csv", f"log_dir={tmp_path / 'logs'}", f"checkpoint_dir={tmp_path / 'ck'}",
             "trainer.max_epochs=40", "trainer.limit_train_batches=4"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "LIGHTNING_PUTM_CONF": str(REPO_ROOT / "conf")}
    # A shell that starts pytest in the background (`pytest &`, nohup) hands SIGINT down as ignored, and Python then
    # keeps ignoring it; the child gets the default disposition back, as in a terminal.
    process = subprocess.Popen([sys.executable, str(REPO_ROOT / "train_backbone.py"), *args], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    checkpoints = tmp_path / "ck" / "digits" / "conv4"
    while time.monotonic() < deadline and not list(checkpoints.glob("*/classifier/last.ckpt")):
        time.sleep(0.2)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "interrupted: training stopped in stage classifier" in stderr and "resume=true" in stderr
    last = checkpoints / "latest" / "classifier" / "last.ckpt"
    stopped_at = read_checkpoint(last)["epoch"]
    assert stopped_at < 39
    done = run_script("train_backbone", [*args[:-2], "trainer.max_epochs=" + str(stopped_at + 2),
                                         "trainer.limit_train_batches=4", "resume=true"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_checkpoint(last)["epoch"] == stopped_at + 1
    logs = list((tmp_path / "logs").rglob("metrics.csv"))
    assert len(logs) == 1  # one log folder across the resume, not version_0 / version_1
    epochs = {row["epoch"] for row in read_rows(logs[0]) if row.get("epoch")}
    assert str(stopped_at + 1) in epochs and "0" in epochs  # the rows before the interruption were kept
