"""Running the Hopper kernel on a GPU: its cubin (:mod:`.build`) loaded and launched through the CUDA driver API.

The driver (``libcuda``) is reached with ctypes, so nothing is compiled at install time and no C++ extension is
needed; launches go to torch's current stream, on the context torch made current. :class:`HopperEngine` is the
``solver=hopper`` engine: one launch per E-step, one block per task. It has not yet run on a GPU
(benchmarks/hopper_check.py is the first check), so ``solver=auto`` never picks it.
"""

from __future__ import annotations

import ctypes
import functools
import torch

from lightning_putm.methods.putm.adam import ADAM_EPS
from lightning_putm.methods.putm.hopper import build
from lightning_putm.methods.putm.hopper.emulate import KernelEngine, Parts
from lightning_putm.methods.putm.hopper.layout import THREADS, Layout
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


#: The CUDA driver's library (libcuda.so.1), loaded once (:func:`.build.driver`).
driver = build.driver


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


class HopperEngine(KernelEngine):
    """The E-step as one launch of the Hopper kernel, one block per task (``solver=hopper``; CUDA tensors on an
    sm_90 GPU, checked before any work by :mod:`.support`). ``exact_adam``: the correctly rounded Adam
    (benchmarks/hopper_check.py compares both)."""

    active_dtype = torch.int8

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype = torch.bfloat16,
                 exact_adam: bool = False) -> None:
        super().__init__(navigator, settings, compute_dtype)
        self.exact_adam = exact_adam
        self._work: torch.Tensor | None = None
        self._schedule = torch.empty(0, 2)

    @classmethod
    def bytes_per_task(cls, pairs: int, m: int, settings: PUTMSettings) -> int:
        """Device memory one task's E-step holds (fp32 words, :class:`.layout.Layout`): the navigator's flat segment
        and Adam's two moments; the block's workspace (W, m, v of every slot of its 256 threads); the costs, π_f
        and π_b; the queries' contiguous copy (``Q·m`` words, counted as ``pairs·m``: the pairs' count is what this
        is told, and ``Q ≤ pairs``). Not per task: the schedule, the slot table, and the squared differences of
        :func:`.triton_engine.pair_costs` (of at most 512 tasks at a time)."""
        params = Navigator.numel([m, *settings.hidden, 1], 1)
        workspace = Layout(1, 1, m).workspace_floats  # the slots depend on the basis width only
        return 4 * (3 * params + workspace + 3 * pairs + pairs * m)

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
        layout = self.layout(query, ways)
        compiled = kernel(q, ways, m, self.exact_adam)
        query, prototypes = query.contiguous(), prototypes.contiguous()
        cost = pair_costs(query, prototypes).contiguous()
        forward, backward = torch.zeros_like(cost), torch.zeros_like(cost)
        words = t * layout.workspace_floats
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
