"""Run the public PUTM reference implementation (RashLog/PUTM) on our tasks, for side-by-side numbers.

Nothing of the reference is part of this project: the user passes a local checkout of it
(``--reference DIR``) and this adapter imports its ``methods/putm.py`` from there at run time (through
``lightning_putm.studies.reference.import_from_checkout``, the one way the benchmarks import reference code). The
reference hard-codes 5 ways and 75 queries, calls ``.cuda()`` and needs ``d >= n``; on a CPU-only machine
its ``.cuda()`` calls are redirected to no-ops, and features narrower than a task are zero-padded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

from lightning_putm.studies.reference import import_from_checkout
from lightning_putm.tasks import TaskBatch


def load_reference_module(checkout: str | Path):
    """The reference's ``methods/putm.py`` from a checkout of RashLog/PUTM."""
    return import_from_checkout(checkout, "methods.putm")


@contextlib.contextmanager
def cuda_calls_stay_on_cpu():
    """Make ``tensor.cuda()`` a no-op when CUDA is absent (the reference calls it unconditionally)."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[assignment]


def reference_args(tasks: TaskBatch, balanced: bool, **overrides) -> argparse.Namespace:
    """The reference's settings (its config/{dirichlet,balanced}/methods_config/putm.yaml)."""
    shots = tasks.num_support // tasks.ways
    args = argparse.Namespace(
        n_ways=tasks.ways, shot=shots, batch_size=tasks.num_tasks, n_query=tasks.num_queries // tasks.ways,
        alpha=[0.2, 0.1], beta=0.6, lam=10, n_epochs=50, epochs=30, hidden=128, lr=1e-3,
        rho=1.0 if balanced else 0.5, theta=0.001 if balanced else 0.0, use_plda=False, use_km=False, T_km=100,
        balanced="dirichlet",  # our support rows are class-major, which is the reference's 'dirichlet' layout
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def reference_accuracy(module, tasks: TaskBatch, query_labels: torch.Tensor, balanced: bool, seed: int = 0,
                       quiet: bool = True, **overrides) -> torch.Tensor:
    """Per-task accuracy ``[T]`` of the reference PUTM solving ``tasks`` in one batch."""
    if tasks.ways != 5 or tasks.num_queries != 75:
        raise SystemExit("the reference implementation hard-codes 5 ways and 75 queries")
    rows = torch.cat([tasks.support, tasks.query], dim=1).clone()
    n = rows.shape[1]
    if rows.shape[2] < n:
        rows = torch.nn.functional.pad(rows, (0, n - rows.shape[2]))
    labels = torch.cat([tasks.support_labels, query_labels], dim=1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = reference_args(tasks, balanced, **overrides)
    torch.manual_seed(seed)
    sink = io.StringIO()
    with cuda_calls_stay_on_cpu(), contextlib.redirect_stdout(sink if quiet else sys.stdout), \
            contextlib.redirect_stderr(sink if quiet else sys.stderr):
        solver = module.PUTM(None, device, None, args)
        logs = solver.run_task(rows.to(device), labels.to(device), args)
    return torch.as_tensor(logs["acc"]).flatten().double()
