"""A writer that gets SIGKILLed mid-write, many times, cheaply (used by tests/test_interruptions.py).

Run as ``python crash_writer.py``; it imports torch once, then serves commands read from stdin, one per line::

    MODE TARGET SIZE_MB FIRST_VERSION DELAY_S

For each command it forks a child that writes versions FIRST_VERSION, FIRST_VERSION + 1, ... of a payload of
SIZE_MB megabytes to TARGET, back to back, printing ``begin K`` before and ``done K`` after each write. After
DELAY_S seconds the server SIGKILLs the child (a real kill -9 of a real process: no handler, no cleanup, no
flush), reaps it and prints ``end``. Forking avoids paying the torch import for every kill.

MODE is how the payload is written:

* ``checkpoint``: ``AtomicCheckpointIO().save_checkpoint`` (what the Trainer uses for last.ckpt / best.ckpt),
* ``features``: ``lightning_putm.features.save_features``,
* ``cache``: ``FeatureCache.store`` of the evaluation feature cache (TARGET is the cache folder),
* ``plain``: bare ``torch.save`` to the target (the control: its torn writes show the check can fail).

Payload version K: every feature value equals K and the metadata (or checkpoint) records K.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

from lightning_putm.features.cache import FeatureCache, FeatureCacheKey
from lightning_putm.features.files import FeatureSet, save_features
from lightning_putm.pretraining.checkpoints import AtomicCheckpointIO

CACHE_KEY = FeatureCacheKey(checkpoint_sha256="ab" * 32, dataset="digits", root="", options="{}", split="test",
                            transform="crash-test")
COLUMNS = 64


def payload_set(values: torch.Tensor, version: int) -> FeatureSet:
    rows = values.shape[0]
    return FeatureSet(values, torch.arange(rows) % 4, [f"c{i}" for i in range(4)], {"version": version})


def write_once(mode: str, target: Path, values: torch.Tensor, version: int) -> None:
    """Write version ``version`` (every value set to it) the way ``mode`` writes."""
    values.fill_(float(version))
    if mode == "checkpoint":
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": values}, "version": version, "epoch": version}, target)
    elif mode == "features":
        save_features(payload_set(values, version), target)
    elif mode == "cache":
        FeatureCache(target, CACHE_KEY).store(payload_set(values, version))
    elif mode == "plain":
        torch.save({"state_dict": {"w": values}, "version": version}, target)
    else:
        raise SystemExit(f"unknown mode {mode}")


def payload(size_mb: float) -> torch.Tensor:
    return torch.empty(max(4, int(size_mb * 2**20 / 4 / COLUMNS)), COLUMNS)


def write_forever(mode: str, target: Path, size_mb: float, first: int) -> None:
    values = payload(size_mb)
    version = first
    while True:
        os.write(1, f"begin {version}\n".encode())
        write_once(mode, target, values, version)
        os.write(1, f"done {version}\n".encode())
        version += 1


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        mode, target, size_mb, first, delay = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: write until killed
            try:
                write_forever(mode, Path(target), float(size_mb), int(first))
            finally:
                os._exit(1)
        time.sleep(float(delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(f"end {'killed' if killed else 'exited'}", flush=True)


if __name__ == "__main__":
    main()
