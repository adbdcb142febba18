#!/usr/bin/env python
"""Throughput and peak memory of the PUTM solver: 5-way 1-shot, 75 queries, d = 640, default settings.

Each batch size T runs in a fresh worker process, so its peak memory is its own (resident set size on CPU,
``torch.cuda.max_memory_allocated`` on CUDA). Large T is chunked automatically under ``--memory-budget-mb``.

    python benchmarks/bench_putm.py                          # T in 1, 10, 100, 1000 on the current device
    python benchmarks/bench_putm.py --sizes 1 10 100 --device cpu
    python benchmarks/bench_putm.py --sizes 100 --reference ../PUTM   # also the reference code, same tasks

Features are synthetic post-ReLU-like vectors (non-negative, 64 classes x 100 rows, fixed seed); speed does
not depend on their values. On 2 CPU cores T = 1000 takes over ten minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def synthetic_features(dim: int, classes: int = 64, per_class: int = 100, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=generator).abs()
    labels = torch.arange(classes).repeat_interleave(per_class)
    features = (centres[labels] + 0.5 * torch.randn(len(labels), dim, generator=generator)).clamp_min(0)
    return features, labels


def worker(args: argparse.Namespace) -> dict:
    """Solve one batch of ``args.size`` tasks and report seconds, chunking and peak memory."""
    from lightning_putm.data.episodes import sample_episode_bank
    from lightning_putm.methods.putm import PUTM

    device = torch.device(args.device)
    features, labels = synthetic_features(args.dim)
    bank = sample_episode_bank(labels, args.ways, args.shots, args.queries, None if args.balanced else 2.0,
                               args.size, seed=0)
    gathered = bank.gather(features, device)
    if args.implementation == "reference":
        from reference_putm import load_reference_module, reference_accuracy

        module = load_reference_module(args.reference)
        start = time.perf_counter()
        reference_accuracy(module, gathered.batch, gathered.query_labels, balanced=args.balanced)
        _sync(device)
        seconds, chunks = time.perf_counter() - start, 1
    else:
        solver = PUTM(shots=args.shots, balanced=args.balanced, memory_budget_mb=args.memory_budget_mb)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        solver.predict(gathered.batch)
        _sync(device)
        seconds, chunks = time.perf_counter() - start, solver.num_chunks(gathered.batch)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"seconds": seconds, "chunks": chunks, "peak_mb": peak}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_worker(args: argparse.Namespace, size: int, implementation: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--size", str(size), "--implementation", implementation,
               "--device", args.device, "--dim", str(args.dim), "--ways", str(args.ways), "--shots", str(args.shots),
               "--queries", str(args.queries), "--memory-budget-mb", str(args.memory_budget_mb)]
    if args.balanced:
        command.append("--balanced")
    if args.reference:
        command += ["--reference", args.reference]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    output = process.stdout.read()
    process.stdout.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"worker for T={size} ({implementation}) failed")
    result = json.loads(output.strip().splitlines()[-1])
    if result["peak_mb"] is None:  # CPU: the worker's own peak resident set (ru_maxrss is in KiB on Linux)
        result["peak_mb"] = usage.ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=640)
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--shots", type=int, default=1)
    parser.add_argument("--queries", type=int, default=75)
    parser.add_argument("--balanced", action="store_true", help="balanced settings (rho=1, theta=0.001)")
    parser.add_argument("--memory-budget-mb", type=float, default=2048.0)
    parser.add_argument("--reference", help="local checkout of RashLog/PUTM: time it on the same tasks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--implementation", default="ours", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else (
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    print(f"PUTM solver, {args.ways}-way {args.shots}-shot, {args.queries} queries, d={args.dim}, "
          f"{'balanced' if args.balanced else 'Dirichlet alpha=2'} settings, 50 EM x 30 Adam steps")
    print(f"device: {device_name}; torch {torch.__version__}; memory budget {args.memory_budget_mb:g} MB")
    header = f"{'implementation':14} {'T':>6} {'chunks':>6} {'seconds':>9} {'tasks/s':>9} {'ms/task':>9} {'peak MB':>9}"
    print(header + ("  ratio" if args.reference else ""))
    print("-" * len(header))
    for size in args.sizes:
        ours = run_worker(args, size, "ours")
        rows = [("ours", ours)]
        if args.reference:
            rows.append(("reference", run_worker(args, size, "reference")))
        for name, result in rows:
            speed = size / result["seconds"]
            ratio = f"  {ours['seconds'] / result['seconds']:.2f}x" if name == "reference" else ""
            print(f"{name:14} {size:6d} {result['chunks']:6d} {result['seconds']:9.2f} {speed:9.2f} "
                  f"{1000 * result['seconds'] / size:9.1f} {result['peak_mb']:9.0f}{ratio}", flush=True)


if __name__ == "__main__":
    main()
