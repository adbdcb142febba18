"""The Hopper E-step kernel (issue 44) on a GPU: its speed, the prototype's, and its agreement with ``fused``.

    python benchmarks/hopper_check.py build              # NVRTC build + ptxas report (also on a CPU machine)
    python benchmarks/hopper_check.py prototype          # the one-step prototype: us per Adam step, 132/264/1056 blocks
    python benchmarks/hopper_check.py speed              # the kernel: us per Adam step and tasks/s, 132..10,000 tasks
    python benchmarks/hopper_check.py gradients          # one Adam step of 8 tasks against fused and the emulation
    python benchmarks/hopper_check.py agreement --tasks 1000 --shots 1   # PUTM end to end against fp32 fused
    python benchmarks/hopper_check.py profile            # one launch of 132 tasks (run it under ncu)

benchmarks/hopper_check.sh runs them in one call, most important first. Each prints markdown; timings use CUDA
events after a warm-up launch. tasks/s assume the paper's 51 E-steps of 30 Adam steps per task (the M-step and the
basis are not in the kernel's time; bench_putm.py times whole runs).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lightning_putm.methods.putm.hopper import build  # noqa: E402
from lightning_putm.methods.putm.hopper.layout import Layout  # noqa: E402

PROTOTYPE = HERE / "hopper" / "prototype_step.cu"
E_STEPS, ADAM_STEPS = 51, 30


def cmd_build(args: argparse.Namespace) -> int:
    print(f"NVRTC {'.'.join(map(str, build.nvrtc_version()))}, {build.ARCH}")
    print("| shape | Adam | registers | spill stores B | spill loads B | stack B | shared B | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for dim in (80, 100):
        for exact in (False, True):
            start = time.perf_counter()
            made = build.compile_kernel(75, 5, dim, exact_adam=exact)
            r = made.resources
            print(f"| 75x5, m={dim} | {'exact' if exact else 'fast'} | {r.registers} | {r.spill_stores} | "
                  f"{r.spill_loads} | {r.stack_frame} | {Layout(75, 5, dim).shared_bytes} | "
                  f"{time.perf_counter() - start:.1f} |", flush=True)
    return 0


def prototype_cubin(variant: list[str]) -> tuple[bytes, str]:
    """The prototype built with nvcc when there is one (as its numbers were first measured), else NVRTC."""
    nvcc = shutil.which("nvcc")
    if nvcc:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "p.cubin"
            subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", *variant,
                            "-o", str(out), str(PROTOTYPE)], check=True, capture_output=True)
            return out.read_bytes(), "nvcc"
    return build.compile_source(PROTOTYPE.read_text(), variant).cubin, "nvrtc"


def cmd_prototype(args: argparse.Namespace) -> int:
    """The prototype's us per Adam step per block (random state, uninitialised shared memory): run_proto's way."""
    from lightning_putm.methods.putm.hopper.launch import _check, driver

    torch.zeros(1, device="cuda")
    cu = driver()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs")
    print("| prototype | compiler | blocks | ms per launch of 30 steps | us per Adam step | tasks/s (51x30 steps) |")
    print("|---|---|---|---|---|---|")
    for name, variant in (("fast Adam", ["-use_fast_math"]), ("no Adam state", ["-use_fast_math", "-DNO_ADAM_STATE"]),
                          ("exact Adam", ["-DEXACT_ADAM"])):
        image, compiler = prototype_cubin(variant)
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)), "cuModuleLoadData")
        _check(cu.cuModuleGetFunction(ctypes.byref(func), module, b"putm_adam_step"), "cuModuleGetFunction")
        smem = 202816  # sizeof(Smem) of the prototype
        _check(cu.cuFuncSetAttribute(func, 8, smem), "shared memory limit")
        for blocks in (sms, 2 * sms, 8 * sms):
            steps = 30
            w = torch.randn(blocks * 256 * 80, device="cuda") * 0.1
            m, v = torch.zeros_like(w), torch.zeros_like(w)
            cost = torch.rand(blocks * 375, device="cuda")
            small = torch.zeros(blocks * 192, device="cuda")
            sched = torch.full((steps * 2,), 1e-3, device="cuda")
            values = [ctypes.c_void_p(x.data_ptr()) for x in (w, m, v, cost, small)] + [ctypes.c_int(steps)]
            values += [ctypes.c_float(x) for x in (0.2, 0.5, 0.5, 0.99, 0.01, 1e-8)] + [ctypes.c_void_p(sched.data_ptr())]
            argv = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in values])

            def launch() -> None:
                _check(cu.cuLaunchKernel(func, blocks, 1, 1, 256, 1, 1, smem, None, argv, None), "cuLaunchKernel")

            ms = timed(launch)
            us = 1e3 * ms / (-(-blocks // sms) * steps)
            print(f"| {name} | {compiler} | {blocks} | {ms:.3f} | {us:.2f} | {sms / (us * 1e-6 * E_STEPS * ADAM_STEPS):,.0f} |",
                  flush=True)
    return 0


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def timed(launch, reps: int = 5) -> float:
    """Milliseconds per call of ``launch`` (CUDA events, after one warm-up call)."""
    launch()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def engine_and_inputs(tasks: int, shots: int, exact_adam: bool = False, seed: int = 0):
    from lightning_putm.methods.putm import PUTMSettings
    from lightning_putm.methods.putm.hopper.launch import HopperEngine
    from lightning_putm.methods.putm.navigator import Navigator

    m = 5 * shots + 75
    settings = PUTMSettings()
    generators = [torch.Generator().manual_seed(seed + i) for i in range(tasks)]
    navigator = Navigator([m, *settings.hidden, 1], generators, 1000, torch.device("cuda"), torch.float32, 0.01,
                          requires_grad=False)
    g = torch.Generator().manual_seed(seed)
    query = torch.nn.functional.normalize(torch.rand(tasks, 75, m, generator=g), dim=2).cuda()
    prototypes = torch.nn.functional.normalize(torch.rand(tasks, 5, m, generator=g), dim=2).cuda()
    return HopperEngine(navigator, settings, exact_adam=exact_adam), query, prototypes


def cmd_speed(args: argparse.Namespace) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; one launch = one E-step of 30 Adam steps, one block per task")
    print("| shots | Adam | tasks | ms per E-step | us per Adam step per block | tasks/s (51 E-steps) |")
    print("|---|---|---|---|---|---|")
    failures = 0
    for shots in args.shots:
        for exact in (False, True):
            for tasks in (sms, 2 * sms, 8 * sms, 10_000):
                label = f"| {shots} | {'exact' if exact else 'fast'} | {tasks} |"
                try:
                    engine, query, prototypes = engine_and_inputs(tasks, shots, exact)
                    ms = timed(lambda: engine.run(query, prototypes, 5))
                except Exception as error:  # one shape or Adam flavour failing must not hide the others
                    failures += 1
                    print(f"{label} FAILED: {first_line(error)} | | |", flush=True)
                    continue
                us = 1e3 * ms / (-(-tasks // sms) * ADAM_STEPS)
                print(f"{label} {ms:.3f} | {us:.2f} | {tasks / (ms * 1e-3 * E_STEPS):,.0f} |", flush=True)
    return 1 if failures else 0


def cmd_gradients(args: argparse.Namespace) -> int:
    """One Adam step of 8 tasks (1-shot shape): the kernel against the emulation run on the same GPU and the fused
    engine in bf16 and fp32 (relative L2 differences of the gradient, read from Adam's first moment)."""
    failures = 0
    for shots, options in ((1, {}), (5, {}), (1, {"rho": 1.0, "theta": 0.001})):
        try:
            failures += gradient_case(shots, options)
        except Exception as error:  # one case failing must not hide the others
            failures += 1
            print(f"shots {shots} {options}: FAILED: {first_line(error)}", flush=True)
    return 1 if failures else 0


def gradient_case(shots: int, options: dict) -> int:
    """One case of :func:`cmd_gradients`; 1 if it fails its bound."""
    from lightning_putm.methods.putm.engines import FusedEngine
    from lightning_putm.methods.putm.hopper.emulate import EmulatedEngine
    from lightning_putm.methods.putm.navigator import Navigator
    from lightning_putm.methods.putm import PUTMSettings

    m = 5 * shots + 75
    settings = PUTMSettings(inner_steps=1, **options)
    kernel, query, prototypes = engine_and_inputs(8, shots)
    kernel.settings = settings

    def fresh() -> Navigator:
        return Navigator([m, *settings.hidden, 1], [torch.Generator().manual_seed(i) for i in range(8)], 1000,
                         torch.device("cuda"), torch.float32, 0.01, requires_grad=False)

    engines = {"kernel": kernel, "emulation": EmulatedEngine(fresh(), settings),
               "fused bf16": FusedEngine(fresh(), settings, torch.bfloat16),
               "fused fp32": FusedEngine(fresh(), settings, torch.float32)}
    grads, pis = {}, {}
    for name, engine in engines.items():
        engine.navigator.views(engine.navigator.flat)[0][-1].mul_(3000.0)
        pis[name] = engine.run(query, prototypes, 5)
        grads[name] = engine.exp_avg / 0.5 if name in ("kernel", "emulation") else engine.grad
    torch.cuda.synchronize()

    def rel(a: str, b: str) -> float:
        return ((grads[a] - grads[b]).norm() / grads[b].norm()).item()

    pi = max((pis["kernel"][i] - pis["fused bf16"][i]).abs().max().item() for i in (0, 1))
    print(f"shots {shots} {options}: gradient kernel vs emulation {rel('kernel', 'emulation'):.3g}, vs fused bf16 "
          f"{rel('kernel', 'fused bf16'):.3g}, vs fused fp32 {rel('kernel', 'fused fp32'):.3g}; fused bf16 vs "
          f"fp32 {rel('fused bf16', 'fused fp32'):.3g}; pi_f/pi_b vs fused bf16 {pi:.3g}", flush=True)
    # the kernel sums 16 products per tensor-core step in its own order, so it may differ from the emulation by
    # bf16 roundings of a few values; it must be far closer to fused bf16 than bf16 is to fp32
    if not rel("kernel", "fused bf16") < rel("fused bf16", "fused fp32") / 10:
        print("FAIL: the kernel's gradient is not within a tenth of the bf16 gap of the fused bf16 engine's")
        return 1
    return 0


def cmd_agreement(args: argparse.Namespace) -> int:
    """crosscheck_putm.py's table with the kernel as the engine (``solver=hopper``, the way a user runs it): fused
    fp32 (the specification), the kernel, fused bf16, and the noise floor (fused fp32 on features x (1 + 2^-23))."""
    sys.path.insert(0, str(HERE))
    from bench_methods import synthetic_features
    from lightning_putm.data import sample_episode_bank
    from lightning_putm.methods.putm import PUTM
    from lightning_putm.metrics import mean_and_ci95, task_accuracy

    features = synthetic_features(dim=640)
    bank = sample_episode_bank(features.labels, 5, args.shots, 75, 2.0, args.tasks, seed=0)
    gathered = bank.gather(features.features, torch.device("cuda"))

    def solve(batch, solver: str, precision: str) -> tuple[torch.Tensor, float]:
        options = dict(solver=solver, precision=precision, em_steps=args.em_steps)
        PUTM(shots=args.shots, balanced=False, **options).predict(batch.slice(0, 1))  # builds the kernels
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = PUTM(shots=args.shots, balanced=False, **options).predict(batch)
        torch.cuda.synchronize()
        return out, time.perf_counter() - start

    batch = gathered.batch
    nudged = dataclasses.replace(batch, support=batch.support * (1 + 2**-23), query=batch.query * (1 + 2**-23))
    print(f"{args.tasks} tasks, 5-way {args.shots}-shot, 75 queries, d=640, {args.em_steps} EM steps; "
          f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print("| engine | tasks/s | mean acc % ± CI95 | % same as fp32 fused | max |Δp| vs fp32 fused |")
    print("|---|---|---|---|---|")
    spec_label, kernel_label, bf16_label = "fused fp32 (spec)", "solver=hopper (bf16)", "fused bf16"
    floor_label = "fused fp32, features x (1 + 2^-23) (noise floor)"
    rows = {}
    for label, data, solver, precision in ((spec_label, batch, "fused", "fp32"),
                                           (kernel_label, batch, "hopper", "bf16"),
                                           (bf16_label, batch, "fused", "bf16"),
                                           (floor_label, nudged, "fused", "fp32")):
        try:  # the kernel failing must not hide the other rows
            probabilities, seconds = solve(data, solver, precision)
        except Exception as error:
            print(f"| {label} | FAILED: {first_line(error)} | | | |", flush=True)
            continue
        rows[label] = probabilities
        spec = rows.get(spec_label, probabilities)
        mean, ci = mean_and_ci95(100 * task_accuracy(probabilities, gathered.query_labels))
        same = 100 * (probabilities.argmax(2) == spec.argmax(2)).double().mean().item()
        print(f"| {label} | {args.tasks / seconds:.1f} | {mean:.2f} ± {ci:.2f} | {same:.2f} | "
              f"{(probabilities - spec).abs().max().item():.3g} |", flush=True)
    if not {spec_label, kernel_label, bf16_label} <= set(rows):
        print("\nFAIL: a row is missing")
        return 1
    spec = rows[spec_label]
    same = {k: 100 * (v.argmax(2) == spec.argmax(2)).double().mean().item() for k, v in rows.items()}
    bf16 = same[bf16_label]
    ok = same[kernel_label] >= bf16 - 0.5
    floor = f"{same[floor_label]:.2f}%" if floor_label in same else "missing"
    print(f"\nkernel: {same[kernel_label]:.2f}% same as fp32 fused; fused bf16 {bf16:.2f}%; fp32 noise floor "
          f"{floor}. Bound: >= fused bf16 - 0.5 points: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def cmd_profile(args: argparse.Namespace) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    engine, query, prototypes = engine_and_inputs(sms, 1)
    engine.run(query, prototypes, 5)
    torch.cuda.synchronize()
    engine.run(query, prototypes, 5)
    torch.cuda.synchronize()
    print("profiled: one E-step launch of", sms, "tasks")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["build", "prototype", "speed", "gradients", "agreement", "profile"])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--em-steps", type=int, default=50)
    args = parser.parse_args(argv)
    if args.what != "build" and not torch.cuda.is_available():
        print("no CUDA device: nothing to run")
        return 0
    if args.what == "agreement":
        args.shots = args.shots[0]
    return {"build": cmd_build, "prototype": cmd_prototype, "speed": cmd_speed, "gradients": cmd_gradients,
            "agreement": cmd_agreement, "profile": cmd_profile}[args.what](args)


if __name__ == "__main__":
    raise SystemExit(main())
