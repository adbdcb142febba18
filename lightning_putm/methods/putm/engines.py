"""The E-step: ``inner_steps`` Adam steps of every task's navigator on the CT loss (paper §3, Algorithm 1).

Interchangeable engines (``putm.solver``; ``auto``, the default, is ``compiled`` on CUDA and ``fused``
elsewhere, :func:`resolve_solver`):

* :class:`FusedTrainer` (``fused``): a hand-written backward of the navigator MLP and of the CT
  loss, written into one flat gradient buffer, and one :class:`StackedAdam` update over the flat buffer of
  all stacked per-task weights. It replays exactly the floating-point operations that autograd and
  ``torch.optim.Adam`` perform (same kernels, same operand order), so in fp32 on CPU its results are
  bit-identical to the ``autograd`` engine, with about half the memory traffic and no per-step allocations.
  (Bit-identity is a CPU statement: on a GPU, cuBLAS and the reduction kernels may choose different
  algorithms by shape, so engines and batch sizes agree to float rounding there.)
* :class:`~.compiled.CompiledTrainer` (``compiled``): the same mathematics with device-side Adam state, one
  fused Adam kernel, a ``torch.compile``-able step function and CUDA-graph replay of the inner steps
  (:mod:`.compiled`); agrees with ``fused`` to float rounding, not bit-for-bit.
* :class:`AutogradTrainer` (``autograd``): the plain formulation (autograd + ``torch.optim.Adam``), kept as
  the executable specification.

Both return ``(π_f, π_b)`` of the last Adam step, computed before that step's update, like the reference
code (github.com/RashLog/PUTM).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from lightning_putm.methods.putm.adam import StackedAdam
from lightning_putm.methods.putm.compiled import CompiledTrainer
from lightning_putm.methods.putm.loss import ct_loss, ct_loss_gradient
from lightning_putm.methods.putm.navigator import Navigator, select_tasks
from lightning_putm.methods.putm.settings import PUTMSettings


class FusedTrainer:
    """The E-step's ``inner_steps`` Adam steps on the CT loss with a hand-written navigator backward.

    Per Adam step: forward through the stacked MLP into preallocated activations (LeakyReLU in place), the
    CT-loss gradient w.r.t. the logits (:func:`ct_loss_gradient`), the backward pass written straight into
    a flat gradient buffer shaped like ``navigator.flat``, and one :class:`StackedAdam` update. The
    operations replay autograd's (bmm with the same operand order; the LeakyReLU mask taken from the
    output, whose sign equals the input's), so the fp32 results on CPU equal the ``autograd`` engine's. With a
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


def resolve_solver(solver: str, device: torch.device) -> str:
    """``auto`` → ``compiled`` on CUDA (CUDA graphs, compiled step), ``fused`` elsewhere; others unchanged.

    On CPU ``fused`` stays the default: it is the bit-exact engine and ``compiled`` was not faster on a
    2-core CPU (docs/gpu.md).
    """
    if solver != "auto":
        return solver
    return "compiled" if device.type == "cuda" else "fused"


def make_trainer(navigator: Navigator, settings: PUTMSettings,
                 compute_dtype: torch.dtype) -> FusedTrainer | AutogradTrainer | CompiledTrainer:
    """The E-step engine chosen by ``settings.solver`` (``auto`` resolved for the navigator's device)."""
    settings = dataclasses.replace(settings, solver=resolve_solver(settings.solver, navigator.flat.device))
    if settings.solver == "compiled":
        return CompiledTrainer(navigator, settings, compute_dtype)
    trainer_class = FusedTrainer if settings.solver == "fused" else AutogradTrainer
    return trainer_class(navigator, settings, compute_dtype)
