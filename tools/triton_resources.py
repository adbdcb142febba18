"""What the fused E-step kernel of ``solver=triton`` needs on an H100 (sm_90), measured by compiling it here: no GPU.

A development tool, not part of the package: ``triton.compile`` builds the kernel (``lightning_putm/methods/putm/
triton_wide.py``) for a ``GPUTarget("cuda", 90, 32)`` and ``ptxas -v`` (shipped in the triton wheel) reports its
registers, spills and stack; Triton's metadata gives the shared memory it asks for at launch. A check that a launch
configuration (PUTMSettings' ``triton_warps``, ``triton_stages``) will launch.

:func:`sm90_instruction_estimate` goes one step further without a GPU: it counts the warp instructions one Adam
step executes, from the sm_90 machine code (``nvdisasm``, also in the wheel) weighted by how often each loop runs.
It came within 2% of what Nsight Compute counted on an H100 for the kernel's first design and within 1.2% for this
one (docs/lab/gpu-kernel.md), so two configurations can be compared before a GPU is at hand; time per instruction
it cannot tell.

    python tools/triton_resources.py              # the sm_90 table of docs/lab/gpu-kernel.md
    python tools/triton_resources.py --breakdown  # where one Adam step's instructions go
"""

from __future__ import annotations

import ast
import collections
import inspect
import re
import subprocess
import tempfile
from pathlib import Path


def shipped_tool(name: str) -> str | None:
    """``ptxas``/``cuobjdump`` from the triton wheel (``triton/backends/nvidia/bin``), else from PATH."""
    import shutil

    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.is_file() else shutil.which(name)


def compile_sm90(queries: int = 75, ways: int = 5, m: int = 80, hidden: tuple[int, int] = (128, 64),
                 precision: int = 2, balance: bool = False, tasks: int = 100, num_warps: int | None = None,
                 num_stages: int | None = None):
    """The kernel compiled for an H100 (``GPUTarget("cuda", 90, 32)``) exactly as the engine would launch it for
    ``tasks`` tasks: ``(compiled, constants)``. ``precision``: 0 fp32, 1 TF32, 2 bf16 (``triton_ops``);
    ``num_warps``, ``num_stages``: the settings' ``triton_warps``, ``triton_stages`` (``None``: their defaults).

    The arguments are the engine's own (``TritonEngine.kernel_arguments``, on CPU tensors), and Triton's launcher
    decides how they specialize the build, as on the GPU: pointers aligned to 16 bytes and integers divisible by 16
    let it vectorize loads and stores. (A build without that specialization, this function's at first, loads one
    element per instruction: 4x the global loads and stores of what ran.)"""
    import torch

    from lightning_putm.methods.putm import triton_ops
    from lightning_putm.methods.putm.navigator import Navigator
    from lightning_putm.methods.putm.settings import PUTMSettings
    from lightning_putm.methods.putm.triton_engine import TritonEngine, e_step_kernel

    if triton_ops.INTERPRETED:
        raise RuntimeError("the kernels were built for the interpreter (TRITON_INTERPRET=1): unset it")
    launch = {key: value for key, value in (("triton_warps", num_warps), ("triton_stages", num_stages))
              if value is not None}
    settings = PUTMSettings(hidden=list(hidden), theta=0.3 if balance else 0.0, **launch)
    generators = [torch.Generator().manual_seed(task) for task in range(tasks)]
    navigator = Navigator([m, *hidden, 1], generators, 1000, torch.device("cpu"), torch.float32,
                          settings.negative_slope, requires_grad=False)
    engine = TritonEngine(navigator, settings, torch.bfloat16 if precision == 2 else torch.float32)
    arguments, constants, _ = engine.kernel_arguments(
        torch.zeros(tasks, queries, m), torch.zeros(tasks, ways, m), torch.zeros(tasks, queries, ways))
    constants["PRECISION"] = precision  # TF32 (1) is chosen on CUDA devices only
    return _build_sm90(e_step_kernel(), arguments, dict(constants, **engine.launch_options())), constants


def compile_m_step_sm90(queries: int = 75, ways: int = 5, shots: int = 1, m: int = 80, tasks: int = 100):
    """The M-step kernel of the EM loop on the device (:func:`.triton_em.m_step_kernel`) compiled for an H100 as
    :func:`.triton_em.launch_m_step` launches it (arguments on CPU tensors, specialized like
    :func:`compile_sm90`'s)."""
    import torch

    from lightning_putm.methods.putm import triton_em, triton_ops

    if triton_ops.INTERPRETED:
        raise RuntimeError("the kernels were built for the interpreter (TRITON_INTERPRET=1): unset it")
    support = ways * shots
    arguments, launch = triton_em.m_step_launch(
        torch.zeros(tasks, support + queries, m), torch.zeros(tasks, support, ways),
        torch.zeros(tasks, queries, ways), torch.zeros(tasks, queries, ways), torch.zeros(tasks, ways, m),
        torch.zeros(tasks, queries, ways), torch.ones(tasks, dtype=torch.int8), torch.zeros(tasks, dtype=torch.int8),
        torch.zeros(tasks, dtype=torch.int32), 3, 0.2, 0.5, 1e-3, "forward")
    return _build_sm90(triton_em.m_step_kernel, arguments, launch)


def _build_sm90(function, arguments: list[object], launch: dict[str, object]):
    """``function`` compiled for sm_90 with the specialization Triton's launcher gives ``arguments`` and
    ``launch`` (constants and options) on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    bound, specialization, options = create_function_from_signature(function.signature, function.params,
                                                                    backend)(*arguments, **launch)
    options, signature, constexprs, attrs = function._pack_args(backend, launch, bound, specialization, options)
    return triton.compile(ASTSource(function, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options.__dict__)


def sm90_resources(queries: int = 75, ways: int = 5, m: int = 80, hidden: tuple[int, int] = (128, 64),
                   precision: int = 2, balance: bool = False, ptxas: str | None = None, num_warps: int | None = None,
                   num_stages: int | None = None) -> dict[str, int]:
    """Registers per thread, spill bytes, stack bytes and shared memory of one kernel configuration on sm_90
    (arguments of :func:`compile_sm90`). Raises ``RuntimeError`` without ptxas."""
    compiled, _ = compile_sm90(queries, ways, m, hidden, precision, balance, num_warps=num_warps,
                               num_stages=num_stages)
    return ptxas_usage(compiled, ptxas)


def ptxas_usage(compiled, ptxas: str | None = None) -> dict[str, int]:
    """Registers per thread, spill bytes, stack bytes and shared memory of a kernel compiled for sm_90 (``ptxas
    -v`` on its PTX). Raises ``RuntimeError`` without ptxas."""
    ptxas = ptxas or shipped_tool("ptxas")
    if ptxas is None:
        raise RuntimeError("no ptxas (neither in the triton wheel nor on PATH)")
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(folder) / "kernel.cubin")],
                                capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads"), "stack_bytes": number(r"(\d+) bytes stack frame"),
            "shared_bytes": int(compiled.metadata.shared)}


#: Opcode groups of the instruction estimate (the grouping of docs/gpu.md's Nsight Compute table).
OPCODE_GROUPS = {
    "fp32": ("FMUL", "FADD", "FFMA", "FSETP", "MUFU", "FCHK", "FMNMX", "FSEL", "FRND"),
    "shared memory": ("LDS", "STS", "LDSM", "STSM"),
    "bf16 conversion": ("F2FP", "F2F", "PRMT", "HSETP2", "HMUL2"),
    "barriers": ("BAR",),
    "global memory": ("LDG", "STG", "LDL", "STL"),
    "tensor core": ("HMMA", "HGMMA", "WARPGROUP"),
    "shuffles": ("SHFL",),
}
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")


def _loops(function, sizes: dict[str, int]) -> list[tuple[int, int, int | str]]:
    """The kernel's ``for`` loops as ``(first line, last line, trip count)`` in its file; ``"step"`` for the loop
    over Adam steps, ``"task"`` for the loop over tasks (both counted once: the estimate is per step and task)."""
    lines, first = inspect.getsourcelines(function.fn)
    loops: list[tuple[int, int, int | str]] = []
    for node in ast.walk(ast.parse("".join(lines))):
        if isinstance(node, ast.For):
            bounds = [ast.unparse(argument) for argument in node.iter.args]  # type: ignore[attr-defined]
            if bounds == ["inner_steps"]:
                trips: int | str = "step"
            elif "num_tasks" in bounds:
                trips = "task"
            else:
                trips = len(range(*[eval(bound, {}, dict(sizes)) for bound in bounds]))  # noqa: S307 (constants)
            loops.append((node.lineno + first - 1, node.end_lineno + first - 1, trips))  # type: ignore[operator]
    return loops


def count_adam_step(sass: str, loops: list[tuple[int, int, int | str]],
                    kernel: tuple[str, int, int]) -> collections.Counter:
    """Warp instructions per Adam step of one task, by opcode (:func:`count_adam_step_lines` summed over lines)."""
    return _by_opcode(count_adam_step_lines(sass, loops, kernel))


def _by_opcode(by_line: collections.Counter) -> collections.Counter:
    """``{(opcode, line): n}`` summed over the lines."""
    counts: collections.Counter = collections.Counter()
    for (opcode, _), n in by_line.items():
        counts[opcode] += n
    return counts


def count_adam_step_lines(sass: str, loops: list[tuple[int, int, int | str]],
                          kernel: tuple[str, int, int]) -> collections.Counter:
    """Warp instructions per Adam step of one task, by ``(opcode, kernel source line)`` (line 0: none of the
    kernel function's own lines), from ``nvdisasm -gi`` output of the kernel.

    Every backward branch closes a machine-code loop; from the innermost out, each is matched to the innermost
    source loop not matched yet that holds at least 60% of its instructions attributed to the kernel function's
    own lines, ``kernel`` = (file, first line, last line). (By their outermost source line: triton 3.8 records
    where a helper was inlined, triton 3.6 only the helper's line, which then does not vote.) Its instructions are
    multiplied by that loop's trip count; the instructions that call a slow-path subroutine (a correctly rounded
    square root's or division's, for inputs out of its fast path's range, which Adam's values rarely reach: a zero
    second moment does) count zero. A loop the compiler unrolled has no backward branch, so its copies are counted
    once each, as they run.
    Instructions outside the Adam-step loop (once per E-step) are left out. Raises ``RuntimeError`` when no
    machine-code loop holding most of the kernel matched the Adam-step loop, or when a machine-code loop inside it
    matched none (its instructions would be counted once, not once per pass)."""
    instructions: list[tuple[str, str, int]] = []
    labels: dict[str, int] = {}
    line = 0
    for raw in sass.splitlines():
        text = raw.strip()
        if text.startswith("//##"):
            locations = re.findall(r'"([^"]+)", line (\d+)', text)
            if locations:  # the outermost: where the kernel itself is, when a helper was inlined
                path, number = locations[-1]
                # by the path's tail: a kernel cached by triton from another checkout names that checkout's file
                inside = Path(path).parts[-4:] == Path(kernel[0]).parts[-4:] and kernel[1] <= int(number) <= kernel[2]
                line = int(number) if inside else 0
            continue
        label = re.match(r"^(\.L_x_\d+):", text)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = _INSTRUCTION.match(raw)
        if found:
            instructions.append((found.group(1).split(".")[0], found.group(2), line))
    closing = []  # machine-code loops as (first, last) instruction
    for end, (opcode, operands, _) in enumerate(instructions):
        target = re.search(r"\.L_x_\d+", operands) if opcode == "BRA" else None
        if target is not None and labels[target.group(0)] <= end:
            closing.append((labels[target.group(0)], end))
    weight = [1] * len(instructions)
    in_step = [False] * len(instructions)
    starts = sorted(labels.values())
    for at, (opcode, operands, _) in enumerate(instructions):
        if opcode == "CALL" and "slowpath" in operands:  # a correctly rounded sqrt's or division's rare case: the
            first = max((k for k in range(at) if instructions[k][0] == "BRA"), default=at - 1) + 1  # branch skips it
            last = min([k for k in starts if k > at] + [len(instructions)]) - 1  # up to the fast path's label
            for k in range(first, last + 1):
                weight[k] = 0
    matched: set[tuple[int, int, int | str]] = set()
    unmatched = []
    for start, end in sorted(closing, key=lambda loop: loop[1] - loop[0]):  # inner loops first
        body = collections.Counter(instructions[k][2] for k in range(start, end + 1))
        voters = sum(n for at, n in body.items() if at)
        inside = [loop for loop in loops if voters and loop not in matched
                  and sum(n for at, n in body.items() if loop[0] <= at <= loop[1]) >= 0.6 * voters]
        if not inside:
            unmatched.append((start, end))
            continue
        loop = min(inside, key=lambda loop: loop[1] - loop[0])
        matched.add(loop)
        for k in range(start, end + 1):
            if loop[2] == "step":
                in_step[k] = True
            elif loop[2] != "task":
                weight[k] *= int(loop[2])
    if sum(in_step) < 0.5 * len(instructions):  # the Adam-step loop is most of the kernel: a mismatch
        raise RuntimeError(f"could not find the loop over Adam steps in the machine code ({sum(in_step)} of "
                           f"{len(instructions)} instructions matched it): this triton's line tables may not say "
                           "where helpers were inlined (triton 3.6 does not; 3.8 does)")
    lost = [(a, b) for a, b in unmatched if all(in_step[a:b + 1])]  # a loop inside the step loop, counted once
    if lost:
        raise RuntimeError(f"could not match {len(lost)} machine-code loop(s) inside the Adam-step loop to the "
                           "kernel's source loops: their instructions would be counted once per step (this "
                           "triton's line tables may not say where helpers were inlined; triton 3.8's do)")
    counts: collections.Counter = collections.Counter()
    for k, (opcode, _, line) in enumerate(instructions):
        if in_step[k] and weight[k]:
            counts[(opcode, line)] += weight[k]
    return counts


def sm90_instruction_estimate(queries: int = 75, ways: int = 5, m: int = 80, hidden: tuple[int, int] = (128, 64),
                              precision: int = 2, num_warps: int | None = None, num_stages: int | None = None,
                              nvdisasm: str | None = None) -> dict[str, int]:
    """Warp instructions that one Adam step of one task executes on sm_90, estimated from the machine code
    (:func:`count_adam_step`): ``total`` (all warps of the program), ``per warp``, and per warp by
    :data:`OPCODE_GROUPS` (the rest: ``integer and control``). Raises ``RuntimeError`` without nvdisasm."""
    by_line, _, warps = _adam_step_lines(queries, ways, m, hidden, precision, num_warps, num_stages, nvdisasm)
    counts = _by_opcode(by_line)
    per_warp = sum(counts.values())
    out = {"total": per_warp * warps, "per warp": per_warp}
    grouped = set()
    for group, opcodes in OPCODE_GROUPS.items():
        out[group] = sum(counts[opcode] for opcode in opcodes)
        grouped.update(opcodes)
    out["integer and control"] = sum(n for opcode, n in counts.items() if opcode not in grouped)
    return out


def _adam_step_lines(queries: int, ways: int, m: int, hidden: tuple[int, int], precision: int,
                     num_warps: int | None, num_stages: int | None,
                     nvdisasm: str | None) -> tuple[collections.Counter, dict[int, str], int]:
    """:func:`count_adam_step_lines` of one configuration compiled for sm_90, the text of the kernel file's lines
    by number, and the warps per program it was built for."""
    nvdisasm = nvdisasm or shipped_tool("nvdisasm")
    if nvdisasm is None:
        raise RuntimeError("no nvdisasm (neither in the triton wheel nor on PATH)")
    compiled, constants = compile_sm90(queries, ways, m, hidden, precision, num_warps=num_warps,
                                       num_stages=num_stages)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-gi", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    from lightning_putm.methods.putm.triton_engine import e_step_kernel

    function = e_step_kernel()
    sizes = {name: value for name, value in constants.items() if isinstance(value, int)} | {"P": queries * ways}
    lines, first = inspect.getsourcelines(function.fn)
    source = inspect.getsourcefile(function.fn)
    counts = count_adam_step_lines(sass, _loops(function, sizes), (source, first, first + len(lines) - 1))
    return counts, dict(enumerate(Path(source).read_text().splitlines(), start=1)), compiled.metadata.num_warps


def sm90_instruction_breakdown(queries: int = 75, ways: int = 5, m: int = 80, hidden: tuple[int, int] = (128, 64),
                               precision: int = 2, num_warps: int | None = None, num_stages: int | None = None,
                               nvdisasm: str | None = None) -> list[dict[str, object]]:
    """Where the warp instructions of one Adam step go: one row per statement of the kernel function (the source
    line a machine instruction comes from, or the call it was inlined into), most instructions first, with
    ``line``, ``code`` (the line's text), ``per warp`` and ``per warp`` by :data:`OPCODE_GROUPS` (the rest:
    ``integer and control``). Arguments as :func:`sm90_instruction_estimate`'s; its ``per warp`` is the sum."""
    by_line, text, _ = _adam_step_lines(queries, ways, m, hidden, precision, num_warps, num_stages, nvdisasm)
    group_of = {opcode: group for group, opcodes in OPCODE_GROUPS.items() for opcode in opcodes}
    rows: dict[int, dict[str, object]] = {}
    for (opcode, line), n in by_line.items():
        row = rows.setdefault(line, {"line": line, "code": text.get(line, "").strip() if line else "(elsewhere)",
                                     "per warp": 0, **{group: 0 for group in [*OPCODE_GROUPS, "integer and control"]}})
        row["per warp"] += n  # type: ignore[operator]
        row[group_of.get(opcode, "integer and control")] += n  # type: ignore[operator]
    return sorted(rows.values(), key=lambda row: -row["per warp"])  # type: ignore[operator]


#: The configurations of the table: (shots, m, precision, warps, pipeline stages); the first row is the default
#: (8 warps, 3 stages), then the launch settings around it that the H100 sweeps timed or left open, the 5-shot shape
#: and fp32 (docs/lab/gpu-kernel.md).
TABLE = [(1, 80, 2, 8, 3), (1, 80, 2, 8, 1), (1, 80, 2, 8, 2), (1, 80, 2, 8, 4), (1, 80, 2, 4, 1), (1, 80, 2, 4, 3),
         (1, 80, 2, 4, 4), (1, 80, 2, 16, 3), (5, 100, 2, 8, 3), (1, 80, 0, 8, 3)]


def main() -> None:
    """Print, for each configuration of :data:`TABLE`, its sm_90 resources and the estimated warp instructions of
    one Adam step of one task (all warps; per warp: barriers, tensor-core instructions)."""
    from lightning_putm.methods.putm.triton_engine import pair_tile

    print("| shots | m | precision | BLOCK_P | warps | stages | registers | spill stores (B) | shared (KB) "
          "| instructions per Adam step | barriers per warp | tensor-core per warp |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for shots, m, precision, warps, stages in TABLE:
        options = dict(m=m, precision=precision, num_warps=warps, num_stages=stages)
        usage = sm90_resources(**options)  # type: ignore[arg-type]
        try:
            estimate: dict[str, int | str] = dict(sm90_instruction_estimate(**options))  # type: ignore[arg-type]
        except RuntimeError:  # loops not matched (see count_adam_step): no estimate rather than a wrong one
            estimate = {"total": "—", "barriers": "—", "tensor core": "—"}
        print(f"| {shots} | {m} | {'bf16' if precision == 2 else 'fp32'} | {pair_tile(precision)} | {warps} | "
              f"{stages} | {usage['registers']} | {usage['spill_store_bytes']} | "
              f"{usage['shared_bytes'] / 1024:.0f} | {_thousands(estimate['total'])} | "
              f"{_thousands(estimate['barriers'])} | {_thousands(estimate['tensor core'])} |", flush=True)


def _thousands(value: int | str) -> str:
    return f"{value:,}" if isinstance(value, int) else value


def print_breakdown(rows: int = 12) -> None:
    """The default configuration's :func:`sm90_instruction_breakdown` as a markdown table (the ``rows`` largest)."""
    breakdown = sm90_instruction_breakdown()
    total = sum(row["per warp"] for row in breakdown)  # type: ignore[misc]
    groups = [*OPCODE_GROUPS, "integer and control"]
    print(f"| kernel line | statement | per warp | share | {' | '.join(groups)} |")
    print("|---" * (4 + len(groups)) + "|")
    for row in breakdown[:rows]:
        code = str(row["code"])
        code = code if len(code) <= 60 else code[:57] + "..."
        print(f"| {row['line']} | `{code}` | {row['per warp']:,} | {row['per warp'] / total:.1%} | "  # type: ignore[operator]
              + " | ".join(f"{row[group]:,}" for group in groups) + " |")
    print(f"| | all | {total:,} | 100% | "
          + " | ".join(f"{sum(row[group] for row in breakdown):,}" for group in groups) + " |")  # type: ignore[misc]


if __name__ == "__main__":
    import sys

    print_breakdown() if sys.argv[1:] == ["--breakdown"] else main()
