"""The E-step engines: ``inner_steps`` Adam steps of every task's navigator on the CT loss (paper §3, Algorithm 1).

The EM loop (:mod:`.em`, :mod:`.em_routing`) and the chunk planner (:mod:`.plumbing`) talk to an engine through
:class:`Engine` only; ``putm.solver`` picks it (:func:`.solvers.make_engine`; ``auto``, the default, is ``triton``
on sm_90 GPUs such as the H100, ``compiled`` on other CUDA devices and ``fused`` elsewhere):

* :class:`FusedEngine` (``fused``): :func:`.step.navigator_step` (hand-written backward of the navigator MLP
  and of the CT loss) into preallocated buffers, and one :class:`.adam.StackedAdam` update over the flat buffer
  of all stacked per-task weights. It replays exactly the floating-point operations that autograd and
  ``torch.optim.Adam`` perform, so in fp32 on CPU its results are bit-identical to the ``autograd`` engine.
  (Bit-identity is a CPU statement: on a GPU, cuBLAS and the reduction kernels may choose different
  algorithms by shape, so engines and batch sizes agree to float rounding there.)
* :class:`~.compiled.CompiledEngine` (``compiled``): the same step function compiled, Adam's step count on the
  device, CUDA-graph replay of the inner steps; agrees with ``fused`` to float rounding, not bit-for-bit.
* :class:`AutogradEngine` (``autograd``): the plain formulation (autograd + ``torch.optim.Adam``), kept as
  the executable specification.
* :class:`~.triton_engine.TritonEngine` (``triton``): the whole E-step of each task in one fused Triton kernel
  (CUDA; Triton's interpreter on CPU for tests); agrees with ``fused`` to float rounding.
* :class:`~.hopper.launch.HopperEngine` (``hopper``): the whole E-step of each task in one CUDA C++ kernel for
  H100/H200 GPUs (sm_90), bf16 products; not yet run on a GPU, never chosen by ``auto``. Its arithmetic is replayed
  on any device by :class:`~.hopper.emulate.EmulatedEngine` (tests).

All return ``(π_f, π_b)`` of the last Adam step, computed before that step's update, like the reference
code (github.com/RashLog/PUTM).
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar, Iterable

import torch

from lightning_putm.methods.putm.adam import StackedAdam
from lightning_putm.methods.putm.loss import ct_loss
from lightning_putm.methods.putm.navigator import Navigator, select_tasks
from lightning_putm.methods.putm.settings import GEMM_MIN_WIDTH, PUTMSettings
from lightning_putm.methods.putm.step import StepBuffers, navigator_step, pair_inputs
from lightning_putm.signals import check_stop


class Engine(abc.ABC):
    """An E-step engine for a chunk of tasks: the navigators of all tasks (``navigator``, one flat buffer whose
    weights the engine trains in place), the method's ``settings`` and the arithmetic of the navigator's products
    (``compute_dtype``). Its members are what the EM loop and the chunk planner need of it, no more:

    * :meth:`run`, the E-step, and :meth:`reinit`, Algorithm 1's re-draw: every engine implements both;
    * how tasks that settled early (``early_stop_tol``) leave, by :attr:`fixed_batch`: the batch shrinks to
      :meth:`select` ed copies (an engine whose batch is not fixed implements it), or stays whole and the engine
      is told which tasks still need results (:meth:`keep_only`, which it may use to skip the others);
    * :meth:`whole_em_loop`: where an engine can run the whole EM loop without the host (``None``: it cannot);
    * :meth:`bytes_per_task`: its working memory per task, by which the chunks are sized;
    * :meth:`unsupported`: tasks it cannot take (by default none), refused before any work;
    * :meth:`build`: how :func:`.solvers.make_engine` constructs it (told whether ``solver=auto`` chose it).

    A new engine is a module with a subclass (``run``, ``reinit``, ``bytes_per_task``; ``select`` unless its batch is
    fixed) and one line in :data:`.settings.ENGINES`, which names it as a ``solver`` value.
    """

    #: ``False``: tasks that settled leave the batch (the loop :meth:`select` s the rest, the batch shrinks);
    #: ``True``: the batch keeps its shapes (an engine whose speed needs them, e.g. a CUDA graph) and the loop calls
    #: :meth:`keep_only` instead.
    fixed_batch: ClassVar[bool] = False

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> None:
        self.navigator, self.settings, self.compute_dtype = navigator, settings, compute_dtype

    @classmethod
    def build(cls, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype,
              chosen_by_auto: bool = False) -> Engine:
        """The engine for ``settings.solver`` (already resolved). ``chosen_by_auto``: the user asked for
        ``solver=auto``, so an engine that may fail on some machines can hand over to another instead of raising
        (the ``triton`` engine does); by default it is ignored."""
        return cls(navigator, settings, compute_dtype)

    @classmethod
    @abc.abstractmethod
    def bytes_per_task(cls, pairs: int, m: int, settings: PUTMSettings) -> int:
        """Bytes one task's E-step holds at once for ``pairs`` (query, prototype) pairs in a basis of ``m`` columns
        (:meth:`.plumbing.ChunkedSolver.bytes_per_task` adds the preprocessing's rows)."""

    @abc.abstractmethod
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The E-step: ``inner_steps`` Adam steps on the CT loss; ``(π_f, π_b)`` of the last step, pre-update."""

    @abc.abstractmethod
    def reinit(self, generators: list[torch.Generator]) -> None:
        """A new navigator (Algorithm 1's re-draw) and fresh Adam state."""

    @classmethod
    def unsupported(cls, queries: int, ways: int, m: int, settings: PUTMSettings) -> str | None:
        """Why this engine cannot take tasks of ``queries`` × ``ways`` pairs in a basis of ``m`` columns with
        ``settings``: one line naming the key and the fix, which the method raises before any work; ``None`` (the
        default): it takes any."""
        return None

    def select(self, index: torch.Tensor) -> Engine:
        """An engine for tasks ``index`` only, with their weights and Adam state (a copy): how tasks leave a batch
        that is not fixed."""
        raise NotImplementedError(f"{type(self).__name__}.select: an engine whose batch is not fixed must implement it")

    def keep_only(self, live: torch.Tensor) -> None:
        """Only tasks ``live`` (``[T]`` bool) still need results: how tasks leave a fixed batch. The engine may skip
        the others, whose rows the loop ignores; by default every task runs on."""

    def whole_em_loop(self, rows: torch.Tensor, one_hot: torch.Tensor, prototypes: torch.Tensor, ways: int,
                      progress: Callable[[Iterable[int]], Iterable[int]] = iter,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The whole EM loop run by the engine itself (:func:`.em.em_loop`'s arguments and result), where it can
        run it without the host between E-steps; ``None`` (the default): :func:`.em.em_loop` drives the E-steps."""
        return None


class FusedEngine(Engine):
    """The E-step as :func:`.step.navigator_step` into preallocated buffers + :class:`StackedAdam` (``solver=fused``).

    With a ``compute_dtype`` of bfloat16 the products run in bf16 on casts of the float32 master weights.
    """

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> None:
        super().__init__(navigator, settings, compute_dtype)
        self.adam = StackedAdam(navigator.flat, settings.lr, settings.adam_betas)
        self.buffers: StepBuffers | None = None  # made for the number of pairs of the first E-step

    @classmethod
    def bytes_per_task(cls, pairs: int, m: int, settings: PUTMSettings) -> int:
        """The squared differences, the activations and their gradients, the padded output and its gradient, the CT
        head; the flat parameters, their gradient and Adam's two moments (and its denominator)."""
        hidden = sum(settings.hidden)
        params = Navigator.numel([m, *settings.hidden, 1], 1)
        return 4 * (pairs * (m + 2 * hidden + 2 * GEMM_MIN_WIDTH + 16) + 5 * params)

    @property
    def grad(self) -> torch.Tensor:
        """The flat gradient of the last Adam step (laid out like ``navigator.flat``)."""
        assert self.buffers is not None, "no E-step has run yet"
        return self.buffers.grad

    def select(self, index: torch.Tensor) -> FusedEngine:
        chosen = FusedEngine(self.navigator.select(index), self.settings, self.compute_dtype)
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


class AutogradEngine(Engine):
    """The E-step with autograd and ``torch.optim.Adam``: the executable specification of the E-step."""

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> None:
        super().__init__(navigator, settings, compute_dtype)
        self.optimiser = self.new_optimiser()

    @classmethod
    def bytes_per_task(cls, pairs: int, m: int, settings: PUTMSettings) -> int:
        """The squared differences and each layer's activations saved for the backward, with their gradients."""
        return 4 * pairs * (2 * m + 5 * sum(settings.hidden) + 8)

    def new_optimiser(self) -> torch.optim.Adam:
        return torch.optim.Adam(self.navigator.parameters(), lr=self.settings.lr, betas=self.settings.adam_betas)

    def reinit(self, generators: list[torch.Generator]) -> None:
        self.navigator.redraw(generators)
        self.optimiser = self.new_optimiser()

    def select(self, index: torch.Tensor) -> AutogradEngine:
        chosen = AutogradEngine(self.navigator.select(index), self.settings, self.compute_dtype)
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
