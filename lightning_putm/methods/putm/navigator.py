"""The navigator: a small per-task MLP that scores every (query, prototype) pair (paper §3).

The navigator maps the squared difference ``(μ_k − x_j)²`` of query ``j`` and prototype ``k`` to a logit
``d_jk`` (``m → 128 → 64 → 1`` with LeakyReLU in the reference code github.com/RashLog/PUTM). Each task has
its own navigator; the navigators of a chunk are stacked as ``[T, in, out]`` tensors in one flat buffer, so
a batch of tasks is one batched matrix product per layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GEMM_MIN_WIDTH = 8


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
