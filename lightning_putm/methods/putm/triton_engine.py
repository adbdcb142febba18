"""The ``triton`` E-step engine: one fused Triton kernel per E-step (``solver=triton``). Not part of the paper.

:class:`TritonTrainer` runs the whole E-step of Algorithm 1 (``inner_steps`` Adam steps of every task's
navigator on the CT loss) as one launch of a fused kernel (:class:`KernelConfig`: the wide kernel of
:mod:`.triton_wide` by default, or the chunked one of :mod:`.triton_kernels`): one program per task (or per
group of tasks, :class:`KernelConfig`), the navigator forward, the CT-loss gradient and the backward written by
hand, and Adam's update, with the weights and Adam moments in the navigator's flat buffers. It computes what the
``fused`` engine computes (:mod:`.engines`): the same loss gradient, the same Adam formula with the same bias
corrections, the step count carried across E-steps (reset by a re-draw), and ``(π_f, π_b)`` of the last Adam step
before its update; in fp32 it agrees with it to float rounding (the sums run in another order).

The batch is fixed (:attr:`TritonTrainer.fixed_batch`, like ``compiled``): the EM loop tells the engine which
tasks still need a result (:meth:`TritonTrainer.keep_only`) and the kernel's program for any other task returns
at once (its ``active`` flag), so a settled task costs nothing and the shapes never change. Unless the host is
needed between E-steps, the engine runs the whole EM loop itself, on the device, with an M-step kernel
(:meth:`TritonTrainer.whole_em_loop`, :mod:`.triton_em`).

Where it runs: on CUDA devices, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
the first use; slow, for tests). Anywhere else ``solver=triton`` is refused with one line
(:func:`.triton_support.unavailable_reason`). A shape the kernel does not handle (:func:`unsupported_reason`)
falls back to the ``compiled`` engine with one notice. ``solver=auto`` picks this engine on sm_90 GPUs: on an H100
it was accurate to the noise floor and 2.6x as fast as ``compiled`` (docs/gpu.md, :mod:`.solvers`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from types import ModuleType
from typing import Callable, Iterable

import torch

from lightning_putm.methods.putm.adam import ADAM_EPS
from lightning_putm.methods.putm.engines import Engine
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.methods.putm.step import pair_inputs

#: Largest sizes the kernel is built for (the CT head holds a [Q, N] block in registers; hidden widths are tiles).
MAX_WAYS, MAX_HEAD, MAX_HIDDEN, MAX_DIM = 64, 16384, 256, 1024


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which kernel runs and its tile sizes.

    ``kernel``: ``"wide"`` (:func:`.triton_wide.e_step_kernel_wide`: the inputs written once per E-step, every
    product over the whole basis width, one backward pass) or ``"chunked"`` (:func:`.triton_kernels.e_step_kernel`,
    the first design, measured on an H100 in docs/gpu.md: products over ``block_k`` input columns at a time). The
    wide kernel holds ``∂W1`` in registers, so it serves bases of at most :data:`WIDE_MAX_DIM` columns and hidden
    widths of at most :data:`WIDE_MAX_HIDDEN`; beyond them the chunked kernel runs. ``block_p``: pairs per tile
    (``None``: 32 in bf16, 16 in fp32/TF32, whose fp32 tiles spill less on sm_90, docs/gpu.md); ``block_k``: input
    columns per chunk (chunked kernel only); ``num_warps``: warps per program; ``programs``: programs per launch
    (``None``: one per task; fewer make each program solve several tasks in turn and shrink the scratch to that
    many tasks); ``exact_adam``: Adam's square root and divisions correctly rounded like torch's (``False``: the
    GPU's approximate instructions, within 2 ulp, wide kernel only); ``max_registers``: a cap on registers per
    thread (Triton's ``maxnreg``; ``None``: as many as the compiler wants, 255 for the default tiles, so one 8-warp
    program per SM; 128 lets two share an SM, at the price of spilled registers, docs/gpu.md); ``num_stages``:
    Triton's software pipelining of the loops over pair tiles (1: none; 2 or 3: the next tiles' scratch rows are
    copied into shared memory asynchronously while the current tile is multiplied, which hides the latency of those
    loads when few warps share an SM, at the price of more instructions and shared memory; ``None``:
    :data:`DEFAULT_STAGES` of the kernel that runs, 3 for the wide kernel, the fastest of the H100 sweep, and 1
    for the chunked kernel, measured only so; docs/gpu.md); ``scratch``: what the wide kernel keeps per program in
    global memory between the phases of an Adam step (:data:`SCRATCHES`): ``"full"``, the inputs in rows of
    ``K_PAD`` columns, both hidden layers' activations and fp32 weight gradients; ``"lean"``, the inputs in rows of
    ``m`` columns and the weight gradients in the compute dtype, the activations computed again in the backward:
    more tensor-core work, less memory traffic, and a working set that fits an H100's L2 cache (docs/gpu.md). Both
    give the same results. ``benchmarks/bench_putm.py --triton-*`` sets them on a GPU."""

    kernel: str = "wide"
    block_p: int | None = None
    block_k: int = 16
    num_warps: int = 8
    programs: int | None = None
    exact_adam: bool = True
    max_registers: int | None = None
    num_stages: int | None = None
    scratch: str = "full"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"KernelConfig.kernel={self.kernel!r}: one of {', '.join(KERNELS)}")
        if self.scratch not in SCRATCHES:
            raise ValueError(f"KernelConfig.scratch={self.scratch!r}: one of {', '.join(SCRATCHES)}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages={self.num_stages}: at least 1 (1: no software pipelining)")

    def stages(self, kernel: str) -> int:
        """``num_stages`` for the kernel that runs (:func:`kernel_for`): the setting, or that kernel's default."""
        return DEFAULT_STAGES[kernel] if self.num_stages is None else self.num_stages

    def launch_options(self, kernel: str) -> dict[str, int]:
        """A launch's options besides its arguments, for the kernel that runs: warps, pipeline stages, the register
        cap if any."""
        options = {"num_warps": self.num_warps, "num_stages": self.stages(kernel)}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def pair_tile(self, precision: int) -> int:
        """``block_p`` for a kernel ``PRECISION`` (:mod:`.triton_kernels`: 2 = bf16)."""
        if self.block_p is not None:
            return self.block_p
        return 32 if precision == 2 else 16


#: The kernels :class:`KernelConfig` can name.
KERNELS = ("wide", "chunked")
#: Each kernel's pipeline stages when :attr:`KernelConfig.num_stages` is ``None``: the wide kernel's fastest row of
#: the H100 sweep (measured: docs/lab/gpu-kernel.md, "Measured on the H100: the wide kernel"); the
#: chunked kernel was timed with 1 stage only.
DEFAULT_STAGES = {"wide": 3, "chunked": 1}
#: What :attr:`KernelConfig.scratch` can name (``"lean"``: the wide kernel's ``LEAN``).
SCRATCHES = ("full", "lean")
#: Largest basis width and hidden widths of the wide kernel (its ``∂W1`` and ``∂W2`` accumulate in registers:
#: at the default tiles 128 x 128 and 128 x 64 fp32 fit the 255 registers of sm_90 with few spilled bytes, 68 per
#: thread with triton 3.8 and 120 with 3.6, docs/gpu.md).
WIDE_MAX_DIM, WIDE_MAX_HIDDEN = 128, 128
#: Elements per block of the wide kernel's Adam update (each weight matrix is one flat range).
WIDE_ADAM_BLOCK = 2048


def kernel_for(config: KernelConfig, dim: int, hidden: tuple[int, int]) -> str:
    """The kernel that runs for a basis width and hidden widths: ``config.kernel``, unless the wide kernel was
    asked for a shape beyond it (then ``"chunked"``)."""
    if config.kernel == "wide" and (dim > WIDE_MAX_DIM or max(hidden) > WIDE_MAX_HIDDEN):
        return "chunked"
    return config.kernel


#: The configuration a new :class:`TritonTrainer` uses (the benchmark's sweep replaces it).
DEFAULT_CONFIG = KernelConfig()


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


def input_columns(m: int, lean: bool) -> int:
    """Columns per row of the wide kernel's inputs scratch for a basis of ``m``: ``m`` padded to a power of two
    (the products' width, ``K_PAD``), or with ``lean`` to a multiple of 8 (16-byte rows in bf16, so loads and
    stores stay vectorized)."""
    return -(-m // 8) * 8 if lean else max(16, power_of_two(m))


def power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def kernels() -> ModuleType:
    """The kernel module, imported on first use (importing triton costs about a second)."""
    from lightning_putm.methods.putm import triton_kernels

    return triton_kernels


def kernel_function(name: str):
    """The Triton kernel of a :class:`KernelConfig` ``kernel`` name (its module imported on first use)."""
    if name == "wide":
        from lightning_putm.methods.putm import triton_wide

        return triton_wide.e_step_kernel_wide
    return kernels().e_step_kernel


def kernel_precision(compute_dtype: torch.dtype, device: torch.device) -> int:
    """The kernel's ``PRECISION``: bf16 products, TF32 (fp32 on CUDA with TF32 allowed, ``precision=tf32``) or
    exact fp32."""
    k = kernels()
    if compute_dtype == torch.bfloat16:
        return k.BF16
    if device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return k.TF32
    return k.FP32


class TritonTrainer(Engine):
    """The E-step as one fused Triton kernel launch (``solver=triton``); see the module docstring."""

    fixed_batch = True

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype,
                 config: KernelConfig | None = None, fall_back_on_error: bool = False) -> None:
        self.navigator, self.settings, self.compute_dtype = navigator, settings, compute_dtype
        self.config = DEFAULT_CONFIG if config is None else config
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
        from lightning_putm.methods.putm.triton_em import launch_m_step, m_step_fits

        if not m_step_fits(rows.shape[1], rows.shape[2]):
            return None

        rows = rows.contiguous()
        support_weights = one_hot.to(rows.dtype).contiguous()
        query = rows[:, num_support:].contiguous()
        prototypes = prototypes.clone().contiguous()
        cost = pair_costs(query, prototypes)
        if not self.probe(query, prototypes, cost, lambda forward, backward, inactive: launch_m_step(
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
            launch_m_step(rows, support_weights, forward, backward, prototypes, cost, self.active, final, em_steps,
                          step, s.inertia, s.rho, s.early_stop_tol, s.prototype_update)
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
        from lightning_putm.methods.putm.compiled import CompiledTrainer

        if self.steps:
            raise RuntimeError(f"putm solver=triton: the shape changed mid-run to one the kernel does not handle "
                               f"({reason})")
        notice(reason, failed)
        self.delegate = CompiledTrainer(self.navigator, self.settings, self.compute_dtype)
        if not bool(self.active.all()):
            self.delegate.keep_only(self.active.bool())
        return self.delegate

    def launch(self, query: torch.Tensor, prototypes: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
        """One kernel launch over all tasks; returns the (persistent) π_f and π_b buffers."""
        name, arguments, constants, grid = self.kernel_arguments(query, prototypes, cost)
        kernel_function(name)[grid](*arguments, **constants, **self.config.launch_options(name))
        return self._outputs  # type: ignore[return-value]

    def kernel_arguments(self, query: torch.Tensor, prototypes: torch.Tensor,
                         cost: torch.Tensor) -> tuple[str, list[object], dict[str, object], tuple[int]]:
        """Which kernel runs (:func:`kernel_for`), its runtime arguments, its compile-time constants and its grid for
        one launch (the scratch and the output buffers are allocated here, once per shape)."""
        k, s, nav, config = kernels(), self.settings, self.navigator, self.config
        t, q, m = query.shape
        n = prototypes.shape[1]
        h1, h2 = nav.widths[1:-1]
        pairs = q * n
        precision = kernel_precision(self.compute_dtype, query.device)
        block_p = config.pair_tile(precision)
        padded_pairs = -(-pairs // block_p) * block_p
        programs = t if config.programs is None else max(1, min(t, config.programs))
        scratch_dtype = torch.float32 if k.INTERPRETED else self.compute_dtype
        name = kernel_for(config, m, (h1, h2))
        wide = name == "wide"
        k_pad = input_columns(m, lean=False)  # the products' width, K_PAD
        lean = wide and config.scratch == "lean"
        scratch = self.scratch(programs, padded_pairs, h1, h2, scratch_dtype, (k_pad, m) if wide else (0, 0), lean)
        if self._outputs is None or self._outputs[0].shape != cost.shape:
            self._outputs = (torch.zeros_like(cost), torch.zeros_like(cost))
        forward, backward = self._outputs
        weights, biases = nav.views(nav.flat)
        starts = [0]
        for part in [*weights, *biases][:-1]:
            starts.append(starts[-1] + part.numel())
        beta1, beta2 = s.adam_betas
        buffers = ([scratch["x0"], scratch["h1"], scratch["h2"], scratch["logits"], scratch["grad"], scratch["dw"]]
                   if wide else [scratch["h1"], scratch["h2"], scratch["logits"], scratch["grad"], scratch["dw"]])
        arguments = [query, prototypes, cost, nav.flat, self.exp_avg, self.exp_avg_sq, self.active,
                     self.schedule(self.steps + s.inner_steps), forward, backward, *buffers,
                     t, s.inner_steps, self.steps, *starts[1:],
                     s.negative_slope, s.rho, s.theta, 1 - beta1, beta2, 1 - beta2, ADAM_EPS]
        constants = dict(Q=q, N=n, M=m, H1=h1, H2=h2, W3S=weights[-1].shape[2], Q_PAD=power_of_two(q),
                         N_PAD=power_of_two(n), P_PAD=padded_pairs, BLOCK_P=block_p, BLOCK_K=config.block_k,
                         PRECISION=precision, INTERPRET=k.INTERPRETED, LERP_FROM_END=not abs(1 - beta1) < 0.5,
                         BALANCE=s.theta != 0)
        if wide:
            del constants["BLOCK_K"]
            constants.update(K_PAD=k_pad, ADAM_BLOCK=WIDE_ADAM_BLOCK, EXACT=config.exact_adam, LEAN=lean,
                             X0_COLS=input_columns(m, lean))
        return name, arguments, constants, (programs,)

    def scratch(self, programs: int, pairs: int, h1: int, h2: int, dtype: torch.dtype,
                wide: tuple[int, int] = (0, 0), lean: bool = False) -> dict[str, torch.Tensor]:
        """The per-program activations (kept between launches of the same size). ``wide`` = ``(k_pad, m)`` for the
        wide kernel: the inputs ``[pairs, k_pad]`` and room for both ``∂W1`` (``m`` rows) and ``∂W2``. ``lean``
        (``KernelConfig(scratch="lean")``): inputs in rows of :func:`input_columns`, the weight gradients in
        ``dtype``, and no room for the activations (one element stands in, never read)."""
        k_pad, m = wide
        shape = (programs, pairs, h1, h2, dtype, wide, lean)
        if self._scratch.get("shape") != shape:
            device = self.navigator.flat.device

            def room(*size: int, kept: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
                return torch.empty(size if kept else (1,), device=device, dtype=dtype)

            self._scratch = {"shape": shape,  # type: ignore[dict-item]
                             "h1": room(programs, pairs, h1, kept=not lean, dtype=dtype),
                             "h2": room(programs, pairs, h2, kept=not lean, dtype=dtype),
                             "logits": room(programs, pairs),
                             "grad": room(programs, pairs),
                             "dw": room(programs, m * h1 + h1 * h2, dtype=dtype if lean else torch.float32)}
            if k_pad:
                self._scratch["x0"] = room(programs, pairs, input_columns(m, lean), dtype=dtype)
        return self._scratch


#: Tasks whose pair costs are computed at once: the ``[tasks, Q·N, m]`` squared differences behind them are the
#: largest tensor of the other engines (1.2 GB for 10,000 tasks at 1 shot), and the kernel needs only the costs.
COST_CHUNK = 512


def pair_costs(query: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """The costs ``c_jk = ‖x_j − μ_k‖²`` ``[T, Q, N]`` of :func:`.step.pair_inputs`, computed :data:`COST_CHUNK`
    tasks at a time: the same values (bit for bit on a CPU, where it is tested; a GPU's reduction may sum in
    another order for another batch size, a rounding difference)."""
    return torch.cat([pair_inputs(query[start:start + COST_CHUNK], prototypes[start:start + COST_CHUNK])[1]
                      for start in range(0, query.shape[0], COST_CHUNK)])


_NOTICED: set[str] = set()


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
