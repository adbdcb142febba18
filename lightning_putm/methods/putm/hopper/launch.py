"""Running the Hopper kernel on a GPU: its cubin (:mod:`.build`) loaded and launched through the CUDA driver API.

The driver (``libcuda``) is reached with ctypes, so nothing is compiled at install time and no C++ extension is
needed; launches go to torch's current stream, on the context torch made current. :class:`HopperEngine` offers the
methods :func:`..em.em_loop` calls (like :class:`.emulate.EmulatedEngine`): one launch per E-step, one block per
task. It is not yet a ``putm.solver``: until a GPU run has checked it (benchmarks/hopper_check.py), only that script
uses it.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Iterable

import torch

from lightning_putm.methods.putm.adam import ADAM_EPS
from lightning_putm.methods.putm.hopper import build
from lightning_putm.methods.putm.hopper.emulate import Parts
from lightning_putm.methods.putm.hopper.layout import THREADS, Layout
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.cache
def driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise build.ToolchainMissing(f"putm hopper kernel: the CUDA driver (libcuda.so.1) is not here ({error})")


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"putm hopper kernel: {what} failed: {text.value.decode() if text.value else result}")


class Kernel:
    """The loaded kernel for one task shape (and Adam flavour)."""

    def __init__(self, layout: Layout, exact_adam: bool = False) -> None:
        self.layout = layout
        made = build.compile_kernel(layout.queries, layout.ways, layout.dim, exact_adam=exact_adam)
        self.resources = made.resources
        torch.zeros(1, device="cuda")  # torch's primary context, current on this thread
        cu = driver()
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        self._image = ctypes.create_string_buffer(made.cubin, len(made.cubin))
        _check(cu.cuModuleLoadData(ctypes.byref(self.module), self._image), "cuModuleLoadData")
        _check(cu.cuModuleGetFunction(ctypes.byref(self.function), self.module, b"putm_e_step"), "cuModuleGetFunction")
        self.shared_bytes = self._read_shared_bytes()
        if self.shared_bytes != layout.shared_bytes:
            raise RuntimeError(f"putm hopper kernel: shared memory {self.shared_bytes} B in the kernel, "
                               f"{layout.shared_bytes} B in layout.py")
        _check(cu.cuFuncSetAttribute(self.function, _MAX_DYNAMIC_SHARED, self.shared_bytes), "shared memory limit")

    def _read_shared_bytes(self) -> int:
        pointer, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(driver().cuModuleGetGlobal_v2(ctypes.byref(pointer), ctypes.byref(size), self.module,
                                             b"putm_smem_bytes"), "cuModuleGetGlobal")
        value = ctypes.c_uint32()
        _check(driver().cuMemcpyDtoH_v2(ctypes.byref(value), pointer, ctypes.c_size_t(4)), "cuMemcpyDtoH")
        return value.value

    def launch(self, blocks: int, arguments: list) -> None:
        pointers = (ctypes.c_void_p * len(arguments))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p)
                                                        for a in arguments])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(driver().cuLaunchKernel(self.function, blocks, 1, 1, THREADS, 1, 1, self.shared_bytes, stream,
                                       pointers, None), "cuLaunchKernel")


@functools.cache
def kernel(queries: int, ways: int, dim: int, exact_adam: bool = False) -> Kernel:
    return Kernel(Layout(queries, ways, dim), exact_adam)


class HopperEngine:
    """The E-step as one launch of the Hopper kernel (CUDA tensors; a fixed batch with an ``active`` mask)."""

    fixed_batch = True

    def __init__(self, navigator: Navigator, settings: PUTMSettings, exact_adam: bool = False) -> None:
        self.navigator, self.settings, self.exact_adam = navigator, settings, exact_adam
        self.compute_dtype = torch.bfloat16
        self.exp_avg = torch.zeros_like(navigator.flat)
        self.exp_avg_sq = torch.zeros_like(navigator.flat)
        self.steps = 0
        self.active = torch.ones(navigator.num_tasks, dtype=torch.int8, device=navigator.flat.device)
        self._work: torch.Tensor | None = None
        self._schedule = torch.empty(0, 2)

    def schedule(self, steps: int) -> torch.Tensor:
        if len(self._schedule) < steps:
            beta1, beta2 = self.settings.adam_betas
            size = max(steps, 2 * len(self._schedule))
            rows = [[self.settings.lr / (1 - beta1 ** float(k)), (1 - beta2 ** float(k)) ** 0.5]
                    for k in range(1, size + 1)]
            self._schedule = torch.tensor(rows, dtype=torch.float32, device=self.navigator.flat.device)
        return self._schedule

    @torch.no_grad()
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        from lightning_putm.methods.putm.triton_engine import pair_costs

        s, nav = self.settings, self.navigator
        t, q, m = query.shape
        layout = Layout(q, ways, m)
        reason = layout.unsupported()
        if reason is not None:
            raise ValueError(f"the Hopper kernel does not take this shape: {reason}")
        compiled = kernel(q, ways, m, self.exact_adam)
        query, prototypes = query.contiguous(), prototypes.contiguous()
        cost = pair_costs(query, prototypes).contiguous()
        forward, backward = torch.zeros_like(cost), torch.zeros_like(cost)
        words = t * 3 * layout.slots * THREADS
        if self._work is None or self._work.numel() != words:
            self._work = torch.empty(words, device=query.device)
        index = layout.slot_index.to(query.device).contiguous()
        parts = Parts(nav)
        schedule = self.schedule(self.steps + s.inner_steps)
        beta1, beta2 = s.adam_betas
        p = ctypes.c_void_p
        arguments = [p(query.data_ptr()), p(prototypes.data_ptr()), p(cost.data_ptr()), p(nav.flat.data_ptr()),
                     p(self.exp_avg.data_ptr()), p(self.exp_avg_sq.data_ptr()), p(self.active.data_ptr()),
                     p(schedule.data_ptr() + 8 * self.steps), p(forward.data_ptr()), p(backward.data_ptr()),
                     p(self._work.data_ptr()), p(index.data_ptr()), ctypes.c_int(s.inner_steps),
                     ctypes.c_longlong(parts.starts[1]), ctypes.c_longlong(parts.w3),
                     ctypes.c_longlong(parts.starts[2]), ctypes.c_longlong(parts.starts[3]),
                     ctypes.c_longlong(parts.b3), ctypes.c_float(s.negative_slope), ctypes.c_float(s.rho),
                     ctypes.c_float(s.theta), ctypes.c_float(1 - beta1), ctypes.c_int(int(1 - beta1 >= 0.5)),
                     ctypes.c_float(beta2), ctypes.c_float(1 - beta2), ctypes.c_float(ADAM_EPS)]
        compiled.launch(t, arguments)
        self._keep = (index, cost, schedule)  # alive until the launch has run (stream order)
        self.steps += s.inner_steps
        return forward, backward

    def reinit(self, generators: list[torch.Generator]) -> None:
        self.navigator.redraw(generators)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.steps = 0

    def keep_only(self, live: torch.Tensor) -> None:
        self.active = live.to(device=self.navigator.flat.device, dtype=torch.int8)

    def whole_em_loop(self, rows: torch.Tensor, one_hot: torch.Tensor, prototypes: torch.Tensor, ways: int,
                      progress: Callable[[Iterable[int]], Iterable[int]] = iter) -> None:
        return None
