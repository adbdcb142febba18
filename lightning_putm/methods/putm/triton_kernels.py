"""The fused E-step kernel of ``solver=triton``: every Adam step of an E-step of a task in one Triton program.

One program solves the E-step of a task (paper §3, Algorithm 1: ``inner_steps`` Adam steps of the navigator
``m → H1 → H2 → 1`` on the conditional-transport loss) without returning to the host: per Adam step it runs the
navigator forward over tiles of ``BLOCK_P`` (query, prototype) pairs, the CT head (π_f, π_b and the loss
gradient, the formula of :func:`.loss.ct_loss_gradient`), the backward pass and Adam's update (the formula of
:class:`.adam.StackedAdam`, bias corrections from a per-step schedule computed on the host). Weights and Adam
moments stay in the navigator's flat buffers in global memory (L2-resident on a GPU); activations go to a
per-program scratch. The squared differences ``(x_j − μ_k)²`` are recomputed from the query and prototype rows
where needed instead of being stored (the ``[P, m]`` input is the largest tensor of the unfused engines).

Per Adam step, for each task:

1. forward: ``h1 = leaky(x0 W1 + b1)``, ``h2 = leaky(h1 W2 + b2)``, ``d = −(h2·w3 + b3)`` tile by tile
   (``x0`` in chunks of ``BLOCK_K`` input columns); ``h1``, ``h2`` and ``d`` to the scratch;
2. the CT head on the whole ``[Q, N]`` block of logits: π_f (softmax over classes), π_b (softmax over queries),
   ``∂L/∂d``; π_f and π_b are written out at the last step (before its update, as the reference code returns);
3. backward of layers 3 and 2 tile by tile, with ``∂W2`` accumulated in registers; ``∂h1`` (after LeakyReLU's
   backward) overwrites ``h1`` in the scratch; then Adam on ``W2`` (16 rows at a time, ``∂W2`` through the
   scratch: the whole block at once spilled registers), ``w3`` and the biases;
4. ``∂W1`` a chunk of ``BLOCK_K`` rows at a time (over all pair tiles), each chunk's Adam update done at once.

``PRECISION``: 0 = fp32 products (``input_precision="ieee"``), 1 = TF32, 2 = bf16 operands with fp32
accumulation; in bf16 the values are rounded to bf16 exactly where the ``fused`` engine rounds them (its
products write bf16), so both engines run the same arithmetic up to the order of the sums. Under the Triton
interpreter (``TRITON_INTERPRET=1``, CPU tensors) a bf16 ``tl.dot`` multiplies raw bit patterns and the
fp32 → bf16 cast truncates (interpreter bugs of triton 3.8), so there (``INTERPRET``) the rounding to bf16 is
done on the bits and the bf16 values are multiplied in fp32, which is the same arithmetic. Programs loop over tasks ``pid, pid + G, …`` (G programs), so the scratch is ``G`` tasks
wide, and a task whose ``active`` flag is 0 is skipped at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Whether the kernels below were built for the interpreter (``@triton.jit`` reads ``TRITON_INTERPRET`` when it
#: decorates, i.e. when this module is imported).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

FP32, TF32, BF16 = 0, 1, 2


@triton.jit
def _bf16_value(x, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as fp32. The interpreter's own float casts truncate,
    so there the rounding is done on the bits (NaN and overflow aside, which the solver never produces)."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _rounded(x, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``x`` rounded to the compute dtype (bf16) and back to fp32; unchanged in fp32 and TF32."""
    if PRECISION == 2:
        return _bf16_value(x, INTERPRET)
    else:
        return x


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation, operands in the compute precision."""
    if PRECISION == 2:
        if INTERPRET:  # the interpreter's bf16 tl.dot is wrong: bf16 values multiplied in fp32 are the same products
            return tl.dot(_bf16_value(a, INTERPRET), _bf16_value(b, INTERPRET), acc, input_precision="ieee")
        else:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif PRECISION == 1:
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _leaky(x, slope, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """LeakyReLU, rounded like the fused engine's in-place ``leaky_relu_`` on a compute-dtype tensor."""
    return _rounded(tl.where(x > 0, x, x * slope), PRECISION, INTERPRET)


@triton.jit
def _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, grad, mask, step_size, bc2_sqrt, weight1, beta2,
          one_minus_beta2, eps, LERP_FROM_END: tl.constexpr):
    """One Adam update of the elements ``offsets`` with gradient ``grad``, as :class:`.adam.StackedAdam` does it:
    ``m ← lerp(m, g, 1−β1)``, ``v ← β2·v + (1−β2)·g²``, ``p ← p − (lr/c1)·m / (√v/√c2 + ε)``."""
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
    p = tl.load(params_ptr + offsets, mask=mask, other=0.0)
    if LERP_FROM_END:  # torch.lerp with a weight >= 0.5: end − (end − start)·(1 − weight)
        m = grad - (grad - m) * (1.0 - weight1)
    else:
        m = m + weight1 * (grad - m)
    v = v * beta2 + (one_minus_beta2 * grad) * grad
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(-step_size * m, denom)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    tl.store(params_ptr + offsets, p, mask=mask)


@triton.jit
def _inputs(query_ptr, proto_ptr, pairs, pair_ok, cols, N: tl.constexpr, M: tl.constexpr):
    """The squared differences ``(x_j − μ_k)²`` ``[BLOCK_P, BLOCK_K]`` of pairs ``p = j·N + k``, at ``cols``."""
    col_ok = cols < M
    mask = pair_ok[:, None] & col_ok[None, :]
    x = tl.load(query_ptr + (pairs // N)[:, None] * M + cols[None, :], mask=mask, other=0.0)
    mu = tl.load(proto_ptr + (pairs % N)[:, None] * M + cols[None, :], mask=mask, other=0.0)
    difference = x - mu
    return difference * difference


@triton.jit
def _ct_head(logit_scratch, gout_scratch, forward_out, backward_out, cost, head_index, head_mask, classes, rho,
             theta, last, Q: tl.constexpr, N: tl.constexpr, BALANCE: tl.constexpr):
    """The CT loss on the ``[Q_PAD, N_PAD]`` block of logits (:func:`.loss.ct_loss_gradient`, paper Eq. 7–9):
    reads the logits, writes ∂L/∂logits (negated: the navigator's output is −logit) and, at the ``last`` Adam step,
    π_f (softmax over classes) and π_b (softmax over queries); the balance term is included with ``BALANCE``;
    padded rows and columns give 0."""
    logits = tl.load(logit_scratch + head_index, mask=head_mask, other=-1.0e30)
    row_max = tl.max(logits, axis=1)
    e_rows = tl.where(head_mask, tl.exp(logits - row_max[:, None]), 0.0)
    row_sum = tl.sum(e_rows, axis=1)
    forward = e_rows / tl.where(row_sum > 0, row_sum, 1.0)[:, None]  # padded rows: 0, not 0/0
    col_max = tl.max(logits, axis=0)
    e_cols = tl.where(head_mask, tl.exp(logits - col_max[None, :]), 0.0)
    col_sum = tl.sum(e_cols, axis=0)
    backward = e_cols / tl.where(col_sum > 0, col_sum, 1.0)[None, :]
    transport = 1.0 - theta if BALANCE else 1.0
    grad_forward = (transport * rho / Q) * cost
    grad_backward = (transport * (1.0 - rho) / N) * cost
    if BALANCE:
        balance = tl.sum(rho * forward + (1.0 - rho) * backward, axis=0)
        balance_slope = tl.where(classes < N, (theta / N) * (2.0 * (balance - 1.0 / N)), 0.0)
        grad_forward = grad_forward + balance_slope[None, :] * rho
        grad_backward = grad_backward + balance_slope[None, :] * (1.0 - rho)
    grad_logits = (forward * (grad_forward - tl.sum(grad_forward * forward, axis=1)[:, None])
                   + backward * (grad_backward - tl.sum(grad_backward * backward, axis=0)[None, :]))
    tl.store(gout_scratch + head_index, -grad_logits, mask=head_mask)
    if last:
        tl.store(forward_out + head_index, forward, mask=head_mask)
        tl.store(backward_out + head_index, backward, mask=head_mask)


@triton.jit
def _hidden1(acc, pairs, bias1, slope, h1_scratch, hidden1, H1: tl.constexpr, PRECISION: tl.constexpr,
             INTERPRET: tl.constexpr):
    """``h1 = leaky(acc + b1)`` of a pair tile from its first product ``acc`` = ``x0 W1``, rounded where the
    ``fused`` engine rounds, and written to the scratch."""
    h1 = _leaky(_rounded(acc + bias1[None, :], PRECISION, INTERPRET), slope, PRECISION, INTERPRET)
    tl.store(h1_scratch + pairs[:, None] * H1 + hidden1[None, :], h1)
    return h1


@triton.jit
def _hidden2_and_logits(h1, pairs, weights2, bias2, w3_row, bias3, slope, h2_scratch, logit_scratch, hidden2,
                        BLOCK_P: tl.constexpr, H2: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """The rest of the forward of a pair tile: ``h2 = leaky(h1 W2 + b2)`` and the logits ``−(h2·w3 + b3)``, each
    written to its scratch."""
    acc2 = _dot(h1, weights2, tl.zeros((BLOCK_P, H2), dtype=tl.float32), PRECISION, INTERPRET)
    h2 = _leaky(_rounded(acc2 + bias2[None, :], PRECISION, INTERPRET), slope, PRECISION, INTERPRET)
    tl.store(h2_scratch + pairs[:, None] * H2 + hidden2[None, :], h2)
    out = _rounded(tl.sum(h2 * w3_row[None, :], axis=1), PRECISION, INTERPRET)
    tl.store(logit_scratch + pairs, -(out + bias3))


@triton.jit
def _backward_to_g2(pairs, pair_ok, w3_row, slope, gout_scratch, h1_scratch, h2_scratch, hidden1, hidden2, grad_w2,
                    grad_w3, grad_b2, grad_b3, H1: tl.constexpr, H2: tl.constexpr, PRECISION: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """The backward of layer 3 and of layer 2's LeakyReLU for a pair tile: ``∂(h1 W2 + b2)`` and the tile's ``h1``,
    with the gradient sums of ``W2``, ``w3``, ``b2`` and ``b3`` updated."""
    g_out = tl.load(gout_scratch + pairs, mask=pair_ok, other=0.0)
    grad_b3 += g_out
    g3 = _rounded(g_out, PRECISION, INTERPRET)
    h2 = tl.load(h2_scratch + pairs[:, None] * H2 + hidden2[None, :]).to(tl.float32)
    grad_w3 += tl.sum(h2 * g3[:, None], axis=0)
    g2 = _rounded(g3[:, None] * w3_row[None, :], PRECISION, INTERPRET)
    g2 = _rounded(tl.where(h2 > 0, g2, g2 * slope), PRECISION, INTERPRET)
    grad_b2 += tl.sum(g2, axis=0)
    h1 = tl.load(h1_scratch + pairs[:, None] * H1 + hidden1[None, :]).to(tl.float32)
    grad_w2 = _dot(tl.trans(h1), g2, grad_w2, PRECISION, INTERPRET)
    return g2, h1, grad_w2, grad_w3, grad_b2, grad_b3


@triton.jit
def _backward_to_h1(g2, h1, weights2_t, slope, grad_b1, BLOCK_P: tl.constexpr, H1: tl.constexpr,
                    PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``∂h1`` of a pair tile after LeakyReLU's backward (``weights2_t``: ``W2ᵀ`` as an operand), with the sum of
    ``b1``'s gradient updated."""
    g1 = _rounded(_dot(g2, weights2_t, tl.zeros((BLOCK_P, H1), dtype=tl.float32), PRECISION, INTERPRET), PRECISION,
                  INTERPRET)
    g1 = _rounded(tl.where(h1 > 0, g1, g1 * slope), PRECISION, INTERPRET)
    grad_b1 += tl.sum(g1, axis=0)
    return g1, grad_b1


#: Runtime integers that Triton must not specialize on (it compiles a separate kernel for an integer equal to 1 and
#: for one divisible by 16): the task count and Adam's step counts change between launches of one shape (a
#: one-task warm-up, then 1000 tasks; E-step 9 starts at step 240), and each new value class cost a compilation of
#: seconds in the middle of a run. They are loop bounds and schedule indices, so the hints gain nothing.
RUNTIME_INTEGERS = ("num_tasks", "inner_steps", "step0")


@triton.jit(do_not_specialize=RUNTIME_INTEGERS)
def e_step_kernel(
    query_ptr, proto_ptr, cost_ptr,  # [T, Q, M], [T, N, M], [T, Q, N] float32
    params_ptr, exp_avg_ptr, exp_avg_sq_ptr,  # flat navigator buffers (Navigator.flat's layout), float32
    active_ptr,  # [T] int8: 0 = skip the task
    schedule_ptr,  # [≥ step0 + inner_steps, 2] float32: lr/(1 − β1^s), √(1 − β2^s) of Adam steps s = 1, 2…
    forward_ptr, backward_ptr,  # [T, Q, N] float32 outputs: π_f, π_b of the last step, before its update
    h1_ptr, h2_ptr, logit_ptr, gout_ptr, dw2_ptr,  # scratch: [G, P_PAD, H1|H2], [G, P_PAD] twice, [G, H1, H2]
    num_tasks, inner_steps, step0,
    off_w2, off_w3, off_b1, off_b2, off_b3,  # where each segment of the flat buffer starts (W1 at 0)
    slope, rho, theta, weight1, beta2, one_minus_beta2, eps,
    Q: tl.constexpr, N: tl.constexpr, M: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, W3S: tl.constexpr,
    Q_PAD: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, LERP_FROM_END: tl.constexpr, BALANCE: tl.constexpr,
):
    """``inner_steps`` Adam steps of every active task's navigator (one program, several tasks in turn)."""
    P: tl.constexpr = Q * N
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    hidden1 = tl.arange(0, H1)
    hidden2 = tl.arange(0, H2)
    tile = tl.arange(0, BLOCK_P)
    chunk = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, Q_PAD)
    classes = tl.arange(0, N_PAD)
    head_mask = (rows[:, None] < Q) & (classes[None, :] < N)
    head_index = rows[:, None] * N + classes[None, :]
    # this program's scratch
    h1_scratch = h1_ptr + pid.to(tl.int64) * (P_PAD * H1)
    h2_scratch = h2_ptr + pid.to(tl.int64) * (P_PAD * H2)
    logit_scratch = logit_ptr + pid.to(tl.int64) * P_PAD
    gout_scratch = gout_ptr + pid.to(tl.int64) * P_PAD
    dw2_scratch = dw2_ptr + pid.to(tl.int64) * (H1 * H2)
    adam_rows = tl.arange(0, 16)
    for task in range(pid, num_tasks, programs):
        if tl.load(active_ptr + task) != 0:
            t = tl.cast(task, tl.int64)
            query = query_ptr + t * (Q * M)
            protos = proto_ptr + t * (N * M)
            w1 = t * (M * H1)  # offsets of this task's segments in the flat buffers
            w2 = off_w2 + t * (H1 * H2)
            w3 = off_w3 + t * (H2 * W3S)
            b1 = off_b1 + t * H1
            b2 = off_b2 + t * H2
            b3 = off_b3 + t
            cost = tl.load(cost_ptr + t * (Q * N) + head_index, mask=head_mask, other=0.0)
            for step in range(inner_steps):
                bias1 = _rounded(tl.load(params_ptr + b1 + hidden1), PRECISION, INTERPRET)
                bias2 = _rounded(tl.load(params_ptr + b2 + hidden2), PRECISION, INTERPRET)
                w3_row = _rounded(tl.load(params_ptr + w3 + hidden2 * W3S), PRECISION, INTERPRET)
                bias3 = tl.load(params_ptr + b3)
                # ---- 1. forward, tile by tile: h1, h2 and the logits to the scratch
                for p0 in range(0, P, BLOCK_P):
                    pairs = p0 + tile
                    pair_ok = pairs < P
                    acc = tl.zeros((BLOCK_P, H1), dtype=tl.float32)
                    for k0 in range(0, M, BLOCK_K):
                        cols = k0 + chunk
                        x0 = _inputs(query, protos, pairs, pair_ok, cols, N, M)
                        weights1 = tl.load(params_ptr + w1 + cols[:, None] * H1 + hidden1[None, :],
                                           mask=(cols < M)[:, None], other=0.0)
                        acc = _dot(x0, weights1, acc, PRECISION, INTERPRET)
                    h1 = _hidden1(acc, pairs, bias1, slope, h1_scratch, hidden1, H1, PRECISION, INTERPRET)
                    weights2 = tl.load(params_ptr + w2 + hidden1[:, None] * H2 + hidden2[None, :])
                    _hidden2_and_logits(h1, pairs, weights2, bias2, w3_row, bias3, slope, h2_scratch, logit_scratch,
                                        hidden2, BLOCK_P, H2, PRECISION, INTERPRET)
                tl.debug_barrier()
                # ---- 2. the CT head (loss.ct_loss_gradient): π_f, π_b and ∂L/∂logits on the [Q, N] block
                _ct_head(logit_scratch, gout_scratch, forward_ptr + t * (Q * N), backward_ptr + t * (Q * N), cost,
                         head_index, head_mask, classes, rho, theta, step == inner_steps - 1, Q, N, BALANCE)
                tl.debug_barrier()
                # ---- 3. backward of layers 3 and 2; ∂h1 replaces h1 in the scratch
                grad_w2 = tl.zeros((H1, H2), dtype=tl.float32)
                grad_w3 = tl.zeros((H2,), dtype=tl.float32)
                grad_b1 = tl.zeros((H1,), dtype=tl.float32)
                grad_b2 = tl.zeros((H2,), dtype=tl.float32)
                grad_b3 = tl.zeros((BLOCK_P,), dtype=tl.float32)
                for p0 in range(0, P, BLOCK_P):
                    pairs = p0 + tile
                    pair_ok = pairs < P
                    g2, h1, grad_w2, grad_w3, grad_b2, grad_b3 = _backward_to_g2(
                        pairs, pair_ok, w3_row, slope, gout_scratch, h1_scratch, h2_scratch, hidden1, hidden2, grad_w2,
                        grad_w3, grad_b2, grad_b3, H1, H2, PRECISION, INTERPRET)
                    weights2_t = tl.load(params_ptr + w2 + hidden2[:, None] + hidden1[None, :] * H2)
                    g1, grad_b1 = _backward_to_h1(g2, h1, weights2_t, slope, grad_b1, BLOCK_P, H1, PRECISION, INTERPRET)
                    tl.debug_barrier()  # every thread has read this tile's h1 before ∂h1 overwrites it
                    tl.store(h1_scratch + pairs[:, None] * H1 + hidden1[None, :], g1)
                # ∂W2 through the scratch, so that its Adam update runs 16 rows at a time: the whole [H1, H2]
                # update at once (gradient, weights and both moments in registers) made the kernel spill
                tl.store(dw2_scratch + hidden1[:, None] * H2 + hidden2[None, :], _rounded(grad_w2, PRECISION,
                                                                                           INTERPRET))
                tl.debug_barrier()
                step_size = tl.load(schedule_ptr + 2 * (step0 + step))
                bc2_sqrt = tl.load(schedule_ptr + 2 * (step0 + step) + 1)
                for r0 in range(0, H1, 16):
                    block = (r0 + adam_rows)[:, None] * H2 + hidden2[None, :]
                    _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, w2 + block, tl.load(dw2_scratch + block),
                          block < H1 * H2, step_size, bc2_sqrt, weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, w3 + hidden2 * W3S,
                      _rounded(grad_w3, PRECISION, INTERPRET), hidden2 < H2, step_size, bc2_sqrt, weight1, beta2,
                      one_minus_beta2, eps, LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, b1 + hidden1, grad_b1, hidden1 < H1, step_size,
                      bc2_sqrt, weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, b2 + hidden2, grad_b2, hidden2 < H2, step_size,
                      bc2_sqrt, weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, b3 + tile, tl.where(tile == 0, tl.sum(grad_b3), 0.0),
                      tile == 0, step_size, bc2_sqrt, weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                # ---- 4. ∂W1 by chunks of BLOCK_K input rows, each updated at once
                for k0 in range(0, M, BLOCK_K):
                    cols = k0 + chunk
                    grad_w1 = tl.zeros((BLOCK_K, H1), dtype=tl.float32)
                    for p0 in range(0, P, BLOCK_P):
                        pairs = p0 + tile
                        x0 = _inputs(query, protos, pairs, pairs < P, cols, N, M)
                        g1 = tl.load(h1_scratch + pairs[:, None] * H1 + hidden1[None, :]).to(tl.float32)
                        grad_w1 = _dot(tl.trans(x0), g1, grad_w1, PRECISION, INTERPRET)
                    _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, w1 + cols[:, None] * H1 + hidden1[None, :],
                          _rounded(grad_w1, PRECISION, INTERPRET), (cols < M)[:, None], step_size, bc2_sqrt,
                          weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                tl.debug_barrier()
