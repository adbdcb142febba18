"""The instruction mix of one Adam step of the Hopper E-step kernel, from its SASS (``cuobjdump --dump-sass``).

Every instruction between the top of the kernel's step loop (its outermost backward branch) and that branch runs
once per Adam step; an instruction inside a loop nested in it runs once per trip. The nested loops are the kernel's
two loops over passes of 128 pairs, in address order: the forward's (every pass: 3 trips at 375 pairs) and the
backward's over the passes after the first (2 trips; the first pass's h1 and h2 come from the forward, in registers),
so each is weighted by its own trip count (:func:`pass_loop_trips`; a loop of one trip is no loop in the SASS). The
CT head's loops over the queries are unrolled by the compiler; the warp-divergence fallbacks (``BRA.DIV`` targets,
after the step loop) are not run by converged warps and not counted. Branches not taken (the balance term when
theta = 0, the bias block of half the warps) are counted as if taken: the count is an upper bound per warp.

    python tools/hopper_sass.py                    # compile (NVRTC, sm_90a, 1-shot shape) and count
    python tools/hopper_sass.py --dim 100          # the 5-shot shape
    python tools/hopper_sass.py kernel.cubin       # count a cubin built elsewhere (its --queries, --ways)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_putm.methods.putm.hopper import build  # noqa: E402

GROUPS = collections.OrderedDict([
    ("tensor (HMMA/HGMMA)", r"^(HMMA|HGMMA|WARPGROUP)"),
    ("ldmatrix/stmatrix", r"^(LDSM|STSM)"), ("other shared ld/st", r"^(LDS|STS)"),
    ("global ld/st", r"^(LDG|STG|LDGSTS)"), ("local (spill) ld/st", r"^(LDL|STL)"),
    ("bf16 convert/pack", r"^(F2FP|F2F)"), ("packed bf16 math", r"^(HFMA2|HMUL2|HADD2|HMNMX2|HSET2|HSETP2)"),
    ("fp32 math", r"^(FFMA|FMUL|FADD|FMNMX|FSEL|FSETP|FCHK)"), ("MUFU", r"^MUFU"),
    ("shuffles", r"^SHFL"), ("barriers", r"^(BAR|DEPBAR)")])
OTHER = "integer/address/control/move"
LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([.A-Z0-9_]*)\s*(.*?)\s*;")


@dataclasses.dataclass
class Mix:
    """Warp instructions per Adam step (each counts once per warp), by group and by opcode."""

    total: int
    groups: dict[str, int]
    opcodes: collections.Counter
    static_instructions: int
    step_loop_span: int
    nested_loops: int

    @property
    def tensor_share(self) -> float:
        return self.groups["tensor (HMMA/HGMMA)"] / self.total

    @property
    def barriers(self) -> int:
        """``BAR`` instructions per warp per Adam step (``DEPBAR`` waits on copies, not on other warps)."""
        return sum(count for op, count in self.opcodes.items() if op.startswith("BAR"))


def dump_sass(cubin: bytes) -> str:
    """``cuobjdump --dump-sass`` of a cubin (Triton's or a toolkit's cuobjdump)."""
    tool = build.binary_tool("cuobjdump")
    if tool is None:
        raise build.ToolchainMissing("cuobjdump not found: it ships in triton's wheel (pip install triton) and in "
                                     "the CUDA toolkit")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([tool, "--dump-sass", file.name], capture_output=True, text=True, check=True).stdout


def pass_loop_trips(queries: int = 75, ways: int = 5) -> list[int]:
    """Trips of the kernel's loops nested in the step loop, in address order: the forward's over every pass of 128
    pairs, the backward's over the passes after the first; a loop of one trip (or none) is not a loop in the SASS."""
    passes = -(-queries * ways // 128)
    return [trips for trips in (passes, passes - 1) if trips > 1]


def instruction_mix(sass: str, trips: Sequence[int] | int = (3, 2)) -> Mix:
    """Per-Adam-step counts of a kernel's SASS: the outermost loop is the step loop; the loops nested in it weigh
    ``trips`` (one count per loop in address order, or one count for all); a different number of nested loops than
    counts means the kernel's structure changed and raises ValueError."""
    instructions: list[tuple[int, str, str, str]] = []
    for line in sass.splitlines():
        match = LINE.match(line)
        if match:
            instructions.append((int(match.group(1), 16), match.group(3), match.group(3) + match.group(4),
                                 match.group(5)))
    index = {address: i for i, (address, *_) in enumerate(instructions)}
    loops = []
    for i, (_, op, _, args) in enumerate(instructions):
        target = re.match(r"`?\(?\.?L?_?x?_?(0x[0-9a-f]+)", args.strip())
        if op == "BRA" and target and int(target.group(1), 16) in index and index[int(target.group(1), 16)] <= i:
            loops.append((index[int(target.group(1), 16)], i))
    if not loops:
        raise ValueError("no loop in the SASS: not the E-step kernel?")
    loops.sort(key=lambda loop: loop[0] - loop[1])  # the longest first: the step loop
    start, end = loops[0]
    weights = [0] * len(instructions)
    for k in range(start, end + 1):
        weights[k] = 1
    nested = sorted((lo, hi) for lo, hi in loops[1:] if lo >= start and hi <= end)
    counts = [trips] * len(nested) if isinstance(trips, int) else list(trips)
    if len(counts) != len(nested):
        raise ValueError(f"{len(nested)} loops nested in the step loop, {len(counts)} trip counts given: the kernel's "
                         "loop structure is not the one this count models (see pass_loop_trips)")
    for (lo, hi), count in zip(nested, counts):
        for k in range(lo, hi + 1):
            weights[k] *= count
    groups = {name: 0 for name in [*GROUPS, OTHER]}
    opcodes: collections.Counter = collections.Counter()
    for weight, (_, op, full, _) in zip(weights, instructions):
        if weight:
            group = next((name for name, pattern in GROUPS.items() if re.match(pattern, op)), OTHER)
            groups[group] += weight
            opcodes[full] += weight
    return Mix(sum(groups.values()), groups, opcodes, len(instructions), end - start + 1, len(nested))


def report(mix: Mix, warps: int = 8) -> str:
    lines = [f"static instructions {mix.static_instructions}; step loop spans {mix.step_loop_span}, "
             f"{mix.nested_loops} nested loops",
             f"warp instructions per Adam step: {mix.total} per warp, {mix.total * warps} per block of {warps} warps",
             f"barriers per warp per step: {mix.barriers}; tensor-core share: {mix.tensor_share:.1%}"]
    lines += [f"  {name:32s} {count:7d}  {count / mix.total:6.1%}" for name, count in mix.groups.items()]
    lines.append("top opcodes: " + ", ".join(f"{op} {n}" for op, n in mix.opcodes.most_common(12)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cubin", nargs="?", help="a cubin to count (default: compile e_step.cu with NVRTC)")
    parser.add_argument("--queries", type=int, default=75)
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--dim", type=int, default=80, help="basis width m (80: 1 shot, 100: 5 shots)")
    parser.add_argument("--exact-adam", action="store_true")
    parser.add_argument("--trips", type=int, nargs="+", default=None,
                        help="trips of each loop nested in the step loop (default: pass_loop_trips of the shape)")
    args = parser.parse_args(argv)
    if args.cubin:
        cubin = Path(args.cubin).read_bytes()
    else:
        made = build.compile_kernel(args.queries, args.ways, args.dim, exact_adam=args.exact_adam)
        r = made.resources
        print(f"NVRTC {made.nvrtc_version[0]}.{made.nvrtc_version[1]}, {build.ARCH}: {r.registers} registers, "
              f"{r.spill_stores} B spill stores, {r.spill_loads} B spill loads, {r.stack_frame} B stack frame; "
              f"shared memory {shared_bytes(args.queries, args.ways, args.dim):,} B")
        cubin = made.cubin
    print(report(instruction_mix(dump_sass(cubin), args.trips or pass_loop_trips(args.queries, args.ways))))
    return 0


def shared_bytes(queries: int, ways: int, dim: int) -> int:
    from lightning_putm.methods.putm.hopper.layout import Layout

    return Layout(queries, ways, dim).shared_bytes


if __name__ == "__main__":
    raise SystemExit(main())
