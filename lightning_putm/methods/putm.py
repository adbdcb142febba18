"""PUTM: prototypes-oriented transductive few-shot learning with conditional transport.

Tian et al., "Prototypes-oriented Transductive Few-shot Learning with Conditional Transport", ICCV 2023
(arXiv 2308.03047). Re-implemented from the paper and DESIGN.md §3; all tasks of a batch are solved at
once as stacked tensors ``[T, ...]`` on the input's device, with no Python loop over tasks or pairs.

The CT-EM loop:

1. Preprocess each task: power transform β, QR reduction to the task's own basis, L2 normalisation.
2. Prototypes start at the support class means.
3. E-step: a per-task navigator MLP maps each (query j, class k) pair's squared difference
   ``(μ_k − x_j)²`` to a logit ``d_jk``; the forward navigator ``π_f(k|j)`` is a softmax over classes, the
   backward navigator ``π_b(j|k)`` a softmax over queries. Adam minimises the conditional-transport cost
   ``ρ·mean_j Σ_k c_jk π_f + (1−ρ)·mean_k Σ_j c_jk π_b`` (``c_jk = ‖x_j − μ_k‖²``, constant), plus an
   optional balance term weighted by θ. Navigator weights and Adam state persist across EM steps as in
   the reference code, or are re-drawn every EM step as in the paper's Algorithm 1
   (``reinit_navigator=True``).
4. M-step: the weighted mean of support (one-hot) and query rows (weights π_f) gives μ̂; inertia
   ``μ ← μ + a(μ̂ − μ)``.
5. After the EM steps one more E-step; the prediction is ``argmax_k π_f(k|j)``.

Two interchangeable E-step engines (``solver``):

* ``fused`` (default): a hand-written backward of the navigator MLP and the CT loss, written into one flat
  gradient buffer, and one Adam update over the flat buffer of all stacked per-task weights. It replays
  exactly the floating-point operations that autograd and ``torch.optim.Adam`` perform (same kernels, same
  operand order), so in fp32 on CPU its results are bit-identical to the ``autograd`` engine
  (tests/test_putm_speed_options.py), with about half the memory traffic and no per-step allocations.
* ``autograd``: the plain formulation (autograd + ``torch.optim.Adam``), kept as the executable
  specification.

``precision`` selects the matrix products: ``fp32`` (exact float32, TF32 off), ``tf32`` (TF32 allowed on
CUDA; identical to fp32 on CPU), ``bf16`` (bfloat16 navigator products with float32 master weights, Adam
and CT loss), or ``auto`` (default): bf16 where the hardware multiplies bf16 natively, else fp32
(:func:`resolve_precision`; the measured accuracy/speed effect is in conf/method/putm.yaml).

Optional ``early_stop_tol`` ends a task's EM loop once its prototypes stop moving; settled tasks get their
final E-step and leave the batch, so results never depend on chunking.

On CPU with several threads, each chunk is shared out among ``cpu_workers`` Python threads, each running
single-threaded kernels (:meth:`PUTM.predict`): no OpenMP barrier per kernel, which on a busy machine cost up
to 4x, and results that do not depend on the number of cores.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.preprocessing import l2_normalise, power_transform
from lightning_putm.tasks import TaskBatch, weighted_class_means

PROTOTYPE_UPDATES = ("forward", "backward", "mixed")
SOLVERS = ("fused", "autograd")
PRECISIONS = ("auto", "fp32", "tf32", "bf16")
GEMM_MIN_WIDTH = 8
ADAM_EPS = 1e-8
#: Largest chunk on CPU. Measured (fused fp32 engine, 5-way 1-shot, d = 640, one thread, CPU time per Adam
#: step and task on a 2-core AMD EPYC Zen 4): 0.60 ms at 8 tasks per chunk, 0.62 at 16, 0.64 at 32, 0.69 at
#: 64 and 128: beyond ~32 tasks the activations (~0.7 MB per task) no longer stay in cache; below ~8 the
#: Python work per step starts to show. GPUs are limited by the memory budget only.
CPU_MAX_CHUNK_TASKS = 16


@dataclass(frozen=True)
class PUTMSettings:
    """Resolved hyper-parameters (DESIGN §3 defaults; ``None`` in the config means 'by setting')."""

    beta: float = 0.6
    rho: float = 0.5
    theta: float = 0.0
    inertia: float = 0.2
    inner_steps: int = 30
    em_steps: int = 50
    lr: float = 1e-3
    adam_betas: tuple[float, float] = (0.5, 0.99)
    hidden: tuple[int, ...] = (128, 64)
    init_tasks: int = 1000
    reinit_navigator: bool = False
    prototype_update: str = "forward"
    canonical_query_order: bool = True
    negative_slope: float = 0.01
    solver: str = "fused"
    precision: str = "auto"
    early_stop_tol: float | None = None
    max_chunk_tasks: int | None = None
    cpu_workers: int | None = None


class Navigator:
    """Per-task MLP ``m → hidden… → 1`` with LeakyReLU, its weights stacked as ``[T, in, out]``.

    Weights are drawn per task from the task's own seed with the reference's Xavier-normal scale for a
    stacked tensor, ``std = sqrt(2 / (out · (in + T_init)))``, where ``T_init`` is fixed (default 1000,
    the batch size behind the published numbers) so results never depend on chunking. Biases start at 0.

    All parameters live in one flat buffer :attr:`flat` (weights of every layer, then biases), so one
    elementwise Adam update covers them. A layer narrower than ``GEMM_MIN_WIDTH`` is stored zero-padded to
    that width (:attr:`stored`); :attr:`weights` are views of the true widths.
    """

    def __init__(self, widths: list[int], generators: list[torch.Generator], init_tasks: int,
                 device: torch.device, dtype: torch.dtype, negative_slope: float, requires_grad: bool = True) -> None:
        self.widths = widths
        self.init_tasks = init_tasks
        self.negative_slope = negative_slope
        self.num_tasks = len(generators)
        self.flat = torch.zeros(self.numel(widths, self.num_tasks), device=device, dtype=dtype)
        self.stored, self.biases = self.views(self.flat)
        self.weights = [w[:, :, :fan_out] for w, fan_out in zip(self.stored, widths[1:])]
        self.redraw(generators)
        if requires_grad:
            for p in self.parameters():
                p.requires_grad_(True)

    @staticmethod
    def stored_width(width: int) -> int:
        return max(width, GEMM_MIN_WIDTH)

    @classmethod
    def numel(cls, widths: list[int], num_tasks: int) -> int:
        weights = sum(i * cls.stored_width(o) for i, o in zip(widths[:-1], widths[1:]))
        return num_tasks * (weights + sum(widths[1:]))

    def views(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Split a buffer laid out like :attr:`flat` into stored weights ``[T, in, out']`` and biases ``[T, 1, out]``."""
        t = self.num_tasks
        sizes = [t * i * self.stored_width(o) for i, o in zip(self.widths[:-1], self.widths[1:])]
        sizes += [t * o for o in self.widths[1:]]
        parts = list(flat.split(sizes))
        layers = len(self.widths) - 1
        weights = [parts[k].view(t, self.widths[k], self.stored_width(self.widths[k + 1])) for k in range(layers)]
        biases = [parts[layers + k].view(t, 1, self.widths[k + 1]) for k in range(layers)]
        return weights, biases

    def parameters(self) -> list[torch.Tensor]:
        return [*self.weights, *self.biases]

    @torch.no_grad()
    def redraw(self, generators: list[torch.Generator]) -> None:
        for w, b in zip(self.weights, self.biases):
            _, fan_in, fan_out = w.shape
            std = math.sqrt(2.0 / (fan_out * (fan_in + self.init_tasks)))
            draws = torch.stack([torch.randn(fan_in, fan_out, generator=g) for g in generators])
            w.copy_(draws.mul_(std))
            b.zero_()

    @torch.no_grad()
    def select(self, index: torch.Tensor) -> Navigator:
        """The navigators of tasks ``index`` (a copy)."""
        chosen = object.__new__(Navigator)
        chosen.widths, chosen.init_tasks, chosen.negative_slope = self.widths, self.init_tasks, self.negative_slope
        chosen.num_tasks = len(index)
        chosen.flat = select_tasks(self, self.flat, index)
        chosen.stored, chosen.biases = chosen.views(chosen.flat)
        chosen.weights = [w[:, :, :fan_out] for w, fan_out in zip(chosen.stored, self.widths[1:])]
        if self.weights[0].requires_grad:
            for p in chosen.parameters():
                p.requires_grad_(True)
        return chosen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if w.shape[2] < GEMM_MIN_WIDTH:
                # A width-1 output would take BLAS's GEMV path, whose rounding depends on the batch size
                # (and Adam amplifies it); zero-padding the width keeps it on the GEMM path, so a task's
                # result is bit-identical alone or in a batch (tests/test_putm.py checks this).
                padded = F.pad(w, (0, GEMM_MIN_WIDTH - w.shape[2]))
                x = torch.bmm(x, padded)[:, :, : w.shape[2]] + b
            else:
                x = torch.baddbmm(b, x, w)
            if i < last:
                x = F.leaky_relu(x, self.negative_slope)
        return x


def select_tasks(navigator: Navigator, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of every per-task segment of a buffer laid out like ``navigator.flat``."""
    weights, biases = navigator.views(flat)
    return torch.cat([part.index_select(0, index).flatten() for part in [*weights, *biases]])


class StackedAdam:
    """``torch.optim.Adam`` (its default single-tensor CPU algorithm) on one flat parameter buffer.

    Same operations in the same order as ``torch.optim.Adam(lr, betas, eps=1e-8)`` without weight decay
    or AMSGrad, so each element follows bit-for-bit the update torch would give it; one kernel per
    operation covers every layer of every task. All tasks share the step count.
    """

    def __init__(self, params: torch.Tensor, lr: float, betas: tuple[float, float], eps: float = ADAM_EPS) -> None:
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.exp_avg = torch.zeros_like(params)
        self.exp_avg_sq = torch.zeros_like(params)
        self.denom = torch.empty_like(params)
        self.steps = 0

    def reset(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.steps = 0

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        beta1, beta2 = self.betas
        self.steps += 1
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** float(self.steps)
        bias_correction2 = 1 - beta2 ** float(self.steps)
        torch.sqrt(self.exp_avg_sq, out=self.denom)
        self.denom.div_(bias_correction2**0.5).add_(self.eps)
        self.params.addcdiv_(self.exp_avg, self.denom, value=-(self.lr / bias_correction1))


def ct_loss_gradient(cost: torch.Tensor, logits: torch.Tensor, rho: float,
                     theta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(π_f, π_b, ∂ΣL/∂logits)`` of :func:`ct_loss` summed over tasks, all ``[T, Q, N]``.

    Written out by hand with exactly the operations autograd performs for ``ct_loss(...).sum().backward()``
    (mean → expand then divide; softmax backward via ``_softmax_backward_data``), hence bit-identical to it.
    """
    t, q, n = cost.shape
    forward = torch.softmax(logits, dim=2)
    backward = torch.softmax(logits, dim=1)
    seed = torch.ones(t, dtype=cost.dtype, device=cost.device)
    transport_seed = seed if theta == 0 else seed * (1 - theta)
    grad_forward = (transport_seed * rho).unsqueeze(1).expand(t, q).div(q).unsqueeze(2).expand(t, q, n) * cost
    grad_backward = (transport_seed * (1 - rho)).unsqueeze(1).expand(t, n).div(n).unsqueeze(1).expand(t, q, n) * cost
    if theta != 0:
        balance = (rho * forward + (1 - rho) * backward).sum(1)
        slope = (seed * theta).unsqueeze(1).expand(t, n).div(n) * (2.0 * (balance - 1.0 / n).pow(1.0))
        slope = slope.unsqueeze(1).expand(t, q, n)
        grad_forward = grad_forward + slope * rho
        grad_backward = grad_backward + slope * (1 - rho)
    grad = (torch._softmax_backward_data(grad_forward, forward, 2, cost.dtype)
            + torch._softmax_backward_data(grad_backward, backward, 1, cost.dtype))
    return forward, backward, grad


class FusedTrainer:
    """The E-step's Adam loop (DESIGN §3 steps 3–5) with a hand-written navigator backward.

    Per Adam step: forward through the stacked MLP into preallocated activations (LeakyReLU in place), the
    CT-loss gradient w.r.t. the logits (:func:`ct_loss_gradient`), the backward pass written straight into
    a flat gradient buffer shaped like ``navigator.flat``, and one :class:`StackedAdam` update. The
    operations replay autograd's (bmm with the same operand order; the LeakyReLU mask taken from the
    output, whose sign equals the input's), so the fp32 results equal the ``autograd`` engine's. With a
    ``compute_dtype`` of bfloat16 the products run in bf16 on casts of the float32 master weights.
    """

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> None:
        self.navigator = navigator
        self.settings = settings
        self.compute_dtype = compute_dtype
        self.adam = StackedAdam(navigator.flat, settings.lr, settings.adam_betas)
        self.grad = torch.zeros_like(navigator.flat)
        _, self.grad_biases = navigator.views(self.grad)  # bias sums are always accumulated in float32
        # weight products write here; with a lower compute type they are copied into ``grad`` afterwards
        self.low_grad = self.grad if compute_dtype == self.grad.dtype else torch.zeros_like(self.grad, dtype=compute_dtype)
        self.grad_weights, _ = navigator.views(self.low_grad)
        self.weights_numel = sum(w.numel() for w in self.grad_weights)  # weights come first in the flat layout
        self._workspace: dict[str, torch.Tensor] = {}

    def select(self, index: torch.Tensor) -> FusedTrainer:
        """A trainer for tasks ``index`` only, with their weights and Adam state (a copy)."""
        chosen = FusedTrainer(self.navigator.select(index), self.settings, self.compute_dtype)
        chosen.adam.exp_avg.copy_(select_tasks(self.navigator, self.adam.exp_avg, index))
        chosen.adam.exp_avg_sq.copy_(select_tasks(self.navigator, self.adam.exp_avg_sq, index))
        chosen.adam.steps = self.adam.steps
        return chosen

    def reinit(self, generators: list[torch.Generator]) -> None:
        self.navigator.redraw(generators)
        self.adam.reset()

    def workspace(self, pairs: int) -> dict[str, torch.Tensor]:
        """Activations ``act{i}``, their gradients ``grad{i}``, the padded last output ``out`` and its gradient."""
        t, hidden = self.navigator.num_tasks, self.navigator.widths[1:-1]
        last = Navigator.stored_width(self.navigator.widths[-1])
        if self._workspace.get("out") is None or self._workspace["out"].shape[1] != pairs:
            options = dict(device=self.navigator.flat.device, dtype=self.compute_dtype)
            self._workspace = {"out": torch.empty(t, pairs, last, **options),
                               "grad_out": torch.zeros(t, pairs, last, **options)}
            for i, width in enumerate(hidden):
                self._workspace[f"act{i}"] = torch.empty(t, pairs, width, **options)
                self._workspace[f"grad{i}"] = torch.empty(t, pairs, width, **options)
        return self._workspace

    @torch.no_grad()
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``inner_steps`` Adam steps on the CT loss; returns ``(π_f, π_b)`` of the last step, pre-update."""
        s = self.settings
        t, q, m = query.shape
        squared = (query.unsqueeze(2) - prototypes.unsqueeze(1)).pow(2)  # [T, Q, N, m]
        cost = squared.sum(-1)  # [T, Q, N]
        inputs = squared.reshape(t, q * ways, m).to(self.compute_dtype)
        work = self.workspace(q * ways)
        forward = backward = cost
        for _ in range(s.inner_steps):
            weights = [w.to(self.compute_dtype) for w in self.navigator.stored]  # no copy in float32
            biases = [b.to(self.compute_dtype) for b in self.navigator.biases[:-1]]
            logits = -self.forward(inputs, weights, biases, work).view(t, q, ways)
            forward, backward, grad_logits = ct_loss_gradient(cost, logits, s.rho, s.theta)
            self.backward(inputs, weights, grad_logits.neg().view(t, q * ways, 1), work)
            self.adam.step(self.grad)
        return forward, backward

    def forward(self, inputs: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                work: dict[str, torch.Tensor]) -> torch.Tensor:
        """Navigator outputs ``[T, P, 1]`` (float32, last bias in float32); hidden activations stay in ``work``."""
        x = inputs
        for i in range(len(weights) - 1):
            x = torch.baddbmm(biases[i], x, weights[i], out=work[f"act{i}"])
            F.leaky_relu_(x, self.settings.negative_slope)
        out = torch.bmm(x, weights[-1], out=work["out"])
        return out[:, :, : self.navigator.widths[-1]].float() + self.navigator.biases[-1]

    def backward(self, inputs: torch.Tensor, weights: list[torch.Tensor], grad_out: torch.Tensor,
                 work: dict[str, torch.Tensor]) -> None:
        """Gradients of the navigator parameters into :attr:`grad`, given ``∂ΣL/∂outputs`` ``[T, P, 1]``."""
        layers = len(weights)
        slope = self.settings.negative_slope
        self._bias_gradient(grad_out, layers - 1)
        grad = work["grad_out"]
        grad[:, :, : grad_out.shape[2]].copy_(grad_out)
        for i in range(layers - 1, -1, -1):
            below = inputs if i == 0 else work[f"act{i - 1}"]
            torch.bmm(below.transpose(1, 2), grad, out=self.grad_weights[i])
            if i > 0:
                grad_below = torch.bmm(grad, weights[i].transpose(1, 2), out=work[f"grad{i - 1}"])
                torch.ops.aten.leaky_relu_backward.grad_input(grad_below, below, slope, False, grad_input=grad_below)
                self._bias_gradient(grad_below, i - 1)
                grad = grad_below
        if self.low_grad is not self.grad:
            self.grad[: self.weights_numel].copy_(self.low_grad[: self.weights_numel])

    def _bias_gradient(self, grad: torch.Tensor, layer: int) -> None:
        """Bias gradient: the sum over pairs (autograd's ``sum_to_size`` of the broadcast bias), in float32."""
        out = self.grad_biases[layer]
        if grad.dtype == out.dtype:
            torch.sum(grad, 1, keepdim=True, out=out)
        else:
            torch.sum(grad, 1, keepdim=True, dtype=out.dtype, out=out)


class AutogradTrainer:
    """The E-step with autograd and ``torch.optim.Adam``: the executable specification of DESIGN §3 step 5."""

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype) -> None:
        self.navigator, self.settings, self.compute_dtype = navigator, settings, compute_dtype
        self.optimiser = self.new_optimiser()

    def new_optimiser(self) -> torch.optim.Adam:
        return torch.optim.Adam(self.navigator.parameters(), lr=self.settings.lr, betas=self.settings.adam_betas)

    def reinit(self, generators: list[torch.Generator]) -> None:
        self.navigator.redraw(generators)
        self.optimiser = self.new_optimiser()

    def select(self, index: torch.Tensor) -> AutogradTrainer:
        """A trainer for tasks ``index`` only, with their weights and Adam state (a copy)."""
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
    t, q, m = query.shape
    squared = (query.unsqueeze(2) - prototypes.unsqueeze(1)).pow(2)  # [T, Q, N, m]
    cost = squared.sum(-1)  # [T, Q, N]
    inputs = squared.reshape(t, q * ways, m)
    forward = backward = cost
    low = compute_dtype != query.dtype
    for _ in range(settings.inner_steps):
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


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` → ``bf16`` where bf16 products are native and fast, else ``fp32``; other values unchanged.

    Native: CUDA devices of compute capability 8.0 or newer (bf16 tensor cores), CPUs with AVX512-BF16 or
    AMX. On a 2-core AMD EPYC (Zen 4, AVX512-BF16) bf16 made the solver 1.65x faster at -0.03 accuracy
    points over 1000 tasks (conf/method/putm.yaml); without native support bf16 would be emulated (slow).
    """
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp32"
    if device.type == "cpu":
        native = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        return "bf16" if any(check is not None and check() for check in native) else "fp32"
    return "fp32"


@contextlib.contextmanager
def matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    """float32 products exact (``fp32``, and ``tf32`` off CUDA) or TF32 on CUDA (``tf32``), restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" and device.type == "cuda" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class PUTM(FewShotMethod):
    """The CT-EM solver of PUTM (DESIGN §3), batched over tasks."""

    name = "putm"

    def __init__(
        self,
        shots: int,
        balanced: bool,
        beta: float = 0.6,
        rho: float | None = None,
        theta: float | None = None,
        inertia: float | None = None,
        inertia_one_shot: float = 0.2,
        inertia_few_shot: float = 0.1,
        inner_steps: int = 30,
        em_steps: int = 50,
        lr: float = 1e-3,
        adam_betas: tuple[float, float] | list[float] = (0.5, 0.99),
        hidden: tuple[int, ...] | list[int] = (128, 64),
        init_tasks: int = 1000,
        reinit_navigator: bool = False,
        prototype_update: str = "forward",
        canonical_query_order: bool = True,
        solver: str = "fused",
        precision: str = "auto",
        early_stop_tol: float | None = None,
        max_chunk_tasks: int | None = None,
        cpu_workers: int | None = None,
        memory_budget_mb: float = 2048.0,
        show_progress: bool = False,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb, show_progress=show_progress)
        for key, value, allowed in (("prototype_update", prototype_update, PROTOTYPE_UPDATES),
                                    ("solver", solver, SOLVERS), ("precision", precision, PRECISIONS)):
            if value not in allowed:
                raise ConfigError(f"putm.{key} must be one of {', '.join(allowed)}; got {value!r}")
        if rho is None:
            rho = 1.0 if balanced else 0.5
        if theta is None:
            theta = 0.001 if balanced else 0.0
        if inertia is None:
            inertia = inertia_one_shot if shots == 1 else inertia_few_shot
        for key, value in (("rho", rho), ("theta", theta), ("inertia", inertia)):
            if not 0.0 <= float(value) <= 1.0:
                raise ConfigError(f"putm.{key} must lie in [0, 1], got {value}")
        for key, value in (("inner_steps", inner_steps), ("init_tasks", init_tasks)):
            if int(value) < 1:
                raise ConfigError(f"putm.{key} must be >= 1, got {value}")
        if int(em_steps) < 0:
            raise ConfigError(f"putm.em_steps must be >= 0, got {em_steps}")
        if beta <= 0:
            raise ConfigError(f"putm.beta must be positive, got {beta}")
        if early_stop_tol is not None and float(early_stop_tol) < 0:
            raise ConfigError(f"putm.early_stop_tol must be null (off) or >= 0, got {early_stop_tol}")
        for key, value in (("max_chunk_tasks", max_chunk_tasks), ("cpu_workers", cpu_workers)):
            if value is not None and int(value) < 1:
                raise ConfigError(f"putm.{key} must be null (automatic) or >= 1, got {value}")
        hidden = tuple(int(h) for h in hidden)
        if solver == "fused" and min(hidden, default=GEMM_MIN_WIDTH) < GEMM_MIN_WIDTH:
            raise ConfigError(f"putm.solver=fused needs hidden widths >= {GEMM_MIN_WIDTH}, got {list(hidden)}; "
                              "use solver=autograd")
        self.settings = PUTMSettings(
            beta=float(beta), rho=float(rho), theta=float(theta), inertia=float(inertia),
            inner_steps=int(inner_steps), em_steps=int(em_steps), lr=float(lr),
            adam_betas=(float(adam_betas[0]), float(adam_betas[1])), hidden=hidden,
            init_tasks=int(init_tasks), reinit_navigator=bool(reinit_navigator), prototype_update=prototype_update,
            canonical_query_order=bool(canonical_query_order), solver=solver, precision=precision,
            early_stop_tol=None if early_stop_tol is None else float(early_stop_tol),
            max_chunk_tasks=None if max_chunk_tasks is None else int(max_chunk_tasks),
            cpu_workers=None if cpu_workers is None else int(cpu_workers),
        )
        self.last_state: dict[str, torch.Tensor] = {}
        #: The precision the last chunk actually ran in (``auto`` resolved for its device).
        self.last_precision: str | None = None

    # ----------------------------------------------------------------------------------------------- sizes
    def bytes_per_task(self, tasks: TaskBatch) -> int:
        n = tasks.num_support + tasks.num_queries
        m = min(tasks.dim, n)
        pairs = tasks.num_queries * tasks.ways
        hidden = sum(self.settings.hidden)
        if self.settings.solver == "fused":
            # squared differences, activations and their gradients, padded output + its gradient, and the
            # CT head; flat parameters, gradients and two Adam moments (+ the Adam denominator)
            params = Navigator.numel([m, *self.settings.hidden, 1], 1)
            floats = pairs * (m + 2 * hidden + 2 * GEMM_MIN_WIDTH + 16) + n * (tasks.dim + 2 * m) + 5 * params
        else:
            # squared differences + per-layer activations saved for backward and their gradients
            floats = pairs * (2 * m + 5 * hidden + 8) + n * (tasks.dim + 2 * m)
        return 4 * floats

    def chunk_size(self, tasks: TaskBatch) -> int:
        """Tasks per chunk: the memory budget's, capped at ``max_chunk_tasks`` (default on CPU:
        :data:`CPU_MAX_CHUNK_TASKS` per worker). On CPU a chunk is shared out among the workers."""
        size = super().chunk_size(tasks)
        cap = self.settings.max_chunk_tasks
        device = tasks.support.device
        if cap is None and device.type == "cpu":
            cap = CPU_MAX_CHUNK_TASKS * self.cpu_workers(device)
        return size if cap is None else max(1, min(size, cap))

    def cpu_workers(self, device: torch.device) -> int:
        """Concurrent chunk solvers: ``cpu_workers`` (default: torch's thread count) on CPU, else 1."""
        if device.type != "cpu":
            return 1
        return self.settings.cpu_workers or torch.get_num_threads()

    def predict(self, tasks: TaskBatch, on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """Probabilities ``[T, Q, N]``; on CPU with several workers each chunk is split among worker threads.

        Every worker solves its part of a chunk with single-threaded kernels (``torch.set_num_threads(1)``
        for the duration of the call, restored after): no OpenMP barrier per kernel (on a busy 2-core
        machine these made the solver 2–4x slower), and a task's result no longer depends on the number of
        cores or workers. The parts of a chunk together stay within its memory budget. With one worker
        this is the base class's sequential loop.
        """
        device = tasks.support.device
        workers = self.cpu_workers(device)
        if workers <= 1:
            return super().predict(tasks, on_chunk)
        self.check_input(tasks)
        parts, chunk_ends = self.split_among_workers(tasks, workers)
        threads = torch.get_num_threads()
        self.last_precision = resolve_precision(self.settings.precision, device)
        outputs: list[torch.Tensor] = []
        try:
            torch.set_num_threads(1)
            with matmul_precision(self.last_precision, device), ThreadPoolExecutor(workers) as pool:
                for index, (forward, state) in enumerate(pool.map(self.solve_chunk, parts)):
                    outputs.append(forward)
                    self.last_state = state
                    if on_chunk is not None and index + 1 in chunk_ends:
                        on_chunk(chunk_ends[index + 1])
        finally:
            torch.set_num_threads(threads)
        return torch.cat(outputs)

    def split_among_workers(self, tasks: TaskBatch, workers: int) -> tuple[list[TaskBatch], dict[int, int]]:
        """Chunks split into ``workers`` near-equal parts; ``{parts so far: tasks of the chunk}`` at chunk ends."""
        size = self.chunk_size(tasks)
        parts: list[TaskBatch] = []
        chunk_ends: dict[int, int] = {}
        for start in range(0, tasks.num_tasks, size):
            stop = min(start + size, tasks.num_tasks)
            share = math.ceil((stop - start) / workers)
            parts += [tasks.slice(first, min(first + share, stop)) for first in range(start, stop, share)]
            chunk_ends[len(parts)] = stop - start
        return parts, chunk_ends

    # ----------------------------------------------------------------------------------------------- solve
    def preprocess(self, tasks: TaskBatch) -> torch.Tensor:
        """Rows ``[T, S+Q, m]``: power transform, per-task QR basis, L2 (DESIGN §3 step 1)."""
        x = torch.cat([tasks.support, tasks.query], dim=1)
        x = power_transform(x, self.settings.beta, self.name)
        # R of Xᵀ only (mode="r"): the same R as mode="reduced", without forming Q (several times faster).
        r = torch.linalg.qr(x.transpose(1, 2), mode="r").R  # [T, min(d, n), n]
        return l2_normalise(r.transpose(1, 2))

    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        self.last_precision = resolve_precision(self.settings.precision, tasks.support.device)
        with matmul_precision(self.last_precision, tasks.support.device):
            forward, self.last_state = self.solve_chunk(tasks)
        return forward

    @torch.no_grad()
    def solve_chunk(self, tasks: TaskBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Probabilities of one chunk and its inspection state; writes nothing to ``self`` (thread-safe)."""
        order = canonical_query_order(tasks.query) if self.settings.canonical_query_order else None
        if order is not None:
            tasks = TaskBatch(tasks.support, tasks.support_labels, tasks.query.gather(1, order.unsqueeze(2).expand_as(tasks.query)),
                              tasks.ways, tasks.task_seeds)
        forward, state = self._solve(tasks)
        if order is not None:
            forward = torch.empty_like(forward).scatter_(1, order.unsqueeze(2).expand_as(forward), forward)
            # rows of the state are in canonical order: query_order[t, i] is the input index of query row i
            state["query_order"] = order
        return forward, state

    def _solve(self, tasks: TaskBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = self.settings
        with torch.no_grad():
            x = self.preprocess(tasks)
        one_hot = tasks.one_hot_support()
        prototypes = weighted_class_means(x[:, : tasks.num_support], one_hot)
        initial_prototypes = prototypes.clone()
        generators = [torch.Generator().manual_seed(int(seed)) for seed in tasks.task_seeds.tolist()]
        navigator = Navigator([x.shape[2], *s.hidden, 1], generators, s.init_tasks, x.device, x.dtype,
                              s.negative_slope, requires_grad=s.solver == "autograd")
        trainer_class = FusedTrainer if s.solver == "fused" else AutogradTrainer
        precision = resolve_precision(s.precision, x.device)
        trainer = trainer_class(navigator, s, torch.bfloat16 if precision == "bf16" else torch.float32)
        forward, prototypes, em_steps = self.em_loop(trainer, x, one_hot, prototypes, generators, tasks.ways)
        # For inspection (plots): the chunk, in the preprocessed space (support rows, then queries).
        state = {"initial_prototypes": initial_prototypes, "prototypes": prototypes, "rows": x, "forward": forward,
                 "em_steps": em_steps}
        return forward, state

    def em_loop(self, trainer: FusedTrainer | AutogradTrainer, rows: torch.Tensor, one_hot: torch.Tensor,
                prototypes: torch.Tensor, generators: list[torch.Generator],
                ways: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EM steps then the final E-step (DESIGN §3 steps 3–7); returns ``(π_f, prototypes, EM steps run)``.

        With ``early_stop_tol`` a task whose prototypes moved by at most the tolerance (max abs change)
        gets its final E-step at once and leaves the batch, so its result does not depend on the others.
        """
        s = self.settings
        total, num_support = rows.shape[0], one_hot.shape[1]
        forward_out = rows.new_empty(total, rows.shape[1] - num_support, ways)
        prototypes_out = prototypes.clone()
        em_steps = torch.full((total,), s.em_steps, dtype=torch.long)
        active = torch.arange(total, device=rows.device)

        def finish(index: torch.Tensor, trainer, protos: torch.Tensor, gens: list[torch.Generator]) -> None:
            if s.reinit_navigator:
                trainer.reinit(gens)
            forward, _ = trainer.run(rows[active[index], num_support:], protos, ways)
            forward_out[active[index]] = forward.detach()
            prototypes_out[active[index]] = protos

        steps = range(s.em_steps)
        if self.show_progress and self.cpu_workers(rows.device) <= 1:
            steps = tqdm(steps, desc=f"putm EM ({total} tasks)", leave=False, disable=None)
        for step in steps:
            if s.reinit_navigator:
                trainer.reinit(generators)
            rows_now = rows[active] if len(active) < total else rows
            forward, backward = trainer.run(rows_now[:, num_support:], prototypes, ways)
            weights = self.update_weights(forward, backward)
            updated = self.m_step(rows_now, one_hot[active], weights, prototypes, s.inertia)
            settled = self.settled(prototypes, updated)
            prototypes = updated
            if settled is None or not bool(settled.any()):
                continue
            done = settled.nonzero().squeeze(1)
            em_steps[active[done].cpu()] = step + 1
            finish(done, trainer.select(done), prototypes[done], [generators[i] for i in done.tolist()])
            keep = (~settled).nonzero().squeeze(1)
            if len(keep) == 0:
                return forward_out, prototypes_out, em_steps
            trainer, prototypes = trainer.select(keep), prototypes[keep]
            generators = [generators[i] for i in keep.tolist()]
            active = active[keep]
        finish(torch.arange(len(active), device=rows.device), trainer, prototypes, generators)
        return forward_out, prototypes_out, em_steps

    def settled(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor | None:
        """Per-task ``max |Δμ| <= early_stop_tol`` (``None`` when early stopping is off)."""
        tol = self.settings.early_stop_tol
        if tol is None:
            return None
        return (after - before).abs().amax(dim=(1, 2)) <= tol

    def e_step(self, navigator: Navigator, optimiser: torch.optim.Optimizer, query: torch.Tensor,
               prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One E-step with autograd and a given optimiser (see :func:`e_step_autograd`)."""
        return e_step_autograd(navigator, optimiser, query, prototypes, ways, self.settings)

    def update_weights(self, forward: torch.Tensor, backward: torch.Tensor) -> torch.Tensor:
        """Query weights of the M-step: forward (default), backward, or the ρ-mixture of both navigators."""
        if self.settings.prototype_update == "forward":
            return forward
        if self.settings.prototype_update == "backward":
            return backward
        return self.settings.rho * forward + (1 - self.settings.rho) * backward

    @staticmethod
    def m_step(rows: torch.Tensor, support_one_hot: torch.Tensor, query_weights: torch.Tensor,
               prototypes: torch.Tensor, inertia: float) -> torch.Tensor:
        """``μ ← μ + a(μ̂ − μ)`` with μ̂ the weighted mean of support (one-hot) and query rows."""
        estimate = weighted_class_means(rows, torch.cat([support_one_hot, query_weights], dim=1))
        return prototypes + inertia * (estimate - prototypes)


def canonical_query_order(query: torch.Tensor) -> torch.Tensor:
    """Per-task permutation ``[T, Q]`` sorting queries by a fixed random projection of their features.

    The QR basis (Gram-Schmidt over support then query rows) depends on the order in which queries are
    listed, and the navigator is not rotation-invariant, so without a canonical order a task's predictions
    would change when its queries are shuffled. Sorting first makes PUTM exactly permutation-equivariant.
    """
    generator = torch.Generator().manual_seed(0x5EED)
    direction = torch.randn(query.shape[2], generator=generator).to(query.device, query.dtype)
    return torch.sort(query @ direction, dim=1, stable=True).indices


def ct_loss(cost: torch.Tensor, forward: torch.Tensor, backward: torch.Tensor, rho: float, theta: float) -> torch.Tensor:
    """Per-task loss ``θ·L_bal + (1−θ)·L_CT`` (DESIGN §3 step 4); ``cost``/navigators are ``[T, Q, N]``."""
    transport = rho * (cost * forward).sum(2).mean(1) + (1 - rho) * (cost * backward).sum(1).mean(1)
    if theta == 0:
        return transport
    ways = cost.shape[2]
    balance = (rho * forward + (1 - rho) * backward).sum(1)  # [T, N]
    balance_loss = (balance - 1.0 / ways).pow(2).mean(1)
    return theta * balance_loss + (1 - theta) * transport
