"""What the fused E-step kernel needs on an H100 (sm_90), measured by compiling it here: no GPU needed.

``triton.compile`` builds the kernel for a ``GPUTarget("cuda", 90, 32)`` and ``ptxas -v`` (shipped in the triton
wheel) reports its registers, spills and stack; Triton's metadata gives the shared memory it asks for at launch.
Not part of the paper: a check that a kernel configuration (:class:`.triton_engine.KernelConfig`) will launch.

    python -m lightning_putm.methods.putm.triton_resources          # the table of docs/gpu.md
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

POINTERS = ("query_ptr", "proto_ptr", "cost_ptr", "params_ptr", "exp_avg_ptr", "exp_avg_sq_ptr", "active_ptr",
            "schedule_ptr", "forward_ptr", "backward_ptr", "h1_ptr", "h2_ptr", "logit_ptr", "gout_ptr", "dw2_ptr")
INTEGERS = ("num_tasks", "inner_steps", "step0", "off_w2", "off_w3", "off_b1", "off_b2", "off_b3")
FLOATS = ("slope", "rho", "theta", "weight1", "beta2", "one_minus_beta2", "eps")


def shipped_tool(name: str) -> str | None:
    """``ptxas``/``cuobjdump`` from the triton wheel (``triton/backends/nvidia/bin``), else from PATH."""
    import shutil

    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.is_file() else shutil.which(name)


def sm90_resources(queries: int = 75, ways: int = 5, m: int = 80, hidden: tuple[int, int] = (128, 64),
                   block_p: int = 32, block_k: int = 16, num_warps: int = 8, precision: int = 2,
                   balance: bool = False, ptxas: str | None = None) -> dict[str, int]:
    """Registers per thread, spill bytes, stack bytes and shared memory of one kernel configuration on sm_90.

    ``precision``: 0 fp32, 1 TF32, 2 bf16 (:mod:`.triton_kernels`). Raises ``RuntimeError`` without ptxas.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lightning_putm.methods.putm import triton_kernels
    from lightning_putm.methods.putm.triton_engine import power_of_two

    ptxas = ptxas or shipped_tool("ptxas")
    if ptxas is None:
        raise RuntimeError("no ptxas (neither in the triton wheel nor on PATH)")
    if triton_kernels.INTERPRETED:
        raise RuntimeError("the kernels were built for the interpreter (TRITON_INTERPRET=1): unset it")
    pairs = queries * ways
    scratch = "*bf16" if precision == 2 else "*fp32"
    signature = {name: "*fp32" for name in POINTERS} | {"active_ptr": "*i8", "h1_ptr": scratch, "h2_ptr": scratch}
    signature |= {name: "i32" for name in INTEGERS} | {name: "fp32" for name in FLOATS}
    constants = dict(Q=queries, N=ways, M=m, H1=hidden[0], H2=hidden[1], W3S=8, Q_PAD=power_of_two(queries),
                     N_PAD=power_of_two(ways), P_PAD=-(-pairs // block_p) * block_p, BLOCK_P=block_p,
                     BLOCK_K=block_k, PRECISION=precision, INTERPRET=False, LERP_FROM_END=True, BALANCE=balance)
    signature |= {name: "constexpr" for name in constants}
    compiled = triton.compile(ASTSource(triton_kernels.e_step_kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))
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


def main() -> None:
    """Print the resources of the default configuration and its neighbours (1- and 5-shot, bf16 and fp32)."""
    print("| shots | m | precision | BLOCK_P | BLOCK_K | warps | registers | spill stores (B) | stack (B) "
          "| shared (KB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shots, m in ((1, 80), (5, 100)):
        for precision, label in ((2, "bf16"), (0, "fp32")):
            for block_p, block_k, warps in ((32, 16, 8), (16, 16, 8), (64, 16, 8), (32, 32, 8), (32, 16, 4)):
                usage = sm90_resources(m=m, block_p=block_p, block_k=block_k, num_warps=warps, precision=precision)
                print(f"| {shots} | {m} | {label} | {block_p} | {block_k} | {warps} | {usage['registers']} | "
                      f"{usage['spill_store_bytes']} | {usage['stack_bytes']} | {usage['shared_bytes'] / 1024:.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
