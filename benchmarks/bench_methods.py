#!/usr/bin/env python
"""Time every registered few-shot method on one fixed batch of tasks: tasks/s, ms/task, peak memory.

Usage (from the repository root):

    python benchmarks/bench_methods.py                          # synthetic features, all methods
    python benchmarks/bench_methods.py --features digits        # the built-in digits demo (64-d pixels)
    python benchmarks/bench_methods.py --tasks 1000 --putm-tasks 100 --device cuda
    python benchmarks/bench_methods.py --methods ptmap,tim --threads 1
    python benchmarks/bench_methods.py --shots 5                # 5-shot tasks (default 1)

Tasks: 5-way 1-shot (``--shots``), 75 queries, balanced, drawn by the seeded episode bank from either synthetic
non-negative (post-ReLU-like) features with d = 640 (20 classes × 100 rows: ReLU of a standard-normal class
centre plus noise of std 3, hard enough that methods differ) or the digits demo. Every method gets the same tasks (PUTM, the slowest by far, only the first
``--putm-tasks`` of them, so the default run ends in a few minutes on 2 CPU cores), with its default
hyper-parameters for the shot count's Dirichlet-style settings (``balanced=False``; this only selects per-setting
defaults such as PUTM's ρ and θ).

Each method runs in a fresh child process, after one warm-up task, so measurements do not leak between
methods. Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` above the memory held before the timed
call; on CPU the growth of the process's resident-set high-water mark (``ru_maxrss``) during the timed call,
which counts what the call allocated beyond what the process had already touched (tracemalloc does not
see torch's allocations). Accuracy is printed as a sanity check, not as a benchmark result.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


import torch

from lightning_putm.data import digits_feature_set, sample_episode_bank
from lightning_putm.features.files import FeatureSet
from lightning_putm.methods import available_methods, build_method
from lightning_putm.metrics import task_accuracy
from lightning_putm.tasks import TaskBatch

WAYS, QUERIES = 5, 75


def synthetic_features(dim: int = 640, classes: int = 20, per_class: int = 100, seed: int = 0) -> FeatureSet:
    """Non-negative features: ReLU of one Gaussian cluster per class (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g)
    labels = torch.arange(classes).repeat_interleave(per_class)
    features = (centres[labels] + 3.0 * torch.randn(classes * per_class, dim, generator=g)).clamp_min(0)
    return FeatureSet(features, labels, [f"c{c}" for c in range(classes)], {"source": "synthetic"})


def build_tasks(features: str, tasks: int, device: torch.device, shots: int = 1) -> tuple[TaskBatch, torch.Tensor]:
    feature_set = digits_feature_set() if features == "digits" else synthetic_features()
    bank = sample_episode_bank(feature_set.labels, WAYS, shots, QUERIES, None, tasks, seed=0)
    gathered = bank.gather(feature_set.features, device)
    return gathered.batch, gathered.query_labels


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rss_peak_mib() -> float:
    scale = 1.0 if platform.system() == "Darwin" else 1024.0  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def measure(name: str, count: int, args: argparse.Namespace) -> dict:
    """Run one method once on ``count`` tasks in this process (the child side)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    tasks, labels = build_tasks(args.features, count, device, args.shots)
    method = build_method(name, {}, shots=args.shots, balanced=False, show_progress=False)
    method.predict(tasks.slice(0, 1))  # warm-up: lazy initialisation, kernel selection
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
    else:
        held = rss_peak_mib()
    start = time.perf_counter()
    probabilities = method.predict(tasks)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated(device) - held) / 2**20 if cuda else rss_peak_mib() - held
    accuracy = float(task_accuracy(probabilities, labels).mean())
    return {"method": name, "tasks": count, "shots": tasks.support.shape[1] // WAYS, "seconds": seconds,
            "precision": method.resolved_precision, "peak_mib": peak, "accuracy": accuracy,
            "device": str(device), "threads": torch.get_num_threads()}


def run_child(name: str, count: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-tasks", str(count),
               "--features", args.features, "--shots", str(args.shots), "--device", args.device,
               "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_rows(rows: list[dict]) -> str:
    header = ["method", "precision", "tasks", "time (s)", "tasks/s", "ms/task", "peak mem (MiB)", "acc (%)"]
    body = [[r["method"], r["precision"], str(r["tasks"]), f"{r['seconds']:.2f}", f"{r['tasks'] / r['seconds']:.1f}",
             f"{1000 * r['seconds'] / r['tasks']:.1f}", f"{r['peak_mib']:.1f}", f"{100 * r['accuracy']:.1f}"]
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(b) for b in body)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", choices=["synthetic", "digits"], default="synthetic")
    parser.add_argument("--shots", type=int, default=1, help="support images per class (default 1)")
    parser.add_argument("--tasks", type=int, default=100, help="tasks per method (default 100)")
    parser.add_argument("--putm-tasks", type=int, default=10, help="tasks for PUTM (default 10)")
    parser.add_argument("--methods", default="all", help="comma-separated names, or `all` (default)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-tasks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(measure(args.child, args.child_tasks, args)))
        return
    names = available_methods() if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(names) - set(available_methods()))
    if unknown:
        parser.error(f"unknown methods {unknown}; available: {', '.join(available_methods())}")
    rows = []
    for name in names:
        count = args.putm_tasks if name == "putm" else args.tasks
        print(f"timing {name} on {count} tasks ...", file=sys.stderr, flush=True)
        rows.append(run_child(name, count, args))
    first = rows[0]
    dim = 64 if args.features == "digits" else 640
    print(f"{WAYS}-way {first['shots']}-shot, {QUERIES} queries, {args.features} features (d={dim}); device {first['device']}, "
          f"{first['threads']} torch thread(s); torch {torch.__version__}")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
