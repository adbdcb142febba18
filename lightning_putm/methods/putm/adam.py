"""Adam (Kingma & Ba 2015) over one flat buffer holding the navigators of every task of a chunk.

PUTM trains each task's navigator with Adam (paper §4, implementation details; reference code
github.com/RashLog/PUTM: ``lr=1e-3``, ``betas=(0.5, 0.99)``). One elementwise update over the flat buffer
covers every layer of every task. The one update formula serves both engines that do not use
``torch.optim``: with the step count a Python number (``fused``, bit-identical to ``torch.optim.Adam``) or
in a device tensor (``compiled``: a CUDA graph replays a step without Python numbers that change).
"""

from __future__ import annotations

import torch

ADAM_EPS = 1e-8


class StackedAdam:
    """``torch.optim.Adam`` (its default single-tensor CPU algorithm) on one flat parameter buffer.

    Same operations in the same order as ``torch.optim.Adam(lr, betas, eps=1e-8)`` without weight decay
    or AMSGrad, so each element follows bit-for-bit the update torch would give it; one kernel per
    operation covers every layer of every task. All tasks share the step count.

    ``on_device=True``: the step count is a 0-dim float32 tensor on the parameters' device, updated in place,
    and the bias corrections are computed from it on the device (equal to the Python-number update to float
    rounding, not bit-for-bit); the update is then torch's fused Adam kernel (``torch._fused_adam_``, the kernel
    behind ``torch.optim.Adam(fused=True)``, one pass instead of seven) where it runs on the device
    (:attr:`fused`), else the same formula as tensor operations.
    """

    def __init__(self, params: torch.Tensor, lr: float, betas: tuple[float, float], eps: float = ADAM_EPS,
                 on_device: bool = False) -> None:
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.exp_avg = torch.zeros_like(params)
        self.exp_avg_sq = torch.zeros_like(params)
        self.denom = torch.empty_like(params)
        self.on_device = on_device
        self.steps: int | torch.Tensor = torch.zeros((), dtype=torch.float32, device=params.device) if on_device \
            else 0
        self.fused = on_device and fused_adam_available(params.device, params.dtype)

    def reset(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        if isinstance(self.steps, torch.Tensor):
            self.steps.zero_()
        else:
            self.steps = 0

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        beta1, beta2 = self.betas
        if isinstance(self.steps, torch.Tensor):
            self.steps.add_(1)
            if self.fused:
                torch._fused_adam_([self.params], [grad], [self.exp_avg], [self.exp_avg_sq], [], [self.steps],
                                   lr=self.lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=self.eps,
                                   amsgrad=False, maximize=False)
                return
            bias_correction1 = 1 - torch.pow(beta1, self.steps)
            bias_correction2_sqrt = (1 - torch.pow(beta2, self.steps)).sqrt()
        else:
            self.steps += 1
            bias_correction1 = 1 - beta1 ** float(self.steps)
            bias_correction2_sqrt = (1 - beta2 ** float(self.steps)) ** 0.5
        # the update: m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²; p ← p − lr/c1 · m / (√v/√c2 + ε)
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        torch.sqrt(self.exp_avg_sq, out=self.denom)
        self.denom.div_(bias_correction2_sqrt).add_(self.eps)
        if isinstance(bias_correction1, torch.Tensor):
            self.params.sub_(self.exp_avg / self.denom * (self.lr / bias_correction1))
        else:
            self.params.addcdiv_(self.exp_avg, self.denom, value=-(self.lr / bias_correction1))


def fused_adam_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._fused_adam_`` exists and runs on ``device`` (tried once on a 2-element buffer)."""
    if not hasattr(torch, "_fused_adam_"):
        return False
    key = (device.type, dtype)
    if key not in _FUSED_ADAM_WORKS:
        try:
            p, g = torch.zeros(2, device=device, dtype=dtype), torch.ones(2, device=device, dtype=dtype)
            m, v, step = torch.zeros_like(p), torch.zeros_like(p), torch.ones((), device=device)
            torch._fused_adam_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
                               eps=1e-8, amsgrad=False, maximize=False)
            _FUSED_ADAM_WORKS[key] = bool(torch.isfinite(p).all())
        except (RuntimeError, NotImplementedError):
            _FUSED_ADAM_WORKS[key] = False
    return _FUSED_ADAM_WORKS[key]


_FUSED_ADAM_WORKS: dict[tuple[str, torch.dtype], bool] = {}
