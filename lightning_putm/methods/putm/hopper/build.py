"""Building the Hopper E-step kernel (``e_step.cu``) for sm_90a with NVRTC, at run time, without a GPU.

Why NVRTC (docs/design.md, "The Hopper kernel"): PyTorch's Linux CUDA wheels already install NVIDIA's runtime
compiler (``nvidia-cuda-nvrtc``) and the CUDA headers (``nvidia-cuda-runtime``), so a user who has a CUDA build of
torch has everything the kernel needs: no ``nvcc``, no host C++ compiler, no ``CUDA_HOME``, nothing to build at
install time (so nothing can break an install on CPU or macOS). The cubin is made on first use in a few seconds and
loaded through the driver API (:mod:`.launch`); ``-Xptxas -v``'s resource report comes back in NVRTC's log. Where
NVRTC cannot be found, :func:`compile_kernel` raises :class:`ToolchainMissing` with one line naming what is missing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import os
import re
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("e_step.cu")
#: The target: Hopper with its architecture-specific features (wgmma, setmaxnreg) available.
ARCH = "sm_90a"


class ToolchainMissing(RuntimeError):
    """NVRTC (or a tool named in the message) is not installed here."""


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ``ptxas -v`` reported for the kernel: registers per thread, spilled bytes (stores), stack frame bytes."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int


@dataclasses.dataclass(frozen=True)
class Build:
    """A compiled kernel: the cubin, the compiler's log, the resource report and the NVRTC version that built it."""

    cubin: bytes
    log: str
    resources: Resources
    nvrtc_version: tuple[int, int]


def _site_dirs() -> list[Path]:
    """Where pip puts NVIDIA's wheels: every ``nvidia`` package folder on ``sys.path``."""
    return [Path(p) / "nvidia" for p in sys.path if p and (Path(p) / "nvidia").is_dir()]


def _nvrtc_candidates() -> list[Path]:
    found: list[Path] = []
    for nvidia in _site_dirs():  # cu13 wheels: nvidia/cu13/lib; cu12 wheels: nvidia/cuda_nvrtc/lib
        for pattern in ("cu1*/lib/libnvrtc.so*", "cuda_nvrtc/lib/libnvrtc.so*"):
            found += sorted(Path(p) for p in glob.glob(str(nvidia / pattern)) if "builtins" not in p)
    for root in filter(None, [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]):
        found += sorted(Path(p) for p in glob.glob(os.path.join(root, "lib*", "libnvrtc.so*")) if "builtins" not in p)
    return found


def include_dirs() -> list[str]:
    """Folders holding ``cuda_bf16.h`` (pip's ``nvidia-cuda-runtime``, or a toolkit's ``include``)."""
    dirs = [str(p.parent) for nvidia in _site_dirs() for p in nvidia.glob("*/include/cuda_bf16.h")]
    for root in filter(None, [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]):
        if Path(root, "include", "cuda_bf16.h").is_file():
            dirs.append(str(Path(root, "include")))
    return dirs


@functools.cache
def nvrtc() -> ctypes.CDLL:
    """NVRTC, loaded with its builtins library (which it opens by name, so that is loaded first, globally)."""
    errors = []
    for path in _nvrtc_candidates():
        try:
            for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
                if ".alt." not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(path))
        except OSError as error:
            errors.append(f"{path}: {error}")
    raise ToolchainMissing("putm hopper kernel: NVRTC (libnvrtc.so) not found; install a CUDA build of torch (it "
                           "brings nvidia-cuda-nvrtc) or the CUDA toolkit" + (f" ({errors[0]})" if errors else ""))


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


@functools.cache
def driver() -> ctypes.CDLL:
    """The CUDA driver's library, which loads the kernel NVRTC builds (:mod:`.launch`)."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise ToolchainMissing(f"putm hopper kernel: the CUDA driver (libcuda.so.1) is not here ({error})")


def driver_version() -> tuple[int, int]:
    """The CUDA version the installed driver supports (``cuDriverGetVersion``: 13000 → (13, 0)). A cubin built by
    a newer NVRTC than this does not load."""
    version = ctypes.c_int()
    if driver().cuDriverGetVersion(ctypes.byref(version)) != 0:
        raise ToolchainMissing("putm hopper kernel: cuDriverGetVersion failed")
    return version.value // 1000, version.value % 1000 // 10


def defines(queries: int, ways: int, dim: int, exact_adam: bool = False, full_unroll: bool = False) -> list[str]:
    """The macros of a build: the task shape, the Adam flavour, the counting build's unrolled passes."""
    flags = [f"-DQ={queries}", f"-DN={ways}", f"-DM={dim}"]
    return flags + (["-DEXACT_ADAM"] if exact_adam else []) + (["-DFULL_UNROLL"] if full_unroll else [])


def compile_kernel(queries: int = 75, ways: int = 5, dim: int = 80, exact_adam: bool = False,
                   full_unroll: bool = False, source: str | None = None) -> Build:
    """The kernel for one task shape, compiled for sm_90a (5-15 s on one CPU core). ``source``: another file's
    text (the tests' mutants); default ``e_step.cu``."""
    text = SOURCE.read_text() if source is None else source
    return compile_source(text, defines(queries, ways, dim, exact_adam, full_unroll))


def compile_source(text: str, options: list[str]) -> Build:
    """CUDA C++ ``text`` compiled by NVRTC for sm_90a with ``options`` (besides the target, C++17, ``-Xptxas -v``
    and the CUDA headers' folder)."""
    lib = nvrtc()
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), text.encode(), b"e_step.cu", 0, None, None), "create")
    options = [f"-arch={ARCH}", "-std=c++17", "-Xptxas=-v", *options] + [f"-I{d}" for d in include_dirs()]
    array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    try:
        result = lib.nvrtcCompileProgram(program, len(options), array)
        log = _text(lib, program, "ProgramLog")
        if result != 0:
            first = next((line for line in log.splitlines() if "error" in line), log.strip()[:200])
            raise RuntimeError(f"putm hopper kernel: NVRTC failed ({first.strip()})\n{log}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(program, cubin), "cubin")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
    return Build(cubin.raw, log, parse_resources(log), nvrtc_version())


def parse_resources(log: str) -> Resources:
    """Registers, spills and stack frame from ``ptxas -v``'s lines in a compiler log."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise ValueError(f"no ptxas -v report in the compiler log:\n{log[-2000:]}")
    return Resources(int(registers.group(1)), int(spills.group(2)), int(spills.group(3)), int(spills.group(1)))


def _text(lib: ctypes.CDLL, program: ctypes.c_void_p, what: str) -> str:
    size = ctypes.c_size_t()
    getattr(lib, f"nvrtcGet{what}Size")(program, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    getattr(lib, f"nvrtcGet{what}")(program, buffer)
    return buffer.value.decode(errors="replace")


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"putm hopper kernel: NVRTC {what} failed: {lib.nvrtcGetErrorString(result).decode()}")


def binary_tool(name: str) -> str | None:
    """``cuobjdump`` or ``nvdisasm``: the one Triton's wheel carries, else a CUDA toolkit's, else ``None``."""
    candidates = []
    try:
        import triton  # noqa: F401  (only its folder is used)

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    for root in filter(None, [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]):
        candidates.append(Path(root) / "bin" / name)
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if folder:
            candidates.append(Path(folder) / name)
    return next((str(p) for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)
