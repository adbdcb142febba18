"""The whole CT-EM loop on the device for ``solver=triton``: the M-step as a Triton kernel. Not part of the paper.

:meth:`.triton_engine.TritonEngine.whole_em_loop` runs Algorithm 1's loop (paper §3: ``em_steps`` E-steps each
followed by an M-step, then the final E-step) as a sequence of kernel launches that never wait for the host: the
E-step kernel (:mod:`.triton_wide`), then :func:`m_step_kernel`, which for each task

- forms the query weights from the navigator (π_f, π_b or their ρ-mixture: ``prototype_update``,
  :func:`.m_step.query_weights`), the weighted class means of the support and query rows
  (:func:`~lightning_putm.tasks.weighted_class_means`) and moves the prototypes with inertia
  ``μ ← μ + a(μ̂ − μ)`` (:func:`.m_step.m_step`);
- recomputes the pair costs ``‖x_j − μ_k‖²`` of the next E-step from the new prototypes, while they are in
  registers (the host-side loop streams the ``[T, Q·N, m]`` squared differences through memory for them);
- decides early stopping (:func:`.m_step.settled`: ``max |Δμ| ≤ early_stop_tol``): a settled task gets one more
  E-step, its final one, and its ``active`` flag, which the E-step kernel reads, then goes to 0, so its program
  returns at once from then on.

It gives what :func:`.em.em_loop` gives with the same engine, up to the order of the M-step's sums (a rounding
difference), without a host round trip per EM step. It runs where the E-step kernel runs, when nothing needs the
host between E-steps: no ``em_step_hook`` (inspection) and no ``reinit_navigator`` (a re-draw uses the host's
random generators), and tasks small enough for one M-step program (:func:`m_step_fits`: the paper's settings);
otherwise :func:`.em.em_loop` drives the engine E-step by E-step as before.

Why a kernel of its own and not the M-step inside the E-step kernel: fusing them would save one launch per EM step
(microseconds, against an E-step of tens of milliseconds for thousands of tasks) and change the E-step kernel's
machine code, whose instruction estimate is checked against an H100 profile (``tools/triton_resources.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: ``prototype_update`` (:func:`.m_step.query_weights`) as the kernel's ``UPDATE``.
PROTOTYPE_UPDATE_CODES = {"forward": 0, "backward": 1, "mixed": 2}
#: Warps of an M-step program (its largest tensor is a task's ``[S+Q, m]`` rows, padded to powers of two).
M_STEP_WARPS = 8
#: Largest padded ``[S+Q, m]`` block an M-step program holds: 128 x 128 (the paper's 1- and 5-shot tasks) builds
#: for sm_90 without spills; 256 x 256 spilled 4.3 KB per thread. Larger tasks run the host-side EM loop.
M_STEP_MAX_BLOCK = 128 * 128


def m_step_fits(rows: int, m: int) -> bool:
    """Whether the M-step kernel holds a task of ``rows`` rows (support and queries) in a basis of ``m`` columns."""
    return triton.next_power_of_2(rows) * max(16, triton.next_power_of_2(m)) <= M_STEP_MAX_BLOCK


@triton.jit(do_not_specialize=["step"])  # one build for every EM step (Triton specializes integers 1 and 16·k)
def m_step_kernel(
    rows_ptr,  # [T, S+Q, M] float32: support rows, then queries (the task's basis)
    support_ptr,  # [T, S, N] float32: the support rows' M-step weights (one-hot × support_weight)
    forward_ptr, backward_ptr,  # [T, Q, N] float32: π_f, π_b of the E-step just run
    proto_ptr,  # [T, N, M] float32, updated in place
    cost_ptr,  # [T, Q, N] float32: the next E-step's pair costs, written here
    active_ptr,  # [T] int8: 0 = the task has its result (the E-step kernel skips it)
    final_ptr,  # [T] int8: 1 = the E-step just run was the task's final one (early stopping)
    em_steps_ptr,  # [T] int32: EM steps the task ran (written when it settles)
    step, inertia, rho, tol,
    S: tl.constexpr, Q: tl.constexpr, N: tl.constexpr, M: tl.constexpr, R_PAD: tl.constexpr, K_PAD: tl.constexpr,
    UPDATE: tl.constexpr, EARLY_STOP: tl.constexpr,
):
    """The M-step of one task (one program per task), its next pair costs and its early-stopping decision; see the
    module docstring. ``UPDATE``: 0 π_f, 1 π_b, 2 ``ρ·π_f + (1−ρ)·π_b`` (:data:`PROTOTYPE_UPDATE_CODES`)."""
    t = tl.program_id(0).to(tl.int64)
    if tl.load(active_ptr + t) != 0:
        if tl.load(final_ptr + t) != 0:  # that E-step was the task's final one: it has its result
            tl.store(active_ptr + t, tl.zeros((), dtype=tl.int8))
        else:
            r = tl.arange(0, R_PAD)
            c = tl.arange(0, K_PAD)
            row_ok = r < S + Q
            col_ok = c < M
            is_query = (r >= S) & row_ok
            q = tl.where(is_query, r - S, 0)
            x = tl.load(rows_ptr + t * ((S + Q) * M) + r[:, None] * M + c[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            moved = tl.zeros((), dtype=tl.float32)
            for k in tl.static_range(N):
                support = tl.load(support_ptr + t * (S * N) + r * N + k, mask=r < S, other=0.0)
                pi = t * (Q * N) + q * N + k
                if UPDATE == 0:
                    query = tl.load(forward_ptr + pi, mask=is_query, other=0.0)
                elif UPDATE == 1:
                    query = tl.load(backward_ptr + pi, mask=is_query, other=0.0)
                else:
                    query = (rho * tl.load(forward_ptr + pi, mask=is_query, other=0.0)
                             + (1.0 - rho) * tl.load(backward_ptr + pi, mask=is_query, other=0.0))
                weight = tl.where(r < S, support, query)
                total = tl.sum(weight[:, None] * x, axis=0)
                mass = tl.maximum(tl.sum(weight, axis=0), 1.1754943508222875e-38)  # clamp_min(finfo.tiny)
                old = tl.load(proto_ptr + t * (N * M) + k * M + c, mask=col_ok, other=0.0)
                new = old + inertia * (total / mass - old)
                moved = tl.maximum(moved, tl.max(tl.abs(new - old), axis=0))
                tl.store(proto_ptr + t * (N * M) + k * M + c, new, mask=col_ok)
                difference = tl.where(col_ok[None, :], x - new[None, :], 0.0)
                tl.store(cost_ptr + pi, tl.sum(difference * difference, axis=1), mask=is_query)
            if EARLY_STOP:
                if moved <= tol:  # settled: the next E-step is its final one
                    tl.store(final_ptr + t, tl.full((), 1, dtype=tl.int8))
                    tl.store(em_steps_ptr + t, step + 1)


def m_step_launch(rows: torch.Tensor, support_weights: torch.Tensor, forward: torch.Tensor, backward: torch.Tensor,
                  prototypes: torch.Tensor, cost: torch.Tensor, active: torch.Tensor, final: torch.Tensor,
                  em_steps: torch.Tensor, step: int, inertia: float, rho: float, tol: float | None,
                  prototype_update: str) -> tuple[list[object], dict[str, object]]:
    """:func:`m_step_kernel`'s runtime arguments and its compile-time constants and launch options for one launch
    over all tasks (every tensor contiguous, on the kernel's device); the grid is one program per task."""
    t, n, m = rows.shape
    s, ways = support_weights.shape[1:]
    arguments = [rows, support_weights, forward, backward, prototypes, cost, active, final, em_steps, step, inertia,
                 rho, -1.0 if tol is None else tol]
    constants = dict(S=s, Q=n - s, N=ways, M=m, R_PAD=triton.next_power_of_2(n),
                     K_PAD=max(16, triton.next_power_of_2(m)), UPDATE=PROTOTYPE_UPDATE_CODES[prototype_update],
                     EARLY_STOP=tol is not None, num_warps=M_STEP_WARPS)
    return arguments, constants


def launch_m_step(*args: object, kernel: object = None) -> None:
    """One launch over all tasks (the arguments of :func:`m_step_launch`) of ``kernel``, by default
    :func:`m_step_kernel` (:class:`.triton_engine.TritonEngine` passes its own, which a test may replace)."""
    arguments, constants = m_step_launch(*args)  # type: ignore[arg-type]
    (m_step_kernel if kernel is None else kernel)[(len(arguments[0]),)](*arguments, **constants)  # type: ignore
