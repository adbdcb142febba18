"""Ctrl-C or SIGTERM at any point of a checkpoint save: exit 130, the last good checkpoint intact and resumable.

Each case runs a small pretraining (digits, Conv-4 of width 8, 3 epochs of 4 batches, deterministic CPU mode)
through ``train_backbone.py``'s entry point and sends the signal from inside the process at one exact point of the
save at the end of epoch 1 (tests/helpers/interrupt_training.py lists the points), so no case depends on timing.
It must exit 130 with the "interrupted" line and no traceback, leave no temporary file, and leave ``last.ckpt``
readable at the epoch the point implies; ``resume=true`` must then end with exactly the weights, optimizer state
and step count of an uninterrupted run (``torch.equal``), and with the same ``best.ckpt``.

Before the fix, a SIGINT inside ``torch.save``'s stream failed the save with ``RuntimeError: unexpected pos``:
a traceback and exit 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
import torch

from helpers.cli import REPO
from lightning_putm.atomic import atomic_torch_save
from lightning_putm.pretraining.checkpoints import read_checkpoint
from lightning_putm.signals import signals_deferred

HELPERS = Path(__file__).resolve().parent / "helpers"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS.parent)]), "OMP_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline", "LIGHTNING_PUTM_CONF": str(REPO / "conf")}
EPOCHS = 3
INTERRUPTED_EPOCH = 1  # the signal comes during the saves at the end of this epoch (a previous last.ckpt exists)
TRAIN = ["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
         "trainer.accelerator=cpu", "backbone.width=8", "stages=[classifier]", f"trainer.max_epochs={EPOCHS}",
         "trainer.limit_train_batches=4", "trainer.deterministic=true", "val_episodes.tasks=5", "run_test=false",
         "run=r"]
STAGE = Path("digits/conv4/r/classifier")


class Trainings:
    """Client of tests/helpers/interrupt_training.py: one forked training per call, imports paid once."""

    def __init__(self) -> None:
        # SIGINT as in a terminal, even where pytest was started in the background with SIGINT ignored
        self.process = subprocess.Popen([sys.executable, str(HELPERS / "interrupt_training.py")], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=ENV, cwd=REPO,
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert self.process.stdout.readline().strip() == "ready"

    def run(self, folder: Path, log: Path, extra: Sequence[str] = (), **injection: object) -> tuple[int, str]:
        """(exit status, what the run printed) of a training into ``folder``, interrupted as ``injection`` says."""
        command = {"args": [*TRAIN, f"checkpoint_dir={folder}", *extra], "log": str(log), **injection}
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, "interrupt_training.py died"
        return json.loads(answer)["code"], log.read_text()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def trainings():
    server = Trainings()
    yield server
    server.close()


@pytest.fixture(scope="module")
def uninterrupted(trainings, tmp_path_factory) -> Path:
    """The stage folder of an uninterrupted run: what every interrupted and resumed run must end with."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    code, output = trainings.run(folder, folder / "run.log")
    assert code == 0, output[-3000:]
    return folder / STAGE


def assert_same_training_state(got: Path, want: Path) -> None:
    a, b = read_checkpoint(got), read_checkpoint(want)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"])
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    state_a, state_b = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state_a[key][moment], state_b[key][moment]), (key, moment)


def same_validation_record(got: Path, want: Path) -> bool:
    """Whether two runs' ``best.ckpt`` bookkeeping agrees: every validation ran and scored the same."""
    def record(path: Path) -> tuple:
        states = [v for k, v in read_checkpoint(path)["callbacks"].items() if "Checkpoint{" in k]
        return tuple(sorted((str(s["monitor"]), repr(None if s["best_model_score"] is None else
                                                  float(s["best_model_score"])),
                             repr(None if s["current_score"] is None else float(s["current_score"])),
                             Path(s["best_model_path"]).name) for s in states))
    a, b = record(got), record(want)
    assert any(state[0] != "None" and state[2] != "None" for state in a), a  # a scored best.ckpt is kept
    assert a == b, (a, b)
    return True


#: (signal, point, file being saved, epoch last.ckpt holds afterwards). A save that has begun is completed first,
#: and during training a signal is held to the end of the next training batch (interrupted.ckpt): one during the
#: end-of-epoch saves (best.ckpt after validation, then last.ckpt) lets that epoch's last.ckpt be written; one in
#: the middle of the epoch leaves the previous epoch's.
CASES = [
    ("SIGINT", "in-write", "last.ckpt", INTERRUPTED_EPOCH),
    ("SIGINT", "before-fsync", "last.ckpt", INTERRUPTED_EPOCH),
    ("SIGINT", "before-rename", "last.ckpt", INTERRUPTED_EPOCH),
    ("SIGINT", "after-rename", "last.ckpt", INTERRUPTED_EPOCH),
    ("SIGINT", "after-save", "last.ckpt", INTERRUPTED_EPOCH),
    ("SIGINT", "in-write", "best.ckpt", INTERRUPTED_EPOCH),
    ("SIGINT", "after-save", "best.ckpt", INTERRUPTED_EPOCH),  # between best.ckpt and last.ckpt
    ("SIGINT", "mid-epoch", "last.ckpt", INTERRUPTED_EPOCH - 1),
    ("SIGTERM", "in-write", "last.ckpt", INTERRUPTED_EPOCH),
    ("SIGTERM", "after-save", "best.ckpt", INTERRUPTED_EPOCH),
    ("SIGTERM", "mid-epoch", "last.ckpt", INTERRUPTED_EPOCH - 1),
]


@pytest.mark.parametrize(("signame", "point", "file", "kept_epoch"), CASES,
                         ids=[f"{s}-{p}-{f.split('.')[0]}" for s, p, f, _ in CASES])
def test_a_signal_during_a_checkpoint_save_exits_130_and_resumes_to_the_same_weights(
        trainings, uninterrupted, tmp_path, signame, point, file, kept_epoch) -> None:
    code, output = trainings.run(tmp_path, tmp_path / "interrupted.log", signal=signame, point=point, file=file,
                                 epoch=INTERRUPTED_EPOCH)
    assert f"injected {signame} at {point} of {file}" in output, output[-3000:]  # the signal was really sent
    assert code == 130, output[-3000:]
    how = "Ctrl-C" if signame == "SIGINT" else "SIGTERM"
    assert "Traceback" not in output and f"interrupted: training stopped in stage classifier ({how})" in output, output
    assert "resume=true run=r" in output
    stage = tmp_path / STAGE
    assert not [p.name for p in stage.iterdir() if p.name.endswith(".tmp")]  # no half-written leftovers
    assert read_checkpoint(stage / "last.ckpt")["epoch"] == kept_epoch  # intact: the last good one
    assert read_checkpoint(stage / "best.ckpt")["epoch"] <= INTERRUPTED_EPOCH

    code, output = trainings.run(tmp_path, tmp_path / "resumed.log", extra=["resume=true"])
    assert code == 0, output[-3000:]
    assert_same_training_state(stage / "last.ckpt", uninterrupted / "last.ckpt")
    best, want = read_checkpoint(stage / "best.ckpt"), read_checkpoint(uninterrupted / "best.ckpt")
    assert best["epoch"] == want["epoch"]
    assert all(torch.equal(best["state_dict"][k], want["state_dict"][k]) for k in want["state_dict"])


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_final_test_exits_130_with_the_training_complete(trainings, uninterrupted, tmp_path,
                                                                              signame) -> None:
    """After the last stage, ``run_test=true`` scores the test split: stopping it must not look like a crash."""
    code, output = trainings.run(tmp_path, tmp_path / "interrupted.log", extra=["run_test=true", "test_episodes.tasks=5"],
                                 signal=signame, point="in-test")
    assert f"injected {signame} at in-test" in output, output[-3000:]
    assert code == 130, output[-3000:]
    how = "Ctrl-C" if signame == "SIGINT" else "SIGTERM"
    assert f"interrupted: test stopped ({how}); the training is complete" in output and "Traceback" not in output
    assert_same_training_state(tmp_path / STAGE / "last.ckpt", uninterrupted / "last.ckpt")


def test_a_signal_in_the_first_epoch_leaves_a_checkpoint_of_that_point_and_resumes_from_it(trainings, uninterrupted,
                                                                                             tmp_path) -> None:
    """Before interrupted.ckpt there was nothing to resume before the first epoch's end. Kills: no checkpoint on
    the interruption; ``resume=true`` refused without last.ckpt; the resumed epoch restarting from its first batch
    (the first batches trained twice: other weights); the random generators not restored (other mixup draws)."""
    code, output = trainings.run(tmp_path, tmp_path / "interrupted.log", signal="SIGINT", point="mid-epoch", epoch=0)
    assert code == 130 and "Traceback" not in output, output[-3000:]
    stage = tmp_path / STAGE
    assert ("training stopped in stage classifier (Ctrl-C) in epoch 0 after 2 training batches; "
            f"{stage / 'interrupted.ckpt'} holds that point: continue from it with resume=true run=r") in output
    assert not (stage / "last.ckpt").exists()
    code, output = trainings.run(tmp_path, tmp_path / "resumed.log", extra=["resume=true"])
    assert code == 0, output[-3000:]
    assert f"resuming from {stage / 'interrupted.ckpt'}" in output
    assert_same_training_state(stage / "last.ckpt", uninterrupted / "last.ckpt")
    assert same_validation_record(stage / "last.ckpt", uninterrupted / "last.ckpt")
    assert not (stage / "interrupted.ckpt").exists()  # the finished stage does not keep it


#: The in-training few-shot check: PUTM only, 4 tasks, 3 EM steps of 2 Adam steps (a few seconds per epoch).
FEWSHOT = ["fewshot_eval.every_n_epochs=1", "fewshot_eval.methods=[putm]", "fewshot_eval.alphas=[2]",
           "fewshot_eval.tasks=4", "fewshot_eval.overrides=[method.putm.em_steps=3,method.putm.inner_steps=2]"]


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_in_training_fewshot_check_stops_it_and_keeps_the_epoch(trainings, uninterrupted,
                                                                                   tmp_path, signame) -> None:
    """The few-shot check after epoch 1 gets the signal after PUTM's third E-step: the check stops at its next
    step (no E-step finishes after the signal), ``interrupted.ckpt`` keeps the epoch just trained (last.ckpt is
    written only after validation), and the resume ends with an uninterrupted run's weights.
    Kills: the stop acted on only when the check (or the epoch) ends (E-steps after the signal); the trained
    epoch lost (last.ckpt of epoch 0 only); a resume that trains epoch 1 again (other weights); a resume that skips
    the interrupted validation (Lightning's reading of a stop outside a ``validation_step``: epoch 1 then has no
    score, so ``best.ckpt``'s record differs)."""
    extra = [*FEWSHOT, f"log_dir={tmp_path / 'logs'}"]
    code, output = trainings.run(tmp_path, tmp_path / "interrupted.log", extra=extra, signal=signame,
                                 point="in-fewshot", epoch=INTERRUPTED_EPOCH)
    assert f"injected {signame} at in-fewshot" in output, output[-3000:]
    assert code == 130 and "Traceback" not in output, output[-3000:]
    how = "Ctrl-C" if signame == "SIGINT" else "SIGTERM"
    stage = tmp_path / STAGE
    assert (f"training stopped in stage classifier ({how}) in epoch {INTERRUPTED_EPOCH} after 4 training batches; "
            f"{stage / 'interrupted.ckpt'} holds that point") in output, output[-3000:]
    assert "after the signal: 0 E-steps finished" in output
    assert read_checkpoint(stage / "last.ckpt")["epoch"] == INTERRUPTED_EPOCH - 1
    code, output = trainings.run(tmp_path, tmp_path / "resumed.log", extra=[*extra, "resume=true"])
    assert code == 0, output[-3000:]
    assert f"resuming from {stage / 'interrupted.ckpt'}" in output
    assert_same_training_state(stage / "last.ckpt", uninterrupted / "last.ckpt")
    assert same_validation_record(stage / "last.ckpt", uninterrupted / "last.ckpt")


def test_a_signal_during_validation_keeps_the_epoch_and_the_resume_validates_it_whole(trainings, uninterrupted,
                                                                                    tmp_path) -> None:
    """A Ctrl-C inside the first validation batch after epoch 1 is acted on when the next batch starts, outside
    any ``validation_step``: ``interrupted.ckpt`` keeps the trained epoch, and the resume runs that validation again
    from its start, so ``best.ckpt`` is judged on epoch 1's score as in an uninterrupted run.
    Kills: the checkpoint saved with Lightning's progress counters as they are (Lightning then reads the validation
    as finished: epoch 1 gets no score, no ``best.ckpt`` of it, no logged ``val/acc``; a flake of CI's
    test_runs.py); a resume that trains epoch 1 again (other weights)."""
    extra = ["data.eval_batch_size=64"]  # 3 validation batches
    code, output = trainings.run(tmp_path, tmp_path / "interrupted.log", extra=extra, signal="SIGINT",
                                 point="in-validation", epoch=INTERRUPTED_EPOCH)
    assert "injected SIGINT at in-validation" in output, output[-3000:]
    assert code == 130 and "Traceback" not in output, output[-3000:]
    stage = tmp_path / STAGE
    assert f"in epoch {INTERRUPTED_EPOCH} after 4 training batches" in output, output[-3000:]
    assert read_checkpoint(stage / "last.ckpt")["epoch"] == INTERRUPTED_EPOCH - 1
    code, output = trainings.run(tmp_path, tmp_path / "resumed.log", extra=[*extra, "resume=true"])
    assert code == 0, output[-3000:]
    assert f"resuming from {stage / 'interrupted.ckpt'}" in output
    assert_same_training_state(stage / "last.ckpt", uninterrupted / "last.ckpt")
    assert same_validation_record(stage / "last.ckpt", uninterrupted / "last.ckpt")
    assert read_checkpoint(stage / "best.ckpt")["epoch"] == read_checkpoint(uninterrupted / "best.ckpt")["epoch"]


# ------------------------------------------------------------------------------------------- the deferral itself
@pytest.fixture
def sigint_handler():
    """Restore this process's SIGINT handler whatever a test installs."""
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_deferred_signal_reaches_the_handler_in_place_once_the_block_ends(sigint_handler) -> None:
    events: list[str] = []
    signal.signal(signal.SIGINT, lambda signum, frame: events.append("handler"))
    with signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # pressed twice: delivered once
        events.append("end of block")
    events.append("after")
    assert events == ["end of block", "handler", "after"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with signals_deferred():
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # an ignored signal stays ignored


def test_ctrl_c_inside_torch_save_completes_the_file_then_raises(sigint_handler, tmp_path, monkeypatch) -> None:
    """The bug: KeyboardInterrupt raised inside torch.save's stream came out as RuntimeError('unexpected pos')."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    real_save = torch.save

    class Stream:
        def __init__(self, handle) -> None:
            self.handle, self.writes = handle, 0

        def write(self, data) -> int:
            self.writes += 1
            if self.writes == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real_save(obj, Stream(f), *a, **k))
    path = tmp_path / "last.ckpt"
    with pytest.raises(KeyboardInterrupt):
        atomic_torch_save({"w": torch.arange(10_000.0)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(10_000.0))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
