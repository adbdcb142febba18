"""``solver=hopper`` as a ``putm.solver`` on a machine without a GPU: where it is refused (one line naming
``method.putm.solver=hopper`` and the fix, before any work), that ``auto`` never picks it, the device memory its
engine asks for, and ``PUTM(engine=...)``, by which the tests run the kernel's CPU emulation through the method.

A CUDA device and its compute capability are simulated by monkeypatching ``torch.cuda`` (as tests/test_putm_triton.py
does); NVRTC is the real one where it is installed (torch's CUDA wheels) and simulated missing otherwise. The
kernel's numerics and its end-to-end agreement with ``fused`` are tests/test_putm_hopper.py's.
"""

from __future__ import annotations

import pytest
import torch

from helpers.tasks import clustered_tasks
from lightning_putm.errors import ConfigError
from lightning_putm.methods.putm import PUTM, PUTMSettings
from lightning_putm.methods.putm.hopper import build
from lightning_putm.methods.putm.hopper.emulate import EmulatedEngine
from lightning_putm.methods.putm.hopper.launch import HopperEngine
from lightning_putm.methods.putm.solvers import resolve_solver

KEY = r"^method\.putm\.solver=hopper "


def nvrtc_here() -> bool:
    try:
        build.nvrtc()
    except build.ToolchainMissing:
        return False
    return True


@pytest.fixture
def gpu(monkeypatch):
    """A simulated CUDA device whose compute capability the test sets (``gpu(9, 0)``), with a driver that supports
    the CUDA version ``driver`` (default: the installed NVRTC's, or 13.0 where there is none)."""
    def simulate(major: int, minor: int, driver: tuple[int, int] | None = None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        supported = driver or (build.nvrtc_version() if nvrtc_here() else (13, 0))
        monkeypatch.setattr(build, "driver_version", lambda: supported)
    return simulate


def refusal(**options) -> str:
    """The one-line ConfigError of building PUTM with ``solver=hopper`` and ``options`` (1 shot, Dirichlet)."""
    with pytest.raises(ConfigError) as error:
        PUTM(shots=1, balanced=False, solver="hopper", **options)
    message = str(error.value)
    assert "\n" not in message and "solver=auto" in message, message
    return message


# ------------------------------------------------------------------------------------------ refused before any work
def test_without_a_cuda_device_hopper_is_refused_when_the_config_is_checked(monkeypatch):
    """No CUDA device: the config check evaluate.py runs before torch loads any feature file or a run folder exists
    (``check_methods_options``) refuses ``solver=hopper`` with one line, and so does the constructor; on a CUDA
    machine, tasks on the CPU are refused by the solver's resolution. Kills: no check (an error deep in ctypes at
    the first launch), a check only at the first E-step, a message that does not name the key or the fix."""
    from lightning_putm.evaluation.settings import check_methods_options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=KEY + r"needs an H100/H200 GPU .*no CUDA device"):
        check_methods_options(["putm"], {"putm": {"solver": "hopper"}}, [1], [False])
    assert "no CUDA device" in refusal()
    with pytest.raises(ConfigError, match=KEY + r"needs .*this run is on cpu"):
        resolve_solver("hopper", torch.device("cpu"))


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_a_gpu_other_than_sm90_is_refused_naming_its_capability(gpu, capability):
    """The kernel is built for sm_90a only: an A100, L40, B200 or RTX 50 is refused with its capability named, at
    construction. Kills: any CUDA device accepted, a check of "at least sm_90" (sm_90a code does not run on sm_100
    or sm_120)."""
    gpu(*capability)
    assert f"this GPU is sm_{capability[0]}{capability[1]}" in refusal()


def test_an_sm90_gpu_without_nvrtc_is_refused_naming_nvrtc(gpu, monkeypatch):
    """An H100 with a torch that has no NVRTC (a build without the CUDA wheels' nvidia-cuda-nvrtc): one line naming
    NVRTC and how to get it. Kills: the NVRTC check left to the first E-step (a traceback after the features were
    loaded and a run started)."""
    gpu(9, 0)
    build.nvrtc.cache_clear()
    monkeypatch.setattr(build, "_nvrtc_candidates", lambda: [])
    try:
        message = refusal()
    finally:
        build.nvrtc.cache_clear()
    assert "NVRTC" in message and "CUDA build of torch" in message and "putm hopper kernel" not in message


def test_an_sm90_gpu_with_nvrtc_is_accepted(gpu):
    """The positive control of the refusals above: on an sm_90 device with NVRTC, ``solver=hopper`` builds, and
    the chunk planner sizes its chunks with the Hopper engine's estimate. Kills: hopper refused everywhere, a
    planner that sizes hopper's chunks by another engine."""
    if not nvrtc_here():
        pytest.skip("NVRTC is not installed here (it ships with torch's CUDA wheels)")
    gpu(9, 0)
    method = PUTM(shots=1, balanced=False, solver="hopper")
    assert method.engine_type(torch.device("cuda")) is HopperEngine


def test_a_driver_older_than_nvrtc_is_refused_naming_both_versions(gpu):
    """A cubin built by NVRTC 13.0 does not load on a driver that supports CUDA 12.8 at most (torch's CUDA 13
    wheels on an R570 driver): refused when the options are checked, naming both versions and the fixes; a
    driver exactly as new as NVRTC is accepted (the control). Kills: no version check (an error from the driver's
    module loader at the first E-step), a check that compares the wrong way round, one that refuses equal
    versions."""
    if not nvrtc_here():
        pytest.skip("NVRTC is not installed here (it ships with torch's CUDA wheels)")
    major, minor = build.nvrtc_version()
    older = (major - 1, 8) if minor == 0 else (major, minor - 1)
    gpu(9, 0, driver=older)
    message = refusal()
    assert f"NVRTC {major}.{minor}" in message and f"CUDA {older[0]}.{older[1]}" in message, message
    assert "update the driver" in message
    gpu(9, 0, driver=(major, minor))
    assert PUTM(shots=1, balanced=False, solver="hopper").engine_type(torch.device("cuda")) is HopperEngine
    gpu(9, 0, driver=(major + 1, 0))
    assert PUTM(shots=1, balanced=False, solver="hopper").engine_type(torch.device("cuda")) is HopperEngine


@pytest.mark.parametrize("options,named", [({"hidden": [64, 32]}, "hidden=[64, 32]"),
                                           ({"precision": "fp32"}, "precision=fp32"),
                                           ({"precision": "tf32"}, "precision=tf32")])
def test_options_the_kernel_does_not_have_are_refused_on_any_machine(options, named):
    """The kernel has the navigator's widths 128 → 64 → 1 built in and bf16 products only: other widths, or fp32
    / TF32 products, are refused by name, even before the device is asked (so on this CPU machine too). Kills:
    hidden widths ignored (the kernel would run 128 → 64 on a navigator of other widths, reading past its
    buffers), a precision silently computed in bf16."""
    message = refusal(**options)
    assert named in message and "GPU" not in message


@pytest.mark.parametrize("counts,named", [([[20] * 5], "500 pairs (at most 384)"),
                                          ([[15, 15, 15, 15, 14]], "basis width 79"),
                                          ([[8] * 10], "10 ways")])
def test_tasks_the_kernel_cannot_take_are_refused_before_any_work(monkeypatch, counts, named):
    """Task shapes come with the tasks, so they are checked when the method receives them, before the first chunk
    is preprocessed: more than 384 (query, class) pairs, an odd basis width (74 queries + 5 support rows), more
    than 8 ways. Shown on the kernel's CPU emulation, which shares the GPU engine's check (``KernelEngine``);
    the control: 75 queries x 5 ways in a basis of 80 run. Kills: the shape checked only by the engine's guard at
    the first E-step (a ValueError after the preprocessing), a wrong limit in the check."""
    preprocessed = []
    real = PUTM.preprocess
    monkeypatch.setattr(PUTM, "preprocess", lambda self, tasks: preprocessed.append(1) or real(self, tasks))
    tiny = dict(em_steps=1, inner_steps=1, engine=EmulatedEngine)
    tasks, _ = clustered_tasks(counts, shots=1, dim=128)
    with pytest.raises(ConfigError, match=KEY + "cannot take these tasks") as error:
        PUTM(shots=1, balanced=False, **tiny).predict(tasks)
    assert named in str(error.value) and "\n" not in str(error.value) and not preprocessed
    fitting, _ = clustered_tasks([[15] * 5], shots=1, dim=128)
    assert PUTM(shots=1, balanced=False, **tiny).predict(fitting).shape == (1, 75, 5) and preprocessed


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_auto_never_picks_hopper(gpu, capability):
    """The kernel has not run on a GPU, so ``auto`` must not choose it, even on an sm_90 device with NVRTC.
    Kills: hopper added to auto's choices before a GPU run measured it."""
    gpu(*capability)
    for precision in ("auto", "bf16"):
        assert resolve_solver("auto", torch.device("cuda"), precision) != "hopper"


# ------------------------------------------------------------------------------------------ memory per task
def test_the_hopper_engines_memory_per_task_is_its_buffers():
    """Device memory per task, by hand from the kernel's layout (fp32 words), for the 1-shot and the 5-shot shape
    (375 pairs; m = 80 and 100). m = 80: the navigator 80·128 + 128·64 + 64·8 (w3 stored 8 wide) + 128 + 64 + 1
    = 19,137 words, three times (weights, Adam's m and v) = 57,411; the block's workspace: row stride 88 (81
    rounded up to 8s, an odd number of 16-byte units) = 11 column blocks of dW1ᵀ x 4 + 9 of dW2ᵀ x 4 = 80 slots
    x 256 threads x 3 (W, m, v) = 61,440; costs, π_f, π_b 3 x 375 = 1,125; the queries' copy, at most 375 x 80 =
    30,000: 149,976 words. m = 100: navigator 21,697 x 3 = 65,091; row stride 104 (13 blocks): 88 slots ->
    67,584; 1,125; 37,500: 171,300 words. Kills: the workspace or a moment left out, fused's estimate reused
    (1,126,740 B at m = 80), the slots counted for another width."""
    settings = PUTMSettings()
    assert HopperEngine.bytes_per_task(375, 80, settings) == 4 * (57_411 + 61_440 + 1_125 + 30_000)
    assert HopperEngine.bytes_per_task(375, 100, settings) == 4 * (65_091 + 67_584 + 1_125 + 37_500)


def test_an_engine_given_to_the_method_runs_and_sizes_its_chunks():
    """``PUTM(engine=EmulatedEngine)`` (not a ``solver`` value, Python only): the chunk planner uses that engine's
    estimate and the EM loop runs that engine; anything but an Engine subclass is refused by name. Kills: the
    engine given ignored by the planner (chunks sized for ``fused``) or by the loop (the fused engine runs)."""
    tasks, _ = clustered_tasks([[15] * 5], shots=1, dim=128)
    given = PUTM(shots=1, balanced=False, em_steps=1, inner_steps=1, engine=EmulatedEngine)
    fused = PUTM(shots=1, balanced=False, em_steps=1, inner_steps=1, solver="fused")
    from lightning_putm.methods.putm.engines import FusedEngine

    difference = EmulatedEngine.bytes_per_task(375, 80, given.settings) - FusedEngine.bytes_per_task(
        375, 80, fused.settings)
    assert given.bytes_per_task(tasks) - fused.bytes_per_task(tasks) == difference != 0
    ran = []
    given.em_step_hook = lambda step: ran.append(type(step.engine))
    given.predict(tasks)
    assert ran and set(ran) == {EmulatedEngine}
    with pytest.raises(ConfigError, match="putm: engine must be an Engine subclass"):
        PUTM(shots=1, balanced=False, engine="fused")
