#!/usr/bin/env python
"""Throughput, peak memory and achieved FLOP rate of the PUTM solver (and, optionally, of the reference code).

Setting: 5-way 1-shot, 75 queries, d = 640, Dirichlet(α=2) query counts, 50 EM steps × 30 Adam steps and the
other defaults of conf/method/putm.yaml (issue 6). Each (implementation, T) runs in a fresh worker process, so
its peak memory is its own: the worker's peak resident set size on CPU (it includes the Python/torch runtime,
~0.3–0.5 GB, and the gathered task features, 0.2 MB per task), ``torch.cuda.max_memory_allocated`` on CUDA.

    python benchmarks/bench_putm.py                                  # T in 1 10 100 1000 10000, current device
    python benchmarks/bench_putm.py --sizes 1 10 100 --device cpu
    python benchmarks/bench_putm.py --sizes 200 --reference /path/to/PUTM      # + the reference, same tasks
    python benchmarks/bench_putm.py --sizes 10000 --em-steps 2                 # EXTRAPOLATED to 50 EM steps
    python benchmarks/bench_putm.py --precision bf16 --sizes 100               # any PUTM option: see --help
    python benchmarks/bench_putm.py --solver triton --triton-warps 4 --triton-stages 3
                                                          # the fused Triton kernel with one launch
    python benchmarks/bench_putm.py --sm90-resources      # no GPU: each launch's sm_90 resources (tools/)

``--reference DIR`` is a local checkout of RashLog/PUTM (not part of this project); its ``methods/putm.py`` is
run through benchmarks/reference_putm.py on exactly the same tasks in the same run, as one batch of T tasks
(it has no chunking), up to ``--reference-max-tasks``. The ratio column is ours/reference in tasks/s.

Our solver gets the tasks in streamed slices of ``--stream-tasks`` (gathered from the episode bank slice by
slice, as an evaluation of 100,000 tasks would), and chunks each slice under ``--memory-budget-mb`` (and, on
CPU, at most ``max_chunk_tasks`` tasks per chunk), so its memory stays bounded for any T.

Duration: on 2 busy CPU cores the solver does about 1–2 tasks/s in fp32 (the reference about 0.5–0.7), so
T = 1000 takes 10–20 minutes and T = 10000 two to three hours per implementation. ``--em-steps K`` (K < 50)
runs K EM steps instead and scales the time by 51/(K+1) (the run does K+1 E-steps instead of 51; the
one-off preprocessing is <1 % of the total); such rows are marked ``extrap. K EM`` — prefer measured rows.

FLOPs (counted analytically per task; only useful work, none of the zero-padding):
    P = N·Q pairs, navigator widths m → h1 → h2 → 1 with m = min(d, N·K + Q), W = m·h1 + h1·h2 + h2 weights
    per Adam step:   forward 2P·W,  weight gradients 2P·W,  input gradients of layers 2 and 3 2P·(h1·h2 + h2),
                     Adam 10 FLOPs per parameter (W + h1 + h2 + 1),
                     CT head ~ 30 FLOPs per pair (two softmaxes, loss gradient)
    per E-step:      cost and squared differences 3·P·m
    per task:        (EM + 1) · (inner · step + E-step extra) + preprocessing (QR 4·n·d·m, power 20·n·d)
With the defaults: ≈ 34 MFLOP per Adam step, ≈ 52 GFLOP per task.

Device peak (the "% peak" column): ``--peak-gflops`` if given; on CPU, the best rate of a few 2048² matrix
products in the benchmark's compute type on one thread, times the thread count, measured at start-up (what
BLAS can do on this machine; a busy machine lowers it); on CUDA, NVIDIA's dense datasheet peak for the device's name (H100,
H200, A100, L40S, ...) in fp32, tf32 or bf16, or a measured large product when the name is unknown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from triton_flags import add_triton_flags, check_triton_flags, putm_settings, triton_flag_values

EM_STEPS = 50
#: Dense (no sparsity) datasheet peaks in TFLOP/s: (name fragment, fp32, tf32, bf16); first match wins.
GPU_PEAK_TFLOPS = [
    ("H200 NVL", 60.0, 417.5, 835.5),
    ("H200", 67.0, 494.7, 989.4),
    ("H100 PCIe", 51.2, 378.0, 756.0),
    ("H100 NVL", 60.0, 417.5, 835.5),
    ("H100", 67.0, 494.7, 989.4),
    ("A100", 19.5, 156.0, 312.0),
    ("L40S", 91.6, 183.0, 366.0),
    ("L4", 30.3, 60.0, 121.0),
    ("A10", 31.2, 62.5, 125.0),
]


def synthetic_features(dim: int, classes: int = 64, per_class: int = 100, seed: int = 0):
    """Post-ReLU-like features (non-negative), 64 classes × 100 rows, fixed seed; speed does not depend on them."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=generator).abs()
    labels = torch.arange(classes).repeat_interleave(per_class)
    features = (centres[labels] + 0.5 * torch.randn(len(labels), dim, generator=generator)).clamp_min(0)
    return features, labels


def flops_per_task(ways: int, shots: int, queries: int, dim: int, hidden: tuple[int, ...], inner_steps: int,
                   em_steps: int) -> float:
    """Useful floating-point operations to solve one task (the formula of the module docstring)."""
    pairs = ways * queries
    n = ways * shots + queries
    m = min(dim, n)
    widths = [m, *hidden, 1]
    weights = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    input_grads = sum(a * b for a, b in zip(widths[1:-1], widths[2:]))
    parameters = weights + sum(widths[1:])
    step = 2 * pairs * weights * 2 + 2 * pairs * input_grads + 10 * parameters + 30 * pairs
    e_step = inner_steps * step + 3 * pairs * m
    preprocessing = 4 * n * dim * m + 20 * n * dim
    return float((em_steps + 1) * e_step + preprocessing)


def measured_peak_gflops(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best rate of a few ``size``² matrix products on ``device`` (a practical peak, not the datasheet's).

    On CPU: one thread's best rate times the thread count, which a busy machine disturbs less than a
    measurement with all threads at once.
    """
    if device.type == "cpu" and torch.get_num_threads() > 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return threads * measured_peak_gflops(device, dtype, size, repeats)
        finally:
            torch.set_num_threads(threads)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def device_peak_gflops(device: torch.device, precision: str) -> tuple[float, str]:
    """``(GFLOP/s, source)`` for the device in the given precision."""
    column = {"fp32": 1, "tf32": 2, "bf16": 3}[precision]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if precision == "tf32" and not torch.cuda.get_device_capability(device) >= (8, 0):
            column = 1
        for entry in GPU_PEAK_TFLOPS:
            if entry[0] in name:
                return 1000 * entry[column], f"datasheet {entry[0]} {precision}"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    threads = f", {torch.get_num_threads()} threads x 1-thread rate" if device.type == "cpu" else ""
    return measured_peak_gflops(device, dtype), f"measured {str(dtype).replace('torch.', '')} matmul{threads}"


def bank_slice(bank, start: int, stop: int):
    """Tasks ``start:stop`` of an episode bank (every per-task tensor sliced)."""
    fields = {f.name: getattr(bank, f.name) for f in dataclasses.fields(bank)}
    return dataclasses.replace(bank, **{k: v[start:stop] for k, v in fields.items() if isinstance(v, torch.Tensor)})


def solver_options(args: argparse.Namespace) -> dict:
    options = {"em_steps": args.em_steps, "precision": args.precision, "solver": args.solver,
               "memory_budget_mb": args.memory_budget_mb, "basis": args.basis}
    if args.early_stop_tol is not None:
        options["early_stop_tol"] = args.early_stop_tol
    if args.max_chunk_tasks is not None:
        options["max_chunk_tasks"] = args.max_chunk_tasks
    if args.cpu_workers is not None:
        options["cpu_workers"] = args.cpu_workers
    return options


def build_solver(args: argparse.Namespace, options: dict):
    """Our PUTM from :func:`solver_options` (or :func:`warm_up_options`) and the ``--triton-*`` launch."""
    from lightning_putm.methods.putm import PUTM

    options = dict(options)
    budget = options.pop("memory_budget_mb")
    return PUTM(putm_settings(options, args), shots=args.shots, balanced=args.balanced, memory_budget_mb=budget)


def warm_up_options(args: argparse.Namespace) -> dict:
    """The untimed one-task warm-up's options: the timed run's, so that it compiles every kernel the timed run
    launches (triton specializes on early stopping, balance and precision), with one EM step (the M-step kernel
    too) of two Adam steps."""
    return {**solver_options(args), "em_steps": 1, "inner_steps": 2}


def worker(args: argparse.Namespace) -> dict:
    """Solve ``args.size`` tasks with one implementation; report seconds, chunks, accuracy and peak memory."""
    from lightning_putm.data.episodes import sample_episode_bank
    from lightning_putm.metrics import task_accuracy

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    features, labels = synthetic_features(args.dim)
    alpha = None if args.balanced else 2.0
    bank = sample_episode_bank(labels, args.ways, args.shots, args.queries, alpha, args.size, seed=0)
    correct = chunks = 0
    if args.implementation == "reference":
        from reference_putm import load_reference_module, reference_accuracy

        module = load_reference_module(args.reference)
        gathered = bank.gather(features, device)
        warm = bank_slice(bank, 0, 1).gather(features, device)
        reference_accuracy(module, warm.batch, warm.query_labels, balanced=args.balanced, n_epochs=1)
        _reset_peak(device)
        start = time.perf_counter()
        accuracy = reference_accuracy(module, gathered.batch, gathered.query_labels, balanced=args.balanced,
                                      n_epochs=args.em_steps)
        _sync(device)
        seconds, chunks, correct = time.perf_counter() - start, 1, float(accuracy.sum())
    else:
        solver = build_solver(args, solver_options(args))
        warm = bank_slice(bank, 0, 1).gather(features, device)
        build_solver(args, warm_up_options(args)).predict(warm.batch)
        _reset_peak(device)
        start = time.perf_counter()
        for first in range(0, args.size, args.stream_tasks):
            part = bank_slice(bank, first, min(first + args.stream_tasks, args.size)).gather(features, device)
            probabilities = solver.predict(part.batch)
            correct += float(task_accuracy(probabilities, part.query_labels).sum())
            chunks += solver.num_chunks(part.batch)
        _sync(device)
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"seconds": seconds, "chunks": chunks, "peak_mb": peak, "accuracy": correct / args.size,
            "threads": torch.get_num_threads()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def run_worker(args: argparse.Namespace, size: int, implementation: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--size", str(size), "--implementation", implementation,
               "--device", args.device, "--dim", str(args.dim), "--ways", str(args.ways), "--shots", str(args.shots),
               "--queries", str(args.queries), "--memory-budget-mb", str(args.memory_budget_mb),
               "--em-steps", str(args.em_steps), "--precision", args.precision, "--solver", args.solver,
               "--stream-tasks", str(args.stream_tasks), "--threads", str(args.threads), "--basis", args.basis]
    for flag, value in (("--early-stop-tol", args.early_stop_tol), ("--max-chunk-tasks", args.max_chunk_tasks),
                        ("--cpu-workers", args.cpu_workers), ("--reference", args.reference),
                        *triton_flag_values(args)):
        if value is not None:
            command += [flag, str(value)]
    if args.balanced:
        command.append("--balanced")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 10, 100, 1000, 10000])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=640)
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--shots", type=int, default=1)
    parser.add_argument("--queries", type=int, default=75)
    parser.add_argument("--balanced", action="store_true", help="balanced settings (rho=1, theta=0.001)")
    parser.add_argument("--em-steps", type=int, default=EM_STEPS,
                        help=f"EM steps actually run; below {EM_STEPS} the times are extrapolated (and marked)")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16"])
    parser.add_argument("--solver", default="auto", choices=["auto", "compiled", "fused", "autograd", "triton"],
                        help="PUTM engine (auto = triton on sm_90 GPUs, compiled on other CUDA devices, fused elsewhere; "
                             "triton = the fused kernel)")
    parser.add_argument("--basis", default="auto", choices=["auto", "qr", "cholesky"],
                        help="PUTM per-task basis (auto = cholesky on CUDA, qr elsewhere)")
    add_triton_flags(parser)
    parser.add_argument("--early-stop-tol", type=float, default=None)
    parser.add_argument("--max-chunk-tasks", type=int, default=None, help="PUTM chunk cap (default: automatic)")
    parser.add_argument("--cpu-workers", type=int, default=None, help="PUTM CPU workers (default: torch threads)")
    parser.add_argument("--memory-budget-mb", type=float, default=2048.0)
    parser.add_argument("--stream-tasks", type=int, default=1000, help="tasks gathered and solved at a time")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads in the workers (0 = default)")
    parser.add_argument("--peak-gflops", type=float, default=None, help="device peak for the %% column")
    parser.add_argument("--reference", help="local checkout of RashLog/PUTM: time it on the same tasks")
    parser.add_argument("--reference-max-tasks", type=int, default=1000,
                        help="largest T given to the reference (one batch, no chunking; memory grows with T)")
    parser.add_argument("--sm90-resources", action="store_true",
                        help="print the Triton kernel's registers, spills, shared memory and estimated instructions "
                             "per Adam step on sm_90 (compiled here, no GPU needed) for the launches of the sweep "
                             "(tools/triton_resources.py), and exit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--implementation", default="ours", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_triton_flags(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.sm90_resources:
        from lightning_putm.studies.reference import import_from_checkout

        import_from_checkout(Path(__file__).resolve().parents[1] / "tools", "triton_resources",
                             flag="--sm90-resources").main()
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    from lightning_putm.methods.preprocessing import resolve_basis
    from lightning_putm.methods.putm import PUTM, resolve_precision
    from lightning_putm.methods.putm.solvers import resolve_solver

    precision = resolve_precision(args.precision, device)
    if args.peak_gflops is not None:
        peak, source = args.peak_gflops, "--peak-gflops"
    else:
        peak, source = device_peak_gflops(device, precision)

    defaults = PUTM(shots=args.shots, balanced=args.balanced).settings
    flops = flops_per_task(args.ways, args.shots, args.queries, args.dim, defaults.hidden, defaults.inner_steps,
                           EM_STEPS)
    scale = (EM_STEPS + 1) / (args.em_steps + 1)
    basis = "measured" if args.em_steps == EM_STEPS else f"extrap. {args.em_steps} EM"
    print(f"PUTM solver, {args.ways}-way {args.shots}-shot, {args.queries} queries, d={args.dim}, "
          f"{'balanced' if args.balanced else 'Dirichlet alpha=2'} settings, {EM_STEPS} EM x {defaults.inner_steps} Adam "
          f"steps; ours: {resolved('solver', args.solver, resolve_solver(args.solver, device))} "
          f"{resolved('precision', args.precision, precision)} "
          f"{resolved('basis', args.basis, resolve_basis(args.basis, device))}"
          + (f" early_stop_tol={args.early_stop_tol:g}" if args.early_stop_tol is not None else ""))
    print(f"device: {device_name}; torch {torch.__version__}; memory budget {args.memory_budget_mb:g} MB; "
          f"{flops / 1e9:.1f} GFLOP per task; device peak {peak:,.0f} GFLOP/s ({source})")
    if args.solver == "triton":
        launch = putm_settings({}, args)
        print(f"triton launch: warps={launch.triton_warps}, stages={launch.triton_stages}")
    if args.em_steps != EM_STEPS:
        print(f"NOTE: rows marked 'extrap.' ran {args.em_steps} EM steps; their times are scaled by {scale:.2f} "
              f"to {EM_STEPS} EM steps (extrapolated, not measured)")
    header = (f"{'implementation':14} {'device':6} {'T':>6} {'chunks':>6} {'seconds':>9} {'tasks/s':>9} {'ms/task':>9} "
              f"{'peak MB':>9} {'GFLOP/s':>9} {'% peak':>7} {'acc %':>6} {'ours/ref':>8}  basis")
    print(header)
    print("-" * len(header))
    failures = []
    for size in args.sizes:
        ours = run_worker(args, size, "ours")
        print_row(device, "ours", size, ours, scale, flops, peak, basis)
        if args.reference and size <= args.reference_max_tasks:
            try:  # our row is already out: a broken reference checkout costs only its own row
                reference = run_worker(args, size, "reference")
            except SystemExit as failure:
                failures.append(str(failure))
                print(f"{'reference':14} {device.type:6} {size:6d}  FAILED ({failure}; its error is above)", flush=True)
            else:
                ratio = f"{reference['seconds'] / ours['seconds']:7.2f}x"
                print_row(device, "reference", size, reference, scale, flops, peak, basis, ratio)
        if args.reference and size > args.reference_max_tasks:
            print(f"{'reference':14} {device.type:6} {size:6d}  skipped (T > --reference-max-tasks "
                  f"{args.reference_max_tasks})", flush=True)
    if failures:
        raise SystemExit("; ".join(failures))


def resolved(key: str, asked: str, used: str) -> str:
    """``key=asked``, and what it resolved to on this device when that differs (``precision=auto (= bf16 here)``)."""
    return f"{key}={asked}" + (f" (= {used} here)" if used != asked else "")


def print_row(device: torch.device, name: str, size: int, result: dict, scale: float,
              flops: float, peak: float, basis: str, ratio: str = "") -> None:
    """One line of the table (times scaled to 50 EM steps where fewer ran)."""
    seconds = result["seconds"] * scale
    rate = flops * size / seconds / 1e9
    print(f"{name:14} {device.type:6} {size:6d} {result['chunks']:6d} {seconds:9.2f} {size / seconds:9.3f} "
          f"{1000 * seconds / size:9.1f} {result['peak_mb']:9.0f} {rate:9.1f} {100 * rate / peak:6.1f}% "
          f"{100 * result['accuracy']:6.1f} {ratio:>8}  {basis}", flush=True)

if __name__ == "__main__":
    main()
