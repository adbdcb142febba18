"""The E-step engines: ``inner_steps`` Adam steps of every task's navigator on the CT loss (paper §3, Algorithm 1).

The EM loop (:mod:`.em`) talks to an engine through :class:`Engine` only; ``putm.solver`` picks it
(:mod:`.solvers`; ``auto``, the default, is ``triton`` on sm_90 GPUs such as the H100, ``compiled`` on other CUDA
devices and ``fused`` elsewhere):

* :class:`FusedTrainer` (``fused``): :func:`.step.navigator_step` (hand-written backward of the navigator MLP
  and of the CT loss) into preallocated buffers, and one :class:`.adam.StackedAdam` update over the flat buffer
  of all stacked per-task weights. It replays exactly the floating-point operations that autograd and
  ``torch.optim.Adam`` perform, so in fp32 on CPU its results are bit-identical to the ``autograd`` engine.
  (Bit-identity is a CPU statement: on a GPU, cuBLAS and the reduction kernels may choose different
  algorithms by shape, so engines and batch sizes agree to float rounding there.)
* :class:`~.compiled.CompiledTrainer` (``compiled``): the same step function compiled, Adam's step count on the
  device, CUDA-graph replay of the inner steps; agrees with ``fused`` to float rounding, not bit-for-bit.
* :class:`AutogradTrainer` (``autograd``): the plain formulation (autograd + ``torch.optim.Adam``), kept as
  the executable specification.
* :class:`~.triton_engine.TritonTrainer` (``triton``): the whole E-step of each task in one fused Triton kernel
  (CUDA; Triton's interpreter on CPU for tests); agrees with ``fused`` to float rounding.

All return ``(π_f, π_b)`` of the last Adam step, computed before that step's update, like the reference
code (github.com/RashLog/PUTM).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from lightning_putm.methods.putm.adam import StackedAdam
from lightning_putm.methods.putm.loss import ct_loss
from lightning_putm.methods.putm.navigator import Navigator, select_tasks
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.methods.putm.step import StepBuffers, navigator_step, pair_inputs
from lightning_putm.signals import check_stop


class Engine:
    """What the EM loop uses of an E-step engine: the E-step, the re-draw, task selection, a snapshot.

    ``fixed_batch`` is the engine's way of letting finished tasks go (early stopping): ``False``, the loop
    :meth:`select` s the tasks still running and the batch shrinks; ``True`` (an engine whose speed needs fixed
    shapes, e.g. a CUDA graph), the batch stays whole and the loop freezes finished tasks instead.
    """

    navigator: Navigator
    settings: PUTMSettings
    compute_dtype: torch.dtype
    fixed_batch = False

    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The E-step: ``inner_steps`` Adam steps on the CT loss; ``(π_f, π_b)`` of the last step, pre-update."""
        raise NotImplementedError

    def reinit(self, generators: list[torch.Generator]) -> None:
        """A new navigator (Algorithm 1's re-draw) and fresh Adam state."""
        raise NotImplementedError

    def select(self, index: torch.Tensor) -> Engine:
        """An engine for tasks ``index`` only, with their weights and Adam state (a copy)."""
        raise NotImplementedError

    def snapshot(self) -> torch.Tensor:
        """A copy of the flat navigator buffer (inspection)."""
        return self.navigator.flat.detach().clone()

    def keep_only(self, live: torch.Tensor) -> None:
        """``fixed_batch`` engines: only tasks ``live`` (``[T]`` bool) still need results; an engine may skip the
        others (their rows are ignored). Default: every task runs."""

    def whole_em_loop(self, rows: torch.Tensor, one_hot: torch.Tensor, prototypes: torch.Tensor, ways: int,
                      progress: Callable[[Iterable[int]], Iterable[int]] = iter,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The whole EM loop run by the engine itself (:func:`.em.em_loop`'s arguments and result), where it can
        run it without the host between E-steps; ``None`` (the default): :func:`.em.em_loop` drives the E-steps."""
        return None


class FusedTrainer(Engine):
    """The E-step as :func:`.step.navigator_step` into preallocated buffers + :class:`StackedAdam` (``solver=fused``).

    With a ``compute_dtype`` of bfloat16 the products run in bf16 on casts of the float32 master weights.
    """

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> None:
        self.navigator, self.settings, self.compute_dtype = navigator, settings, compute_dtype
        self.adam = StackedAdam(navigator.flat, settings.lr, settings.adam_betas)
        self.buffers: StepBuffers | None = None  # made for the number of pairs of the first E-step

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient of the last Adam step (laid out like ``navigator.flat``)."""
        assert self.buffers is not None, "no E-step has run yet"
        return self.buffers.grad

    def select(self, index: torch.Tensor) -> FusedTrainer:
        chosen = FusedTrainer(self.navigator.select(index), self.settings, self.compute_dtype)
        chosen.adam.exp_avg.copy_(select_tasks(self.navigator, self.adam.exp_avg, index))
        chosen.adam.exp_avg_sq.copy_(select_tasks(self.navigator, self.adam.exp_avg_sq, index))
        chosen.adam.steps = self.adam.steps
        return chosen

    def reinit(self, generators: list[torch.Generator]) -> None:
        self.navigator.redraw(generators)
        self.adam.reset()

    @torch.no_grad()
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, nav = self.settings, self.navigator
        squared, cost = pair_inputs(query, prototypes)
        inputs = squared.to(self.compute_dtype)
        if self.buffers is None or self.buffers.pairs != inputs.shape[1]:
            self.buffers = StepBuffers.new(nav, inputs.shape[1], self.compute_dtype)
        forward = backward = cost
        for _ in range(s.inner_steps):
            check_stop()  # a chunk's E-step can take seconds (max_chunk_tasks): stop between Adam steps
            forward, backward, grad = navigator_step(inputs, cost, nav.stored, nav.biases, nav.widths[-1],
                                                     s.negative_slope, s.rho, s.theta, self.compute_dtype,
                                                     self.buffers)
            self.adam.step(grad)
        return forward, backward


class AutogradTrainer(Engine):
    """The E-step with autograd and ``torch.optim.Adam``: the executable specification of the E-step."""

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> None:
        self.navigator, self.settings, self.compute_dtype = navigator, settings, compute_dtype
        self.optimiser = self.new_optimiser()

    def new_optimiser(self) -> torch.optim.Adam:
        return torch.optim.Adam(self.navigator.parameters(), lr=self.settings.lr, betas=self.settings.adam_betas)

    def reinit(self, generators: list[torch.Generator]) -> None:
        self.navigator.redraw(generators)
        self.optimiser = self.new_optimiser()

    def select(self, index: torch.Tensor) -> AutogradTrainer:
        chosen = AutogradTrainer(self.navigator.select(index), self.settings, self.compute_dtype)
        for old, new in zip(self.navigator.parameters(), chosen.navigator.parameters()):
            state = self.optimiser.state.get(old)
            if state:
                chosen.optimiser.state[new] = {key: value.clone() if key == "step" else value.index_select(0, index)
                                               for key, value in state.items()}
        return chosen

    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        return e_step_autograd(self.navigator, self.optimiser, query, prototypes, ways, self.settings,
                               self.compute_dtype)


def e_step_autograd(navigator: Navigator, optimiser: torch.optim.Optimizer, query: torch.Tensor,
                    prototypes: torch.Tensor, ways: int, settings: PUTMSettings,
                    compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``inner_steps`` Adam steps on the CT loss; returns ``(π_f, π_b)`` of the last step, pre-update."""
    t, q, _ = query.shape
    inputs, cost = pair_inputs(query, prototypes)
    forward = backward = cost
    low = compute_dtype != query.dtype
    for _ in range(settings.inner_steps):
        check_stop()
        optimiser.zero_grad(set_to_none=True)
        with torch.enable_grad():
            with torch.autocast(query.device.type, dtype=compute_dtype, enabled=low):
                outputs = navigator(inputs)
            logits = -outputs.float().view(t, q, ways)
            forward = torch.softmax(logits, dim=2)
            backward = torch.softmax(logits, dim=1)
            loss = ct_loss(cost, forward, backward, settings.rho, settings.theta)
            loss.sum().backward()
        optimiser.step()
    return forward.detach(), backward.detach()
