"""The ``triton`` E-step engine: one fused Triton kernel per E-step (``solver=triton``). Not part of the paper.

:class:`TritonEngine` runs the whole E-step of Algorithm 1 (``inner_steps`` Adam steps of every task's
navigator on the CT loss) as one launch of the fused kernel of :mod:`.triton_wide`: one program per task, the
navigator forward, the CT-loss gradient and the backward written by hand, and Adam's update, with the weights and
Adam moments in the navigator's flat buffers. It computes what the ``fused`` engine computes (:mod:`.engines`): the
same loss gradient, the same Adam formula with the same bias corrections, the step count carried across E-steps
(reset by a re-draw), and ``(π_f, π_b)`` of the last Adam step before its update; in fp32 it agrees with it to
float rounding (the sums run in another order).

The batch is fixed (:attr:`TritonEngine.fixed_batch`, like ``compiled``): the EM loop tells the engine which
tasks still need a result (:meth:`TritonEngine.keep_only`) and the kernel's program for any other task returns
at once (its ``active`` flag), so a settled task costs nothing and the shapes never change. Unless the host is
needed between E-steps, the engine runs the whole EM loop itself, on the device, with an M-step kernel
(:meth:`TritonEngine.whole_em_loop`, :mod:`.triton_em`).

Where it runs: on CUDA devices, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
the first use; slow, for tests). Anywhere else ``solver=triton`` is refused with one line
(:func:`.triton_support.unavailable_reason`). A shape the kernel does not handle (:func:`unsupported_reason`)
falls back to the ``compiled`` engine with one notice. ``solver=auto`` picks this engine on sm_90 GPUs, where it was
measured accurate to the noise floor and faster than ``compiled`` (docs/gpu.md, :mod:`.solvers`). Its launch
settings, ``triton_warps`` and ``triton_stages``, are :class:`.settings.PUTMSettings` fields that no config sets.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from lightning_putm.methods.putm.adam import ADAM_EPS
from lightning_putm.methods.putm.engines import Engine, FusedEngine
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.methods.putm.step import pair_inputs

#: Largest sizes the kernel is built for: the CT head holds a ``[Q, N]`` block in registers, and the backward
#: accumulates ``∂W1`` (``[K_PAD, H1]``) and ``∂W2`` in registers, which fit sm_90's 255 registers per thread with
#: few spilled bytes up to a basis of 128 columns and hidden widths of 128 (docs/lab/gpu-kernel.md).
MAX_WAYS, MAX_HEAD, MAX_HIDDEN, MAX_DIM = 64, 16384, 128, 128
#: Elements per block of the kernel's Adam update (each weight matrix is one flat range).
ADAM_BLOCK = 2048


def unsupported_reason(ways: int, queries: int, dim: int, hidden: list[int], dtype: torch.dtype) -> str | None:
    """Why the kernel does not handle this shape (then the ``compiled`` engine runs), or ``None``."""
    if dtype != torch.float32:
        return f"rows in {dtype} (the kernel reads float32)"
    if len(hidden) != 2:
        return f"{len(hidden)} hidden layers (the kernel has two)"
    if any(h < 16 or h > MAX_HIDDEN or h & (h - 1) for h in hidden):
        return f"hidden widths {hidden} (powers of two from 16 to {MAX_HIDDEN})"
    if ways > MAX_WAYS or power_of_two(queries) * power_of_two(ways) > MAX_HEAD:
        return f"{ways} ways x {queries} queries (at most {MAX_WAYS} ways and {MAX_HEAD} padded pairs)"
    if dim > MAX_DIM:
        return f"basis width {dim} (at most {MAX_DIM})"
    return None


def power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def ops() -> ModuleType:
    """The kernels' device functions and constants (:mod:`.triton_ops`), imported on first use (importing triton
    costs about a second)."""
    from lightning_putm.methods.putm import triton_ops

    return triton_ops


def e_step_kernel():
    """The fused E-step kernel (:func:`.triton_wide.e_step_kernel_wide`), its module imported on first use."""
    from lightning_putm.methods.putm import triton_wide

    return triton_wide.e_step_kernel_wide


def m_step_kernel():
    """The M-step kernel (:func:`.triton_em.m_step_kernel`), its module imported on first use."""
    from lightning_putm.methods.putm import triton_em

    return triton_em.m_step_kernel


@dataclass(frozen=True)
class Kernels:
    """The two kernels an engine launches, each indexed by its grid and called (``kernel[grid](*args, **opts)``, as a
    Triton JIT function is). The default is the real ones (:func:`default_kernels`); a caller that simulates a
    machine (a driver too old to build them, a launch to inspect) passes others to :class:`TritonEngine`."""

    e_step: Any
    m_step: Any


def default_kernels() -> Kernels:
    """The fused E-step and the M-step kernel (importing their modules costs about a second: first use only)."""
    return Kernels(e_step_kernel(), m_step_kernel())


def pair_tile(precision: int) -> int:
    """Pairs per tile (``BLOCK_P``) for a kernel ``PRECISION``: 32 in bf16, 16 in fp32 and TF32, whose fp32 tiles
    spill less on sm_90 (docs/lab/gpu-kernel.md)."""
    return 32 if precision == ops().BF16 else 16


def kernel_precision(compute_dtype: torch.dtype, device: torch.device) -> int:
    """The kernel's ``PRECISION``: bf16 products, TF32 (fp32 on CUDA with TF32 allowed, ``precision=tf32``) or
    exact fp32."""
    k = ops()
    if compute_dtype == torch.bfloat16:
        return k.BF16
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return k.TF32
    return k.FP32


class TritonEngine(Engine):
    """The E-step as one fused Triton kernel launch (``solver=triton``); see the module docstring."""

    fixed_batch = True

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype,
                 fall_back_on_error: bool = False, kernels: Kernels | None = None) -> None:
        super().__init__(navigator, settings, compute_dtype)
        #: The kernels launched (``None``: :func:`default_kernels`, looked up at the first launch).
        self._kernels = kernels
        #: ``solver=auto`` chose this engine: if its kernels fail to build or launch on this machine (an old
        #: driver, a triton that cannot compile them), the ``compiled`` engine takes over with one notice, before
        #: any state has changed (:meth:`probe`). ``solver=triton`` asked by name raises instead.
        self.fall_back_on_error = fall_back_on_error
        self._probed = False
        self.exp_avg = torch.zeros_like(navigator.flat)
        self.exp_avg_sq = torch.zeros_like(navigator.flat)
        #: Adam steps taken since the last re-draw (all tasks share it, like :class:`.adam.StackedAdam`).
        self.steps = 0
        self.active = torch.ones(navigator.num_tasks, dtype=torch.int8, device=navigator.flat.device)
        #: The ``compiled`` engine, when the kernel does not handle the chunk's shape.
        self.delegate: Engine | None = None
        self._schedule = torch.empty(0, 2)
        self._scratch: dict[str, torch.Tensor] = {}
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype,
              chosen_by_auto: bool = False) -> TritonEngine:
        """Chosen by ``solver=auto``, the engine hands over to ``compiled`` if its kernels cannot run here
        (:attr:`fall_back_on_error`); asked for by name, it raises."""
        return cls(navigator, settings, compute_dtype, fall_back_on_error=chosen_by_auto)

    @classmethod
    def bytes_per_task(cls, pairs: int, m: int, settings: PUTMSettings) -> int:
        """The ``fused`` engine's estimate, which covers the kernel's per-program scratch and Adam state too."""
        return FusedEngine.bytes_per_task(pairs, m, settings)

    def keep_only(self, live: torch.Tensor) -> None:
        """Only tasks ``live`` (a ``[T]`` bool mask) need results from now on: the others' programs return at once
        (their navigator and Adam state stay as they are; their rows of π_f, π_b keep their last values)."""
        self.active = live.to(device=self.navigator.flat.device, dtype=torch.int8)
        if self.delegate is not None:
            self.delegate.keep_only(live)

    def whole_em_loop(self, rows: torch.Tensor, one_hot: torch.Tensor, prototypes: torch.Tensor, ways: int,
                      progress: Callable[[Iterable[int]], Iterable[int]] = iter,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """:func:`.em.em_loop` on the device: each EM step's E-step kernel, then the M-step kernel of
        :mod:`.triton_em`, enqueued without waiting; the host waits once, for the EM step counts, at the end.
        ``None`` (the host-side loop runs) when a re-draw needs the host every EM step (``reinit_navigator``), when
        the kernel does not handle the shape (the E-steps then fall back, as :meth:`run` does), when a task is too
        large for one M-step program (:func:`.triton_em.m_step_fits`) or when this engine has already run
        E-steps."""
        s = self.settings
        num_support = one_hot.shape[1]
        if s.reinit_navigator or self.delegate is not None or self.steps or unsupported_reason(
                ways, rows.shape[1] - num_support, rows.shape[2], self.navigator.widths[1:-1], rows.dtype):
            return None
        from lightning_putm.methods.putm.triton_em import m_step_fits

        if not m_step_fits(rows.shape[1], rows.shape[2]):
            return None

        rows = rows.contiguous()
        support_weights = one_hot.to(rows.dtype).contiguous()
        query = rows[:, num_support:].contiguous()
        prototypes = prototypes.clone().contiguous()
        cost = pair_costs(query, prototypes)
        if not self.probe(query, prototypes, cost, lambda forward, backward, inactive: self.launch_m_step(
                rows, support_weights, forward, backward, prototypes.clone(), cost.clone(), inactive,
                torch.zeros_like(inactive), torch.zeros(len(rows), dtype=torch.int32, device=rows.device), 0,
                s.inertia, s.rho, s.early_stop_tol, s.prototype_update)):
            return None  # the compiled engine runs the E-steps of the host-side loop
        self.keep_only(torch.ones(len(rows), dtype=torch.bool, device=rows.device))
        final = torch.zeros_like(self.active)  # 1: the next E-step is the task's final one (early stopping)
        em_steps = torch.full((len(rows),), s.em_steps, dtype=torch.int32, device=rows.device)
        for step in progress(range(s.em_steps)):
            forward, backward = self.launch(query, prototypes, cost)
            self.steps += s.inner_steps
            self.launch_m_step(rows, support_weights, forward, backward, prototypes, cost, self.active, final,
                               em_steps, step, s.inertia, s.rho, s.early_stop_tol, s.prototype_update)
        forward, _ = self.launch(query, prototypes, cost)  # the final E-step; a settled task keeps its own rows
        self.steps += s.inner_steps
        return forward.clone(), prototypes, em_steps.to("cpu", torch.long)

    def reinit(self, generators: list[torch.Generator]) -> None:
        if self.delegate is not None:
            self.delegate.reinit(generators)
            return
        self.navigator.redraw(generators)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.steps = 0

    def schedule(self, steps: int) -> torch.Tensor:
        """``[steps, 2]`` float32 on the device: Adam's ``lr / (1 − β1^s)`` and ``√(1 − β2^s)`` for step
        ``s = 1, 2, …``, computed in double precision like :class:`.adam.StackedAdam`'s Python numbers."""
        if len(self._schedule) < steps:
            beta1, beta2 = self.settings.adam_betas
            size = max(steps, 2 * len(self._schedule))
            rows = [[self.settings.lr / (1 - beta1 ** float(s)), (1 - beta2 ** float(s)) ** 0.5]
                    for s in range(1, size + 1)]
            self._schedule = torch.tensor(rows, dtype=torch.float32, device=self.navigator.flat.device)
        return self._schedule

    @torch.no_grad()
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``inner_steps`` Adam steps in one launch; ``(π_f, π_b)`` of the last step, before its update."""
        if self.delegate is not None:
            return self.delegate.run(query, prototypes, ways)
        nav = self.navigator
        reason = unsupported_reason(ways, query.shape[1], query.shape[2], nav.widths[1:-1], query.dtype)
        if reason is not None:
            return self.fall_back(reason).run(query, prototypes, ways)
        cost = pair_costs(query, prototypes)
        if not self.probe(query.contiguous(), prototypes.contiguous(), cost):
            return self.delegate.run(query, prototypes, ways)  # type: ignore[union-attr]
        forward, backward = self.launch(query.contiguous(), prototypes.contiguous(), cost)
        self.steps += self.settings.inner_steps
        return forward.clone(), backward.clone()

    def probe(self, query: torch.Tensor, prototypes: torch.Tensor, cost: torch.Tensor,
              m_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None) -> bool:
        """Whether the kernels run here. With :attr:`fall_back_on_error`, before the first real launch, the E-step
        kernel (and ``m_step(forward, backward, active)``, the M-step kernel's launch) is built and launched once
        with every task inactive: each program returns at once and nothing changes. An error then falls back to
        the ``compiled`` engine with one notice and gives ``False``. Without it, ``True`` (an error surfaces at the
        first launch)."""
        if not self.fall_back_on_error or self._probed:
            return True
        active, self.active = self.active, torch.zeros_like(self.active)
        try:
            forward, backward = self.launch(query, prototypes, cost)
            if m_step is not None:
                m_step(forward, backward, self.active)
        except Exception as error:  # a build or launch failure: nothing ran, so the compiled engine can start over
            self.active = active  # the tasks that still need results, which the compiled engine takes over
            text = str(error).strip()
            self.fall_back(f"{type(error).__name__}: {text.splitlines()[0] if text else ''}", failed=True)
            return False
        self.active = active
        self._probed = True
        return True

    def fall_back(self, reason: str, failed: bool = False) -> Engine:
        """The ``compiled`` engine on the same navigator, with one notice (only before the first Adam step);
        ``failed``: the kernels could not run here (``reason``: the error), else the shape is one they do not
        handle."""
        from lightning_putm.methods.putm.compiled import CompiledEngine

        if self.steps:
            raise RuntimeError(f"putm solver=triton: the shape changed mid-run to one the kernel does not handle "
                               f"({reason})")
        notice(reason, failed)
        self.delegate = CompiledEngine(self.navigator, self.settings, self.compute_dtype)
        if not bool(self.active.all()):
            self.delegate.keep_only(self.active.bool())
        return self.delegate

    def launch(self, query: torch.Tensor, prototypes: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
        """One kernel launch over all tasks; returns the (persistent) π_f and π_b buffers."""
        arguments, constants, grid = self.kernel_arguments(query, prototypes, cost)
        self.kernels.e_step[grid](*arguments, **constants, **self.launch_options())
        return self._outputs  # type: ignore[return-value]

    @property
    def kernels(self) -> Kernels:
        """The kernels this engine launches (given, or the real ones)."""
        if self._kernels is None:
            self._kernels = default_kernels()
        return self._kernels

    def launch_m_step(self, *args: object) -> None:
        """One launch of this engine's M-step kernel over all tasks (:func:`.triton_em.launch_m_step`)."""
        from lightning_putm.methods.putm.triton_em import launch_m_step

        launch_m_step(*args, kernel=self.kernels.m_step)

    def launch_options(self) -> dict[str, int]:
        """A launch's options besides its arguments: warps per program and software-pipelining stages (the settings'
        ``triton_warps``, ``triton_stages``)."""
        return {"num_warps": self.settings.triton_warps, "num_stages": self.settings.triton_stages}

    def kernel_arguments(self, query: torch.Tensor, prototypes: torch.Tensor,
                         cost: torch.Tensor) -> tuple[list[object], dict[str, object], tuple[int]]:
        """The kernel's runtime arguments, its compile-time constants and its grid (one program per task) for one
        launch (the scratch and the output buffers are allocated here, once per shape)."""
        k, s, nav = ops(), self.settings, self.navigator
        t, q, m = query.shape
        n = prototypes.shape[1]
        h1, h2 = nav.widths[1:-1]
        pairs = q * n
        precision = kernel_precision(self.compute_dtype, query.device)
        block_p = pair_tile(precision)
        padded_pairs = -(-pairs // block_p) * block_p
        k_pad = max(16, power_of_two(m))  # the products' width
        scratch = self.scratch(t, padded_pairs, k_pad, m, h1, h2, torch.float32 if k.INTERPRETED else
                               self.compute_dtype)
        if self._outputs is None or self._outputs[0].shape != cost.shape:
            self._outputs = (torch.zeros_like(cost), torch.zeros_like(cost))
        forward, backward = self._outputs
        weights, biases = nav.views(nav.flat)
        starts = [0]
        for part in [*weights, *biases][:-1]:
            starts.append(starts[-1] + part.numel())
        beta1, beta2 = s.adam_betas
        arguments = [query, prototypes, cost, nav.flat, self.exp_avg, self.exp_avg_sq, self.active,
                     self.schedule(self.steps + s.inner_steps), forward, backward, scratch["x0"], scratch["h1"],
                     scratch["h2"], scratch["logits"], scratch["grad"], scratch["dw"], t, s.inner_steps, self.steps,
                     *starts[1:], s.negative_slope, s.rho, s.theta, 1 - beta1, beta2, 1 - beta2, ADAM_EPS]
        constants = dict(Q=q, N=n, M=m, H1=h1, H2=h2, W3S=weights[-1].shape[2], Q_PAD=power_of_two(q),
                         N_PAD=power_of_two(n), P_PAD=padded_pairs, BLOCK_P=block_p, K_PAD=k_pad,
                         PRECISION=precision, INTERPRET=k.INTERPRETED, LERP_FROM_END=not abs(1 - beta1) < 0.5,
                         BALANCE=s.theta != 0, ADAM_BLOCK=ADAM_BLOCK)
        return arguments, constants, (t,)

    def scratch(self, programs: int, pairs: int, k_pad: int, m: int, h1: int, h2: int,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Each program's scratch (kept between launches of the same size): the inputs ``[pairs, k_pad]`` and the
        activations in ``dtype``, the logits and their gradients, and room for both ``∂W1`` (``m`` rows) and
        ``∂W2`` in fp32."""
        shape = (programs, pairs, k_pad, m, h1, h2, dtype)
        if self._scratch.get("shape") != shape:
            device = self.navigator.flat.device

            def room(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
                return torch.empty(size, device=device, dtype=dtype)

            self._scratch = {"shape": shape,  # type: ignore[dict-item]
                             "x0": room(programs, pairs, k_pad, dtype=dtype),
                             "h1": room(programs, pairs, h1, dtype=dtype),
                             "h2": room(programs, pairs, h2, dtype=dtype),
                             "logits": room(programs, pairs),
                             "grad": room(programs, pairs),
                             "dw": room(programs, m * h1 + h1 * h2)}
        return self._scratch


#: Tasks whose pair costs are computed at once: the ``[tasks, Q·N, m]`` squared differences behind them are the
#: largest tensor of the other engines (1.2 GB for 10,000 tasks at 1 shot), and the kernel needs only the costs.
COST_CHUNK = 512


def pair_costs(query: torch.Tensor, prototypes: torch.Tensor, chunk: int = COST_CHUNK) -> torch.Tensor:
    """The costs ``c_jk = ‖x_j − μ_k‖²`` ``[T, Q, N]`` of :func:`.step.pair_inputs`, computed ``chunk`` tasks at a
    time: the same values (bit for bit on a CPU, where it is tested; a GPU's reduction may sum in another order for
    another batch size, a rounding difference)."""
    return torch.cat([pair_inputs(query[start:start + chunk], prototypes[start:start + chunk])[1]
                      for start in range(0, query.shape[0], chunk)])


_NOTICED: set[str] = set()


def reset_notices() -> None:
    """Forget the reasons already noticed, so the next fall-back of each warns again (a long-lived process that
    wants the notice per run, a test that checks it)."""
    _NOTICED.clear()


def notice(reason: str, failed: bool = False) -> None:
    """One warning per distinct reason and process when a chunk falls back to the ``compiled`` engine (``failed``:
    the kernels could not be built or launched on this machine, when ``solver=auto`` chose them)."""
    if reason not in _NOTICED:
        _NOTICED.add(reason)
        if failed:
            message = (f"putm solver=auto: the fused Triton kernel could not run on this machine ({reason}); using "
                       "solver=compiled (method.putm.solver=compiled skips the attempt, solver=triton shows the error)")
        else:
            message = f"putm solver=triton: the fused kernel does not handle {reason}; using solver=compiled for it"
        warnings.warn(message, RuntimeWarning, stacklevel=4)
