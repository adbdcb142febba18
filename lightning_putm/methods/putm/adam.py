"""Adam (Kingma & Ba 2015) over one flat buffer holding the navigators of every task of a chunk.

PUTM trains each task's navigator with Adam (paper §4, implementation details; reference code
github.com/RashLog/PUTM: ``lr=1e-3``, ``betas=(0.5, 0.99)``). One elementwise update over the flat buffer
covers every layer of every task.
"""

from __future__ import annotations

import torch

ADAM_EPS = 1e-8


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
