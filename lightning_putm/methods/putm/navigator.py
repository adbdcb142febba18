"""The navigator: a small per-task MLP that scores every (query, prototype) pair (paper §3).

The navigator maps the squared difference ``(μ_k − x_j)²`` of query ``j`` and prototype ``k`` to a logit
``d_jk`` (``m → 128 → 64 → 1`` with LeakyReLU in the reference code github.com/RashLog/PUTM). Each task has
its own navigator; the navigators of a chunk are stacked as ``[T, in, out]`` tensors in one flat buffer, so
a batch of tasks is one batched matrix product per layer.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from lightning_putm.methods.putm.settings import GEMM_MIN_WIDTH


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
                 device: torch.device, dtype: torch.dtype, negative_slope: float, requires_grad: bool = True,
                 seeds: torch.Tensor | None = None) -> None:
        """``seeds`` (``[T]`` integer task seeds, ``init_draw=device``): every draw, the initial one and each
        :meth:`redraw`, runs on the device (:func:`device_normal`) instead of from the per-task CPU ``generators``."""
        self.widths = widths
        self.seeds = seeds if seeds is None else seeds.to(device)
        self.draws = 0  # draws so far: the counter of the device-side draw
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
        """New weights at the Xavier scale, biases 0: from the per-task CPU ``generators``, or on the device
        from :attr:`seeds` when given (draw number :attr:`draws`, so each re-draw gets new values)."""
        if self.seeds is None:
            self._draw(lambda layer, fan_in, fan_out:
                       torch.stack([torch.randn(fan_in, fan_out, generator=g) for g in generators]))
        else:
            seeds, draw = self.seeds, self.draws
            self._draw(lambda layer, fan_in, fan_out: device_normal(seeds, draw, layer, (fan_in, fan_out)))
        self.draws += 1

    def _draw(self, normals: Callable[[int, int, int], torch.Tensor]) -> None:
        """Weights ``normals(layer, fan_in, fan_out) · std`` (``[T, in, out]`` standard normals); biases to 0."""
        for layer, (w, b) in enumerate(zip(self.weights, self.biases)):
            _, fan_in, fan_out = w.shape
            std = self.init_std(fan_in, fan_out)
            w.copy_(normals(layer, fan_in, fan_out).mul_(std))
            b.zero_()

    def init_std(self, fan_in: int, fan_out: int) -> float:
        """The reference's Xavier-normal scale for a stacked ``[T_init, in, out]`` tensor."""
        return math.sqrt(2.0 / (fan_out * (fan_in + self.init_tasks)))

    @torch.no_grad()
    def select(self, index: torch.Tensor) -> Navigator:
        """The navigators of tasks ``index`` (a copy)."""
        chosen = object.__new__(Navigator)
        chosen.widths, chosen.init_tasks, chosen.negative_slope = self.widths, self.init_tasks, self.negative_slope
        chosen.seeds, chosen.draws = (None if self.seeds is None else self.seeds[index]), self.draws
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
                # (and Adam amplifies it); zero-padding the width keeps it on the GEMM path, so on CPU a
                # task's result is bit-identical alone or in a batch (tests/test_putm.py checks this). On a
                # GPU, cuBLAS may pick kernels by batch size: there results agree to float rounding only.
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


# ------------------------------------------------------------------------------ the device-side draw
_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)  # odd, < 2^31: products stay inside int64


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply rounds) of int64 values in ``[0, 2^32)``; same on every device."""
    for multiplier in _MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * multiplier) & _MASK32
    return x ^ (x >> 15)


def device_normal(seeds: torch.Tensor, draw: int, layer: int, shape: tuple[int, int],
                  max_elements: int = 1 << 24) -> torch.Tensor:
    """Standard normals ``[T, *shape]`` for tasks with integer ``seeds`` ``[T]``, on the seeds' device.

    Counter-based: element ``i`` of task ``t`` is a Box–Muller normal of two hashes of
    ``(seed_t, draw, layer, i)``, so it never depends on the other tasks, the chunking or the device's
    random state. The integer hashes are exact on every device; the log/cos (compiled into one kernel on
    CUDA) round differently across devices, so CPU and GPU draws agree to float rounding, not bit-for-bit.
    Computed in task slices of at most ``max_elements`` values (memory).
    """
    seeds = seeds.to(torch.int64)
    folded = (seeds & _MASK32) ^ ((seeds >> 32) & _MASK32)
    key = hash32((hash32(folded) + ((draw * 0x3C6EF372 + layer * 0x1B873593) & _MASK32)) & _MASK32)
    first_key, second_key = hash32(key), hash32((key + 0x9E3779B9) & _MASK32)  # two streams per key
    count = shape[0] * shape[1]
    index = torch.arange(count, device=seeds.device, dtype=torch.int64)
    out = torch.empty(len(seeds), count, device=seeds.device, dtype=torch.float32)
    step = max(1, max_elements // max(count, 1))
    normals = _compiled_box_muller() if seeds.device.type == "cuda" else box_muller
    for start in range(0, len(seeds), step):
        k1, k2 = first_key[start : start + step].unsqueeze(1), second_key[start : start + step].unsqueeze(1)
        out[start : start + step] = normals(index, k1, k2)
    return out.view(len(seeds), *shape)


def box_muller(index: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """Normals ``[K, I]`` from two hashed uniform streams of element ``index`` ``[I]`` under keys ``[K, 1]``."""
    first = hash32(hash32(index ^ k1) ^ k2)
    second = hash32(hash32(index ^ k2) ^ k1)
    u1 = ((first >> 8) + 1).float() * 2.0**-24  # (0, 1]: the log is finite
    u2 = (second >> 8).float() * 2.0**-24
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


@functools.cache
def _compiled_box_muller():
    """:func:`box_muller` fused into one kernel by ``torch.compile`` (CUDA only: ~25 elementwise passes → 1)."""
    return torch.compile(box_muller, dynamic=True)
