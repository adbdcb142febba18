"""Mutation run for PUTM: do the tests catch every broken option, formula and step count?

Each mutant is one small source change in ``lightning_putm/methods/putm/`` (or in the preprocessing PUTM uses):
an option ignored or miswired, a sign or constant changed, an off-by-one, a wrong softmax dimension, the
inertia or Adam bias-correction formula broken. The working tree is NEVER modified: ``lightning_putm/``,
``conf/``, ``tests/`` and ``pyproject.toml`` are copied into a temporary folder, each mutant is applied
there, and the PUTM test files run there (``cwd`` = the copy, ``PYTHONPATH`` = the copy, no bytecode, no
pytest cache), stopping at the first failure. The first mutant (``sanity``) breaks the package's import: it
must be killed, which proves the copy, not the editable install, is the code under test. A mutant whose
search text is not found exactly once stops the run.

    python tools/mutation_putm.py                      # all mutants, sequential
    python tools/mutation_putm.py --only rho           # mutants whose name contains "rho"
    python tools/mutation_putm.py --list               # the mutants, without running them
    ATEN_CPU_CAPABILITY=avx2 python tools/mutation_putm.py --only "device loop"   # on another CPU code path

A mutant may name its own tests (the EM loop on the device: the Triton interpreter's test, minutes per mutant).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PUTM = "lightning_putm/methods/putm/"
PRE = "lightning_putm/methods/preprocessing.py"
TEST_FILES = ["tests/test_putm_options.py", "tests/test_putm.py", "tests/test_putm_speed_options.py",
              "tests/test_putm_compiled.py"]
TIMEOUT_S = 600
#: The device-loop mutants' test (it runs the Triton interpreter in child processes)
DEVICE_LOOP_TEST = ("tests/test_putm_triton.py::test_em_loop_on_the_device_matches_the_host_loop",)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    search: str
    replace: str
    tests: tuple[str, ...] = ()  # the tests that must kill it, when not :data:`TEST_FILES`


MUTANTS = [
    Mutant("sanity: package import broken", PUTM + "method.py", "from tqdm.auto import tqdm",
           "raise ImportError('mutant')"),
    # --- prototype_update / M-step / inertia
    Mutant("prototype_update ignored (always forward)", PUTM + "m_step.py",
           '    if prototype_update == "backward":\n        return backward\n    return rho * forward + (1 - rho) * backward',
           "    return forward"),
    Mutant("prototype_update backward gives forward", PUTM + "m_step.py",
           '    if prototype_update == "backward":\n        return backward', '    if prototype_update == "backward":\n        return forward'),
    Mutant("prototype_update mixed: rho swapped", PUTM + "m_step.py", "return rho * forward + (1 - rho) * backward",
           "return (1 - rho) * forward + rho * backward"),
    Mutant("inertia ignored (mu <- estimate)", PUTM + "m_step.py", "return prototypes + inertia * (estimate - prototypes)",
           "return estimate"),
    Mutant("inertia a <-> 1-a", PUTM + "m_step.py", "return prototypes + inertia * (estimate - prototypes)",
           "return estimate + inertia * (prototypes - estimate)"),
    Mutant("M-step ignores the support rows", PUTM + "m_step.py", "torch.cat([support_one_hot, query_weights], dim=1)",
           "torch.cat([support_one_hot * 0, query_weights], dim=1)"),
    Mutant("next E-step keeps the old prototypes", PUTM + "em.py", "            part.prototypes = updated\n",
           "            pass\n"),
    # --- settings by setting
    Mutant("inertia_one_shot / few_shot swapped", PUTM + "settings.py",
           "self.inertia_one_shot if shots == 1 else self.inertia_few_shot",
           "self.inertia_few_shot if shots == 1 else self.inertia_one_shot"),
    Mutant("rho default ignores balanced", PUTM + "settings.py", 'changes["rho"] = 1.0 if balanced else 0.5', 'changes["rho"] = 0.5'),
    Mutant("theta default ignores balanced", PUTM + "settings.py", 'changes["theta"] = 0.001 if balanced else 0.0', 'changes["theta"] = 0.0'),
    # --- reinit_navigator
    Mutant("reinit_navigator ignored in EM steps", PUTM + "em.py",
           "            if s.reinit_navigator:  #", "            if s.reinit_navigator and step is None:  #"),
    Mutant("reinit_navigator ignored in the final E-step", PUTM + "em.py",
           "            if s.reinit_navigator:  #", "            if s.reinit_navigator and step is not None:  #"),
    Mutant("fused reinit keeps the Adam state", PUTM + "engines.py",
           "        self.navigator.redraw(generators)\n        self.adam.reset()", "        self.navigator.redraw(generators)"),
    Mutant("autograd reinit keeps the optimiser", PUTM + "engines.py",
           "        self.navigator.redraw(generators)\n        self.optimiser = self.new_optimiser()",
           "        self.navigator.redraw(generators)"),
    # --- navigator: init_tasks, hidden, slope
    Mutant("init_tasks ignored (1000)", PUTM + "navigator.py", "(fan_in + self.init_tasks)", "(fan_in + 1000)"),
    Mutant("Xavier scale: fan_in <-> fan_out", PUTM + "navigator.py", "math.sqrt(2.0 / (fan_out * (fan_in + self.init_tasks)))",
           "math.sqrt(2.0 / (fan_in * (fan_out + self.init_tasks)))"),
    Mutant("hidden ignored (128, 64)", PUTM + "method.py", "Navigator([x.shape[2], *s.hidden, 1]", "Navigator([x.shape[2], 128, 64, 1]"),
    Mutant("LeakyReLU slope 0.1", PUTM + "settings.py", "negative_slope: float = option(0.01,", "negative_slope: float = option(0.1,"),
    # --- CT loss, rho, theta
    Mutant("fused: rho ignored", PUTM + "engines.py", "s.negative_slope, s.rho, s.theta, self.compute_dtype",
           "s.negative_slope, 0.5, s.theta, self.compute_dtype"),
    Mutant("fused: theta ignored", PUTM + "engines.py", "s.negative_slope, s.rho, s.theta, self.compute_dtype",
           "s.negative_slope, s.rho, 0.0, self.compute_dtype"),
    Mutant("autograd: rho and theta swapped", PUTM + "engines.py", "ct_loss(cost, forward, backward, settings.rho, settings.theta)",
           "ct_loss(cost, forward, backward, settings.theta, settings.rho)"),
    Mutant("ct_loss: backward term summed over classes", PUTM + "loss.py",
           "(1 - rho) * (cost * backward).sum(1).mean(1)", "(1 - rho) * (cost * backward).sum(2).mean(1)"),
    Mutant("ct_loss: theta weights only the balance", PUTM + "loss.py",
           "return theta * balance_loss + (1 - theta) * transport", "return theta * balance_loss + transport"),
    Mutant("ct_loss_gradient: forward weight 1-rho", PUTM + "loss.py", "grad_forward = (transport_seed * rho)",
           "grad_forward = (transport_seed * (1 - rho))"),
    Mutant("ct_loss_gradient: no (1-theta) on transport", PUTM + "loss.py",
           "transport_seed = seed if theta == 0 else seed * (1 - theta)", "transport_seed = seed"),
    Mutant("ct_loss_gradient: balance target 1 not 1/N", PUTM + "loss.py", "(balance - 1.0 / n)", "(balance - 1.0)"),
    Mutant("ct_loss_gradient: backward softmax over classes", PUTM + "loss.py", "backward = torch.softmax(logits, dim=1)",
           "backward = torch.softmax(logits, dim=2)"),
    Mutant("autograd: backward softmax over classes", PUTM + "engines.py", "backward = torch.softmax(logits, dim=1)",
           "backward = torch.softmax(logits, dim=2)"),
    Mutant("autograd: logits not negated", PUTM + "engines.py", "logits = -outputs.float().view(t, q, ways)",
           "logits = outputs.float().view(t, q, ways)"),
    Mutant("step function: logits not negated", PUTM + "step.py", "logits = -(out[:, :, :out_width]",
           "logits = (out[:, :, :out_width]"),
    # --- Adam: lr, betas, bias correction, steps
    Mutant("fused: lr ignored", PUTM + "engines.py", "StackedAdam(navigator.flat, settings.lr, settings.adam_betas)",
           "StackedAdam(navigator.flat, 1e-3, settings.adam_betas)"),
    Mutant("fused: adam_betas ignored", PUTM + "engines.py", "StackedAdam(navigator.flat, settings.lr, settings.adam_betas)",
           "StackedAdam(navigator.flat, settings.lr, (0.5, 0.99))"),
    Mutant("autograd: lr ignored", PUTM + "engines.py", "lr=self.settings.lr", "lr=1e-3"),
    Mutant("autograd: adam_betas ignored", PUTM + "engines.py", "betas=self.settings.adam_betas", "betas=(0.5, 0.99)"),
    Mutant("Adam: no first-moment bias correction", PUTM + "adam.py", "value=-(self.lr / bias_correction1)", "value=-self.lr"),
    Mutant("Adam: second-moment correction not square-rooted", PUTM + "adam.py", "bias_correction2_sqrt = (1 - beta2 ** float(self.steps)) ** 0.5",
           "bias_correction2_sqrt = (1 - beta2 ** float(self.steps))"),
    Mutant("Adam: step count stuck at 1", PUTM + "adam.py", "self.steps += 1", "self.steps = 1"),
    Mutant("Adam: eps 1e-6", PUTM + "adam.py", "ADAM_EPS = 1e-8", "ADAM_EPS = 1e-6"),
    Mutant("Adam: first moment weights swapped", PUTM + "adam.py", "self.exp_avg.lerp_(grad, 1 - beta1)",
           "self.exp_avg.lerp_(grad, beta1)"),
    # --- step counts
    Mutant("fused: inner_steps + 1", PUTM + "engines.py", "        for _ in range(s.inner_steps):", "        for _ in range(s.inner_steps + 1):"),
    Mutant("autograd: inner_steps - 1 (at least 1)", PUTM + "engines.py", "    for _ in range(settings.inner_steps):",
           "    for _ in range(max(1, settings.inner_steps - 1)):"),
    Mutant("em_steps - 1", PUTM + "em.py", "progress(range(s.em_steps))", "progress(range(max(0, s.em_steps - 1)))"),
    Mutant("prediction from the backward navigator", PUTM + "em.py", "part.keep_final(forward, step, results)",
           "part.keep_final(backward, step, results)"),
    # --- early stopping
    Mutant("early stop: < instead of <=", PUTM + "m_step.py", ".amax(dim=(1, 2)) <= tol", ".amax(dim=(1, 2)) < tol"),
    Mutant("early stop: mean instead of max change", PUTM + "m_step.py", ".abs().amax(dim=(1, 2))", ".abs().mean(dim=(1, 2))"),
    Mutant("early stop: EM steps recorded one short", PUTM + "em_routing.py",
           "results.em_steps[self.tasks[done].cpu()] = step + 1", "results.em_steps[self.tasks[done].cpu()] = step"),
    Mutant("early stop ignored", PUTM + "em.py", "settled(part.prototypes, updated, s.early_stop_tol)",
           "settled(part.prototypes, updated, None)"),
    Mutant("early stop (fixed batch): a finished task's rows still count as running", PUTM + "em_routing.py",
           "        done = done & self.live\n", ""),
    Mutant("early stop (fixed batch): final E-step result not kept", PUTM + "em_routing.py",
           "            self.final = done\n", "            self.final = None\n"),
    # --- query order
    Mutant("canonical_query_order ignored (never)", PUTM + "plumbing.py",
           "order = canonical_query_order(tasks.query) if self.settings.canonical_query_order else None", "order = None"),
    Mutant("canonical_query_order ignored (always)", PUTM + "plumbing.py",
           "order = canonical_query_order(tasks.query) if self.settings.canonical_query_order else None",
           "order = canonical_query_order(tasks.query)"),
    Mutant("predictions not put back in input order", PUTM + "plumbing.py", "            forward = unsort_rows(forward, order)\n", ""),
    # --- solver, precision
    Mutant("solver ignored (always fused)", PUTM + "solvers.py",
           "return engine_class(settings.solver).build(", 'return engine_class("fused").build('),
    Mutant("chunks sized (and tasks checked) by the fused engine whatever the solver", PUTM + "plumbing.py",
           "return engine_class(solver)\n", 'return engine_class("fused")\n'),
    Mutant("precision ignored (float32)", PUTM + "method.py",
           "compute_dtype(resolve_precision(s.precision, x.device))", "torch.float32"),
    Mutant("tf32 also on CPU", PUTM + "precision.py", 'if precision == "tf32" and device.type == "cuda"', 'if precision == "tf32"'),
    Mutant("auto: bf16 from compute capability 7.0", PUTM + "precision.py", ">= (8, 0)", ">= (7, 0)"),
    # --- chunks and workers
    Mutant("cpu_workers ignored", PUTM + "workers.py", "return cpu_workers or torch.get_num_threads()",
           "return torch.get_num_threads()"),
    Mutant("workers keep all kernel threads", PUTM + "workers.py", "        torch.set_num_threads(1)\n", ""),
    Mutant("chunk not shared among workers", PUTM + "workers.py", "share = math.ceil((stop - start) / workers)",
           "share = stop - start"),
    Mutant("max_chunk_tasks ignored", PUTM + "plumbing.py", "cap = self.settings.max_chunk_tasks", "cap = None"),
    Mutant("CPU default cap not per worker", PUTM + "plumbing.py", "cap = CPU_MAX_CHUNK_TASKS * self.cpu_workers(device)",
           "cap = CPU_MAX_CHUNK_TASKS"),
    # --- preprocessing (beta, QR, L2)
    Mutant("beta ignored (0.6)", PUTM + "method.py", "power_transform(x, self.settings.beta, self.name)",
           "power_transform(x, 0.6, self.name)"),
    Mutant("power transform eps 1e-3", PRE, "POWER_EPS = 1e-6", "POWER_EPS = 1e-3"),
    Mutant("no L2 normalisation", PUTM + "method.py", "return l2_normalise(coords)", "return coords"),
    Mutant("initial prototypes from all rows' first S", PUTM + "method.py",
           "prototypes = weighted_class_means(x[:, : tasks.num_support], one_hot)",
           "prototypes = weighted_class_means(x[:, -tasks.num_support:], one_hot)"),
    # --- subtler: tasks leaving the batch, engine internals, equivalents
    Mutant("early stop: remaining tasks restart the Adam step count", PUTM + "engines.py",
           "chosen.adam.steps = self.adam.steps", "chosen.adam.steps = 0"),
    Mutant("early stop: remaining tasks lose Adam's first moment", PUTM + "engines.py",
           "        chosen.adam.exp_avg.copy_(select_tasks(self.navigator, self.adam.exp_avg, index))\n", ""),
    Mutant("early stop: autograd optimiser state dropped", PUTM + "engines.py", "            if state:", "            if False:"),
    Mutant("early stop: finished tasks get the wrong generators", PUTM + "em_routing.py",
           "generators = [self.generators[i] for i in index.tolist()]", "generators = self.generators[: len(index)]"),
    Mutant("fused backward: LeakyReLU gradient slope doubled", PUTM + "step.py",
           "leaky_relu_backward.grad_input(grad_below, below, slope, False", "leaky_relu_backward.grad_input(grad_below, below, 2 * slope, False"),
    Mutant("fused backward: bias gradients zero", PUTM + "step.py", "        return torch.sum(grad, 1, keepdim=True, out=out)\n",
           "        return torch.sum(grad, 1, keepdim=True, out=out).zero_()\n"),
    Mutant("compiled backward: LeakyReLU gradient slope doubled", PUTM + "step.py",
           "leaky_relu_backward(grad_below, below, slope, False)", "leaky_relu_backward(grad_below, below, 2 * slope, False)"),
    Mutant("device Adam: second-moment correction not square-rooted", PUTM + "adam.py",
           "bias_correction2_sqrt = (1 - torch.pow(beta2, self.steps)).sqrt()", "bias_correction2_sqrt = 1 - torch.pow(beta2, self.steps)"),
    Mutant("device Adam: step count not advanced", PUTM + "adam.py", "            self.steps.add_(1)\n", ""),
    Mutant("reinit keeps the trained biases", PUTM + "navigator.py", "            b.zero_()", "            pass"),
    Mutant("ct_loss_gradient: forward mean over classes", PUTM + "loss.py", "expand(t, q).div(q)", "expand(t, q).div(n)"),
    Mutant("auto: bf16 only with AVX512-BF16 and AMX", PUTM + "precision.py", "any(check is not None and check() for check in native)",
           "all(check is not None and check() for check in native)"),
    Mutant("no GEMM padding (width-1 GEMV path)", PUTM + "settings.py", "GEMM_MIN_WIDTH = 8", "GEMM_MIN_WIDTH = 1"),
    Mutant("query sort not stable [equivalent?]", PUTM + "query_order.py", "dim=1, stable=True)", "dim=1, stable=False)"),
    Mutant("QR forms Q as well (mode reduced) [equivalent?]", PRE, 'mode="r").R', 'mode="reduced").R'),
    # --- the EM loop on the device (solver=triton), against the host's loop
    Mutant("device loop: no final E-step", PUTM + "triton_engine.py",
           "        forward, _ = self.launch(query, prototypes, cost)  # the final E-step; a settled task keeps its own rows\n",
           "", DEVICE_LOOP_TEST),
    Mutant("device loop: M-step kernel stores zero costs", PUTM + "triton_em.py",
           "tl.store(cost_ptr + pi, tl.sum(difference * difference, axis=1), mask=is_query)",
           "tl.store(cost_ptr + pi, tl.sum(difference * difference, axis=1) * 0.0, mask=is_query)", DEVICE_LOOP_TEST),
    Mutant("device loop: finished tasks run on", PUTM + "triton_em.py", "if tl.load(final_ptr + t) != 0:  # that E-step",
           "if tl.load(final_ptr + t) > 1:  # that E-step", DEVICE_LOOP_TEST),
    Mutant("device loop: EM steps recorded one short", PUTM + "triton_em.py", "tl.store(em_steps_ptr + t, step + 1)",
           "tl.store(em_steps_ptr + t, step)", DEVICE_LOOP_TEST),
]


def copy_repository(target: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for folder in ("lightning_putm", "conf", "tests"):
        shutil.copytree(REPO / folder, target / folder, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", target / "pyproject.toml")


def apply(root: Path, mutant: Mutant) -> str:
    """Writes the mutant into the copy; returns the original text (to restore). Fails loudly if it does not apply."""
    path = root / mutant.file
    original = path.read_text()
    count = original.count(mutant.search)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name!r}: search text found {count} times in {mutant.file}, expected once:\n"
                         f"{mutant.search}")
    path.write_text(original.replace(mutant.search, mutant.replace))
    return original


def run_tests(root: Path, tests: tuple[str, ...] = ()) -> tuple[bool, str]:
    """``(killed, by which test)``: ``tests`` (default: the PUTM test files) in the copy, stopping at the first
    failure."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", *(tests or TEST_FILES)]
    try:
        result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return True, f"timeout after {TIMEOUT_S} s"
    if result.returncode == 0:
        return False, "SURVIVED"
    output = result.stdout + result.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)
    if failed:
        return True, failed[0]
    return True, f"pytest exit {result.returncode}: " + (output.strip().splitlines() or ["?"])[-1][:100]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="run the mutants whose name contains this text (plus sanity)")
    parser.add_argument("--first", type=int, default=1, help="start at mutant number FIRST (1-based; sanity always runs)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    mutants = [m for number, m in enumerate(MUTANTS, 1) if m.name.startswith("sanity")
               or ((args.only is None or args.only in m.name) and number >= args.first)]
    if args.list:
        for mutant in mutants:
            print(f"{mutant.name:55s} {mutant.file}")
        return 0
    rows: list[tuple[str, str, str]] = []
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="mutation_putm_") as folder:
        root = Path(folder)
        copy_repository(root)
        for mutant in mutants:  # check that every mutant applies before spending time on any
            (root / mutant.file).write_text(apply(root, mutant))
        for tests in dict.fromkeys(m.tests for m in mutants):
            killed, by = run_tests(root, tests)
            if killed:
                raise SystemExit(f"the unmutated copy fails its tests ({by}); fix that first")
        for index, mutant in enumerate(mutants, 1):
            original = apply(root, mutant)
            try:
                began = time.time()
                killed, by = run_tests(root, mutant.tests)
            finally:
                (root / mutant.file).write_text(original)
            rows.append((mutant.name, mutant.file.removeprefix("lightning_putm/methods/"), by))
            print(f"[{index}/{len(mutants)}] {time.time() - began:5.1f} s  {mutant.name}: {by}", flush=True)
            if mutant.name.startswith("sanity") and not killed:
                raise SystemExit("the sanity mutant survived: the tests do not import the mutated copy")
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'mutant':{width}s}  {'file':22s}  killed by")
    for name, file, by in rows:
        print(f"{name:{width}s}  {file:22s}  {by}")
    survivors = [name for name, _, by in rows if by == "SURVIVED"]
    print(f"\ntried {len(rows)}, killed {len(rows) - len(survivors)}, surviving {len(survivors)}"
          f" ({time.time() - start:.0f} s)")
    for name in survivors:
        print(f"  SURVIVED: {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
