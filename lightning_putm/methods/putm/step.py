"""One Adam step's gradient: the navigator forward, the CT-loss gradient and the navigator backward, written once.

The ``fused`` engine (:mod:`.engines`) calls :func:`navigator_step` with preallocated :class:`StepBuffers`
(every product written through ``out=`` into them, LeakyReLU in place: no per-step allocations); the
``compiled`` engine (:mod:`.compiled`) calls the same function without buffers, where it is pure (no ``out=``,
no in-place writes) so ``torch.compile`` can fuse it. The operations replay autograd's (bmm with the same operand
order; the LeakyReLU mask taken from the output, whose sign equals the input's), so in fp32 on CPU the ``fused``
engine equals the ``autograd`` engine bit for bit. The cost and the navigator's inputs are set up once, by
:func:`pair_inputs`, for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_putm.methods.putm.loss import ct_loss_gradient
from lightning_putm.methods.putm.navigator import Navigator


def pair_inputs(query: torch.Tensor, prototypes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(squared differences [T, Q·N, m], cost c_jk = ‖x_j − μ_k‖² [T, Q, N])`` of all (query, prototype) pairs."""
    t, q, m = query.shape
    squared = (query.unsqueeze(2) - prototypes.unsqueeze(1)).pow(2)  # [T, Q, N, m]
    cost = squared.sum(-1)
    return squared.reshape(t, q * prototypes.shape[1], m), cost


@dataclass
class StepBuffers:
    """Preallocated outputs of :func:`navigator_step` for a navigator and a number of pairs (the ``fused`` engine).

    ``grad`` is the float32 flat gradient laid out like ``Navigator.flat``; the weight products are written in
    the compute dtype into ``low_grad`` (``grad`` itself in float32) and copied over; bias sums are float32.
    """

    pairs: int
    activations: list[torch.Tensor]
    hidden_grads: list[torch.Tensor]
    out: torch.Tensor
    grad_out: torch.Tensor
    grad: torch.Tensor
    grad_biases: list[torch.Tensor]
    low_grad: torch.Tensor
    grad_weights: list[torch.Tensor]
    weights_numel: int

    @classmethod
    def new(cls, navigator: Navigator, pairs: int, compute_dtype: torch.dtype) -> StepBuffers:
        t, hidden = navigator.num_tasks, navigator.widths[1:-1]
        options = dict(device=navigator.flat.device, dtype=compute_dtype)
        grad = torch.zeros_like(navigator.flat)
        low_grad = grad if compute_dtype == grad.dtype else torch.zeros_like(grad, dtype=compute_dtype)
        grad_weights = navigator.views(low_grad)[0]
        last = Navigator.stored_width(navigator.widths[-1])
        return cls(pairs, [torch.empty(t, pairs, width, **options) for width in hidden],
                   [torch.empty(t, pairs, width, **options) for width in hidden],
                   torch.empty(t, pairs, last, **options), torch.zeros(t, pairs, last, **options),
                   grad, navigator.views(grad)[1], low_grad, grad_weights, sum(w.numel() for w in grad_weights))


def navigator_step(inputs: torch.Tensor, cost: torch.Tensor, stored: list[torch.Tensor], biases: list[torch.Tensor],
                   out_width: int, slope: float, rho: float, theta: float, compute_dtype: torch.dtype,
                   buffers: StepBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(π_f, π_b, flat gradient)`` of one Adam step: navigator forward, CT-loss gradient, navigator backward.

    ``inputs`` ``[T, P, m]`` (compute dtype) are the squared differences, ``cost`` ``[T, Q, N]``; ``stored`` and
    ``biases`` are the navigator's float32 views (the last layer zero-padded to a GEMM width, so a task's products
    never depend on the batch size on CPU BLAS). The gradient is laid out like ``Navigator.flat`` (float32):
    ``buffers.grad`` with ``buffers``, else a new tensor (then the function is pure).
    """
    t, q, n = cost.shape
    weights = [w.to(compute_dtype) for w in stored]  # no copy in float32
    layers = len(weights)
    activations = []
    x = inputs
    for i in range(layers - 1):
        x = torch.baddbmm(biases[i].to(compute_dtype), x, weights[i],
                          out=None if buffers is None else buffers.activations[i])
        x = F.leaky_relu(x, slope) if buffers is None else F.leaky_relu_(x, slope)
        activations.append(x)
    out = torch.bmm(x, weights[-1], out=None if buffers is None else buffers.out)
    logits = -(out[:, :, :out_width].float() + biases[-1]).view(t, q, n)
    forward, backward, grad_logits = ct_loss_gradient(cost, logits, rho, theta)
    grad_out = grad_logits.neg().view(t, q * n, 1)
    # backward: bias gradients are sums over pairs (autograd's sum_to_size of the broadcast bias), in float32
    bias_grads = [bias_gradient(grad_out, None if buffers is None else buffers.grad_biases[-1])]
    if buffers is None:
        grad = F.pad(grad_out, (0, weights[-1].shape[2] - out_width)).to(compute_dtype)
    else:
        grad = buffers.grad_out
        grad[:, :, :out_width].copy_(grad_out)
    weight_grads = []
    for i in range(layers - 1, -1, -1):
        below = inputs if i == 0 else activations[i - 1]
        weight_grads.append(torch.bmm(below.transpose(1, 2), grad,
                                      out=None if buffers is None else buffers.grad_weights[i]))
        if i > 0:
            grad_below = torch.bmm(grad, weights[i].transpose(1, 2),
                                   out=None if buffers is None else buffers.hidden_grads[i - 1])
            if buffers is None:
                grad = torch.ops.aten.leaky_relu_backward(grad_below, below, slope, False)
            else:
                grad = torch.ops.aten.leaky_relu_backward.grad_input(grad_below, below, slope, False,
                                                                     grad_input=grad_below)
            bias_grads.append(bias_gradient(grad, None if buffers is None else buffers.grad_biases[i - 1]))
    if buffers is None:
        parts = [g.float().flatten() for g in reversed(weight_grads)] + [g.flatten() for g in reversed(bias_grads)]
        return forward, backward, torch.cat(parts)
    if buffers.low_grad is not buffers.grad:
        buffers.grad[: buffers.weights_numel].copy_(buffers.low_grad[: buffers.weights_numel])
    return forward, backward, buffers.grad


def bias_gradient(grad: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The float32 sum of ``grad`` ``[T, P, w]`` over pairs, ``[T, 1, w]`` (into ``out`` when given)."""
    if grad.dtype == torch.float32:
        return torch.sum(grad, 1, keepdim=True, out=out)
    return torch.sum(grad, 1, keepdim=True, dtype=torch.float32, out=out)
