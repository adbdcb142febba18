"""The Hopper kernel's shapes and its fragment layout, in one place for the kernel, its emulation and its launcher.

``e_step.cu`` derives the same numbers from its macros (``Q``, ``N``, ``M``); :class:`Layout` mirrors them, and
:meth:`Layout.slot_index` is the one definition of which parameter each thread's fp32 state slot holds: the kernel
gathers its workspace from the navigator's flat buffers through that table at the start of an E-step and scatters it
back at the end, and the emulation (:mod:`.emulate`) runs Adam on the same slots.

A thread's slots follow the accumulator fragments of ``mma.m16n8k16`` (register ``e`` of n-block ``n`` holds row
``g + 8·(e >> 1)``, column ``8n + 2t + (e & 1)``, ``g = lane >> 2``, ``t = lane & 3``):

* slots ``4n + e``, ``n < NB1``: ``∂W1ᵀ`` of warp ``w``, row ``h = 16w + g (+8)``, column ``i``: ``W1[i][h]`` for
  ``i < M``, ``b1[h]`` for ``i = M`` (the inputs' ones column), padding beyond;
* slots ``4·NB1 + 4n + e``, ``n < 9``: ``∂W2ᵀ`` of warp ``w = 4·hb + jb``, row ``j = 16·jb + g (+8)``, column
  ``h = 64·hb + 8n + …`` (``n < 8``: ``W2[h][j]``), and for ``hb = 1`` the bias block (column 128: ``b2[j]``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

WARPS, THREADS = 8, 256
H1, H2, W3S = 128, 64, 8
PASS = 128
H1S, H2S, W2S = 136, 72, 72
#: Segment codes of :meth:`Layout.slot_index` (bits 24 and up; the offset within the task's segment below).
W1, W2, B1, B2 = 0, 1, 2, 3
#: Shared memory a block may use on an H100/H200 (227 KB).
MAX_SHARED = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Layout:
    """The kernel's derived sizes for ``queries`` × ``ways`` pairs and a basis of ``dim`` columns."""

    queries: int
    ways: int
    dim: int

    @property
    def pairs(self) -> int:
        return self.queries * self.ways

    @property
    def passes(self) -> int:
        return -(-self.pairs // PASS)

    @property
    def padded_pairs(self) -> int:
        return self.passes * PASS

    @property
    def k16(self) -> int:
        """16-wide k-steps of the first product (the rest, up to 8 columns, is one 8-wide step)."""
        return self.dim // 16 + (1 if self.dim % 16 > 8 else 0)

    @property
    def k8(self) -> int:
        return 1 if 0 < self.dim % 16 <= 8 else 0

    @property
    def k_pad(self) -> int:
        return 16 * self.k16 + 8 * self.k8

    @property
    def row_stride(self) -> int:
        """``XS``: elements per row of the inputs and of ``sW1``: room for the ones column and the last k-step, an
        odd number of 16-byte units (conflict-free ldmatrix)."""
        stride = -(-max(self.dim + 1, self.k_pad) // 8) * 8
        return stride if (stride // 8) % 2 else stride + 8

    @property
    def w1_blocks(self) -> int:
        """``NB1``: 8-column blocks of ``∂W1ᵀ`` (the bias column included)."""
        return self.row_stride // 8

    @property
    def slots(self) -> int:
        return 4 * self.w1_blocks + 36

    @property
    def workspace_floats(self) -> int:
        """fp32 words of one block's workspace in device memory: W, m and v of every slot of every thread."""
        return 3 * self.slots * THREADS

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of a block (``e_step.cu``'s ``SMEM_BYTES``)."""
        bf16 = 2 * (self.padded_pairs * self.row_stride + H1 * self.row_stride + H1 * W2S + 2 * PASS * H1S
                     + PASS * H2S)
        small = H1 + H2 + H2 + 4 * self.padded_pairs + 4 * 8 + WARPS * H2 + 1 + WARPS
        return bf16 + 4 * small

    def unsupported(self) -> str | None:
        """Why the kernel cannot take this shape, or ``None``."""
        if self.pairs > 3 * PASS:
            return f"{self.queries} queries x {self.ways} ways = {self.pairs} pairs (at most {3 * PASS})"
        if self.ways > WARPS or self.queries > THREADS:
            return f"{self.ways} ways, {self.queries} queries (at most {WARPS} ways and {THREADS} queries)"
        if self.dim % 2 or self.w1_blocks > 15:
            return f"basis width {self.dim} (an even width of at most 112)"
        if self.shared_bytes > MAX_SHARED:
            return f"{self.shared_bytes} B of shared memory (at most {MAX_SHARED})"
        return None

    @functools.cached_property
    def slot_index(self) -> torch.Tensor:
        """``[slots, 256]`` int32: ``segment << 24 | offset`` of the parameter in slot ``s`` of thread ``tid``, or
        -1 for a padding slot; offsets are within one task's segment of :class:`~..navigator.Navigator`'s flat
        buffer (``W1 [M, 128]``, ``W2 [128, 64]``, ``b1``, ``b2``)."""
        table = torch.full((self.slots, THREADS), -1, dtype=torch.int32)
        for tid in range(THREADS):
            warp, lane = divmod(tid, 32)
            g, t = lane >> 2, lane & 3
            jb, hb = warp & 3, warp >> 2
            for n in range(self.w1_blocks):
                for e in range(4):
                    h, i = 16 * warp + g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1)
                    if i < self.dim:
                        table[4 * n + e, tid] = (W1 << 24) | (i * H1 + h)
                    elif i == self.dim:
                        table[4 * n + e, tid] = (B1 << 24) | h
            for n in range(9):
                for e in range(4):
                    j, column = 16 * jb + g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1)
                    slot = 4 * self.w1_blocks + 4 * n + e
                    if n < 8:
                        table[slot, tid] = (W2 << 24) | ((64 * hb + column) * H2 + j)
                    elif hb == 1 and column == 64:
                        table[slot, tid] = (B2 << 24) | j
        return table

    def flat_positions(self, starts: tuple[int, int, int, int], task_sizes: tuple[int, int, int, int],
                       tasks: int) -> torch.Tensor:
        """``[tasks, slots, 256]`` int64: each slot's position in the flat buffer (-1: padding), given where the
        ``W1, W2, b1, b2`` segments start and their sizes per task."""
        table = self.slot_index.to(torch.int64)
        segment, offset = table >> 24, table & 0xFFFFFF
        task = torch.arange(tasks).view(tasks, 1, 1)
        start = torch.tensor(starts)[segment.clamp(min=0)]
        size = torch.tensor(task_sizes)[segment.clamp(min=0)]
        positions = start + task * size + offset
        return torch.where(table.unsqueeze(0) >= 0, positions, torch.full_like(positions, -1))
