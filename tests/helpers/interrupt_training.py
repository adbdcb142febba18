"""Pretraining runs a signal interrupts at an exact point of a checkpoint save (tests/test_checkpoint_interrupts.py).

Run as ``python interrupt_training.py``; it imports the training job once, then serves commands read from stdin,
one JSON object per line::

    {"args": [...train_backbone.py arguments...], "log": "/path/run.log",
     "signal": "SIGINT" | "SIGTERM" | null, "point": "<point>", "file": "last.ckpt", "epoch": 1}

For each it forks a child (the imports are paid once) that arms the injection, runs ``train_backbone.py``'s
``main`` through ``run_cli`` exactly as the script does, with stdout and stderr going to ``log``, and exits with
``run_cli``'s status. The server answers ``{"code": N}`` (a negative N: killed by signal -N).

The child sends the signal to itself (``os.kill``), so it arrives at a known instruction instead of after a
delay; ``point`` chooses where, during the save of ``file`` at the end of epoch ``epoch``:

* ``in-write``: inside ``torch.save``, between two writes of the checkpoint's stream;
* ``before-fsync``: the stream is written, the temporary file not yet fsynced;
* ``before-rename`` / ``after-rename``: just before / just after ``os.replace`` moves it over ``file``;
* ``after-save``: the save of ``file`` has returned (with ``file=best.ckpt``: between best.ckpt and last.ckpt);
* ``mid-epoch``: no save; the second training batch of epoch ``epoch``, the usual moment of a Ctrl-C;
* ``in-test``: no save; the first batch of the test that follows the training (``run_test=true``);
* ``in-fewshot``: no save; right after PUTM's third E-step in the in-training few-shot check (``fewshot_eval``)
  that follows epoch ``epoch``;
* ``in-validation``: no save; inside the first batch of the validation that follows epoch ``epoch`` (the stop
  is acted on when the next batch starts, outside any ``validation_step``).

Whenever the signal is sent the child prints ``injected <SIGNAL> at <point> of <file> (epoch <epoch>)`` to stderr,
and at its end ``after the signal: N E-steps finished`` (PUTM's E-steps finished after the stop was requested).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import torch

import lightning_putm.pretraining.checkpoints as checkpoints
from helpers.cli import script_main
from lightning_putm.cli import run_cli
from lightning_putm.methods.putm.engines import FusedEngine
from lightning_putm.pretraining.module import S2M2Module
from lightning_putm.signals import stop_requested

POINTS = ("in-write", "before-fsync", "before-rename", "after-rename", "after-save", "mid-epoch", "in-test",
          "in-fewshot", "in-validation")
FEWSHOT_E_STEP = 3  # in-fewshot: the signal follows this E-step of the few-shot check


class Injection:
    """Sends ``signum`` to this process once, at ``point`` of the save of ``file`` at epoch ``epoch``."""

    def __init__(self, signum: int, point: str, file: str, epoch: int) -> None:
        if point not in POINTS:
            raise SystemExit(f"unknown point {point!r}; points: {', '.join(POINTS)}")
        self.signum, self.point, self.file, self.epoch = signum, point, file, epoch
        self.saving = False  # inside the chosen save
        self.fired = False
        self.validating_epoch = -1  # the epoch whose validation runs (in-fewshot)
        self.e_steps = 0  # E-steps of the few-shot check after epoch ``epoch``
        self.e_steps_after = 0  # E-steps finished once the stop was requested

    def fire(self, point: str) -> None:
        if self.fired or point != self.point:
            return
        self.fired = True
        print(f"injected {signal.Signals(self.signum).name} at {point} of {self.file} (epoch {self.epoch})",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), self.signum)  # delivered before os.kill returns: the handler runs at the next line

    def arm(self) -> None:
        """Wrap the checkpoint IO, torch.save, os.fsync, os.replace and the training step."""
        injection = self
        save_checkpoint = checkpoints.AtomicCheckpointIO.save_checkpoint
        real_save, real_fsync, real_replace = torch.save, os.fsync, os.replace
        training_step, test_step = S2M2Module.training_step, S2M2Module.test_step
        validation_step = S2M2Module.validation_step

        def chosen_save(io: Any, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            chosen = Path(path).name == injection.file and checkpoint.get("epoch") == injection.epoch
            injection.saving = chosen
            try:
                save_checkpoint(io, checkpoint, path, storage_options)
            finally:
                injection.saving = False
            if chosen:
                injection.fire("after-save")

        class Stream:
            """The file torch.save writes to; the signal comes between its second and third write."""

            def __init__(self, handle: Any) -> None:
                self.handle, self.writes = handle, 0

            def write(self, data: Any) -> int:
                self.writes += 1
                if self.writes == 3:
                    injection.fire("in-write")
                return self.handle.write(data)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.handle, name)

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            real_save(obj, Stream(f) if injection.saving and hasattr(f, "write") else f, *args, **kwargs)

        def fsync(fd: int) -> None:
            if injection.saving and stat.S_ISREG(os.fstat(fd).st_mode):  # the temporary file, not its folder
                injection.fire("before-fsync")
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            if injection.saving:
                injection.fire("before-rename")
            real_replace(src, dst, **kwargs)
            if injection.saving:
                injection.fire("after-rename")

        def step(module: S2M2Module, batch: Any, batch_idx: int) -> Any:
            if module.current_epoch == injection.epoch and batch_idx == 1:
                injection.fire("mid-epoch")
            return training_step(module, batch, batch_idx)

        def validate(module: S2M2Module, batch: Any, batch_idx: int, *args: Any) -> Any:
            if not module.trainer.sanity_checking and module.current_epoch == injection.epoch and batch_idx == 0:
                injection.fire("in-validation")
            return validation_step(module, batch, batch_idx, *args)

        def test(module: S2M2Module, batch: Any, batch_idx: int) -> Any:
            injection.fire("in-test")
            return test_step(module, batch, batch_idx)

        validation_start, e_step = S2M2Module.on_validation_epoch_start, FusedEngine.run

        def on_validation_epoch_start(module: S2M2Module) -> None:
            injection.validating_epoch = -1 if module.trainer.sanity_checking else module.current_epoch
            validation_start(module)

        def run(engine: FusedEngine, *args: Any, **kwargs: Any) -> Any:
            result = e_step(engine, *args, **kwargs)
            if stop_requested():
                injection.e_steps_after += 1
            if injection.validating_epoch == injection.epoch:
                injection.e_steps += 1
                if injection.e_steps == FEWSHOT_E_STEP:
                    injection.fire("in-fewshot")
            return result

        checkpoints.AtomicCheckpointIO.save_checkpoint = chosen_save
        torch.save, os.fsync, os.replace = save, fsync, replace
        S2M2Module.training_step, S2M2Module.test_step, S2M2Module.validation_step = step, test, validate
        S2M2Module.on_validation_epoch_start, FusedEngine.run = on_validation_epoch_start, run


def run_child(command: dict[str, Any]) -> None:
    """In the forked child: redirect output, arm the injection, run the job; never returns."""
    code = 1
    injection = None
    try:
        fd = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        if command.get("signal"):
            injection = Injection(getattr(signal, command["signal"]), command["point"], command.get("file", "last.ckpt"),
                                  int(command.get("epoch", 1)))
            injection.arm()
        code = run_cli(script_main("train_backbone"), command["args"], job="train_backbone")
    finally:
        if injection is not None:
            print(f"after the signal: {injection.e_steps_after} E-steps finished", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    # As in a terminal: Ctrl-C raises KeyboardInterrupt and SIGTERM has its default action, even where the
    # parent (a backgrounded shell, nohup) handed them down ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    script_main("train_backbone")  # loaded once, before the forks
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            run_child(command)
        _, status = os.waitpid(pid, 0)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        print(json.dumps({"code": code}), flush=True)


if __name__ == "__main__":
    main()
