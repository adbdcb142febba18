"""The conditional-transport (CT) cost between queries and prototypes, and its gradient (paper §3).

For a task with ``Q`` queries and ``N`` prototypes, the navigator's logits ``d_jk`` give the forward
navigator ``π_f(k|j)`` (softmax over classes) and the backward navigator ``π_b(j|k)`` (softmax over
queries). With the cost ``c_jk = ‖x_j − μ_k‖²`` (a constant for the navigator), the CT loss is

    L_CT  = ρ · mean_j Σ_k c_jk π_f(k|j) + (1 − ρ) · mean_k Σ_j c_jk π_b(j|k)

and on balanced tasks the reference code (github.com/RashLog/PUTM) adds a balance term on the class mass
``b_k = Σ_j ρ π_f(k|j) + (1 − ρ) π_b(j|k)``: ``L = θ · mean_k (b_k − 1/N)² + (1 − θ) · L_CT``.
"""

from __future__ import annotations

import torch


def ct_loss(cost: torch.Tensor, forward: torch.Tensor, backward: torch.Tensor, rho: float, theta: float) -> torch.Tensor:
    """Per-task loss ``θ·L_bal + (1−θ)·L_CT``; ``cost`` and the navigators are ``[T, Q, N]``."""
    transport = rho * (cost * forward).sum(2).mean(1) + (1 - rho) * (cost * backward).sum(1).mean(1)
    if theta == 0:
        return transport
    ways = cost.shape[2]
    balance = (rho * forward + (1 - rho) * backward).sum(1)  # [T, N]
    balance_loss = (balance - 1.0 / ways).pow(2).mean(1)
    return theta * balance_loss + (1 - theta) * transport


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
