"""A mistyped path gets its near matches (issue 43): ``…/s2m2r/bets.ckpt`` → "did you mean …/s2m2r/best.ckpt?",
also when the typo is in a folder of the path (the search goes up to the deepest folder that exists)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.cli import FAST_EVAL, FAST_TRAIN, run_in_process
from lightning_putm.errors import DataError
from lightning_putm.pretraining.checkpoints import load_checkpoint_backbone, read_checkpoint
from lightning_putm.validators import near_paths, path_hint


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """``checkpoints/digits/conv4/{2026-11-28_10-00-00,latest}/{rotation,s2m2r}/{best,last}.ckpt`` (empty files)."""
    root = tmp_path / "checkpoints" / "digits" / "conv4"
    for stage in ("rotation", "s2m2r"):
        (root / "2026-11-28_10-00-00" / stage).mkdir(parents=True)
        for name in ("best.ckpt", "last.ckpt"):
            (root / "2026-11-28_10-00-00" / stage / name).write_bytes(b"")
    os.symlink("2026-11-28_10-00-00", root / "latest", target_is_directory=True)
    return root


def test_near_paths_follow_each_mistyped_part_from_the_deepest_existing_folder(runs: Path) -> None:
    """Kills: looking only in the parent folder (a typo in a folder name finds nothing), suggesting folders for the
    file part, losing the user's ``latest`` link in the suggestion, suggesting something for a path with nothing
    near it."""
    latest = runs / "latest"
    assert near_paths(latest / "s2m2r" / "bets.ckpt") == [latest / "s2m2r" / "best.ckpt"]
    assert near_paths(runs / "latst" / "s2m2r" / "best.ckpt") == [latest / "s2m2r" / "best.ckpt"]
    assert near_paths(runs.parent.parent / "digit" / "conv4" / "latest" / "s2m2" / "best.ckpt") == \
        [latest / "s2m2r" / "best.ckpt"]
    assert near_paths(latest / "s2m2r" / "s2m2r") == []  # a folder is no file
    assert near_paths(runs / "resnet12" / "latest" / "s2m2r" / "best.ckpt") == []


def test_path_hint_lists_the_folders_files_of_that_kind_when_no_name_is_near(runs: Path) -> None:
    """Kills: an empty hint where the folder exists (the user cannot see what is there), other kinds of files
    listed."""
    (runs / "latest" / "s2m2r" / "notes.txt").write_text("x")
    assert path_hint(runs / "latest" / "s2m2r" / "epoch=39.ckpt") == "its folder holds best.ckpt, last.ckpt; "
    assert path_hint(runs / "nowhere" / "x" / "epoch=39.ckpt") == ""


def test_evaluate_and_predict_and_train_name_the_near_match_of_a_mistyped_checkpoint(runs: Path,
                                                                                     tmp_path: Path) -> None:
    """``evaluate.py checkpoint=``, ``predict``'s loader, ``read_checkpoint`` and ``train_backbone.py init_from=``:
    one line with the near match, before anything else happens.
    Kills: a hint in one entry point only; a hint that names the mistyped path itself."""
    typo, meant = runs / "latest" / "s2m2r" / "bets.ckpt", runs / "latest" / "s2m2r" / "best.ckpt"
    done = run_in_process("evaluate", [*FAST_EVAL, f"checkpoint={typo}", f"output_dir={tmp_path / 'out'}"])
    assert done.user_error_problem(rf"checkpoint not found: {typo}; did you mean {meant}\? ") is None, done.stderr
    assert not (tmp_path / "out").exists()
    for load in (load_checkpoint_backbone, read_checkpoint):
        with pytest.raises(DataError, match=rf"did you mean {meant}\? "):
            load(typo)
    folder = runs / "latest" / "s2m2r"
    with pytest.raises(DataError, match=rf"did you mean {meant} or {folder / 'last.ckpt'}\? "):
        load_checkpoint_backbone(folder)  # a folder: the checkpoints in it
    trained = run_in_process("train_backbone", [*FAST_TRAIN, f"checkpoint_dir={tmp_path / 'new'}",
                                                f"init_from={runs / 'latest' / 'rotatoin' / 'best.ckpt'}"])
    assert trained.user_error_problem(rf"did you mean {runs / 'latest' / 'rotation' / 'best.ckpt'}\? ") is None, \
        trained.stderr
