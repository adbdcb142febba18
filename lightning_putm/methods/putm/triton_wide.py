"""The fused E-step kernel of ``solver=triton`` (the "wide" kernel): every Adam step of an E-step of a task in
one Triton program (paper §3, Algorithm 1: ``inner_steps`` Adam steps of the navigator ``m → H1 → H2 → 1`` on the
conditional-transport loss), without returning to the host.

Per Adam step a program runs the navigator forward over tiles of ``BLOCK_P`` (query, prototype) pairs, the CT head
(π_f, π_b and the loss gradient, the formula of :func:`.loss.ct_loss_gradient`), the backward pass and Adam's
update (the formula of :class:`.adam.StackedAdam`, bias corrections from a per-step schedule computed on the host).
Weights and Adam moments stay in the navigator's flat buffers in global memory; activations go to a per-program
scratch. Its design (docs/lab/gpu-kernel.md, "The wide kernel") answers what the H100 profile of a first design
found, a kernel bound by instruction issue and barriers, most of them moving the operands of many small products:

- the squared differences ``(x_j − μ_k)²`` are written once per E-step (they do not change during it), rounded
  to the compute dtype, as a ``[P_PAD, K_PAD]`` scratch (``K_PAD``: ``M`` rounded up to a power of two, the
  extra columns zero), so each product takes the whole basis width at once;
- ``W1`` and ``W2`` become product operands once per Adam step, not once per pair tile;
- the backward is one pass over the pair tiles that accumulates ``∂W1`` and ``∂W2`` in registers (``∂h1`` never
  goes to memory), which is why the kernel serves bases and hidden widths up to 128
  (:data:`.triton_engine.MAX_DIM`, :data:`.triton_engine.MAX_HIDDEN`);
- the sums over pairs of the gradients of ``w3`` and ``b2`` are small products on the tensor cores, accumulated
  over the tiles (:func:`_pair_sums`), not a reduction across the program's warps for every tile;
- activations and gradients stay bf16 tensors between operations in bf16 mode (:func:`_compute`), so they are
  stored and multiplied without converting back and forth (triton 3.6 does not remove those conversions itself);
- Adam runs over each weight matrix as one flat range.

Rounding and precisions are :mod:`.triton_ops`'s (``PRECISION``, ``INTERPRET``). Programs loop over tasks
``pid, pid + G, …`` (G programs: the engine launches one per task), and a task whose ``active`` flag is 0 is
skipped at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_putm.methods.putm.triton_ops import (RUNTIME_INTEGERS, _adam, _bf16_value, _ct_head, _dot, _inputs,
                                                    _rounded)


@triton.jit
def _compute(x, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` in the compute dtype: a bf16 tensor in bf16 mode (rounded to nearest even; under the interpreter,
    whose casts truncate, fp32 holding that value), else unchanged. Activations and gradients stay in it between
    operations: they are stored and multiplied as they are, without a conversion back and forth each time."""
    if PRECISION == 2:
        if INTERPRET:
            return _bf16_value(x, INTERPRET)
        else:
            return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _leaky(x, slope, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """LeakyReLU of a compute-dtype ``x``, rounded like the fused engine's in-place ``leaky_relu_``."""
    return tl.where(x > 0, x, _compute(x.to(tl.float32) * slope, PRECISION, INTERPRET))


@triton.jit
def _leaky_backward(g, h, slope, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """LeakyReLU's backward of a compute-dtype gradient ``g``; ``h``, its output, has the sign of its input."""
    return tl.where(h > 0, g, _compute(g.to(tl.float32) * slope, PRECISION, INTERPRET))


@triton.jit
def _pair_sums(sums, weights, values, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """``sums + weights @ values``: a pair tile's column sums ``Σ_p w_p·values[p, :]`` (``weights`` ``[16, BLOCK_P]``
    holds ``w`` in row 0, zeros below; row 0 of ``sums`` is the total) on the tensor cores, instead of a reduction
    across the program's threads and warps for every tile (shuffles and a barrier each). Exact products in bf16
    (bf16 values multiply exactly in fp32) and fp32; TF32 would round them, so it multiplies in fp32."""
    if PRECISION == 2:
        return _dot(weights, values, sums, PRECISION, INTERPRET)
    else:
        return tl.dot(weights, values, sums, input_precision="ieee")


@triton.jit
def _hidden1(x0, weights1, bias1, slope, BLOCK_P: tl.constexpr, H1: tl.constexpr, PRECISION: tl.constexpr,
             INTERPRET: tl.constexpr):
    """The navigator's first hidden layer ``h1 = LeakyReLU(x0 W1 + b1)`` of a pair tile, in the compute dtype."""
    acc = _dot(x0, weights1, tl.zeros((BLOCK_P, H1), dtype=tl.float32), PRECISION, INTERPRET)
    return _leaky(_compute(acc + bias1[None, :], PRECISION, INTERPRET), slope, PRECISION, INTERPRET)


@triton.jit
def _hidden2(h1, weights2, bias2, slope, BLOCK_P: tl.constexpr, H2: tl.constexpr, PRECISION: tl.constexpr,
             INTERPRET: tl.constexpr):
    """The second hidden layer ``h2 = LeakyReLU(h1 W2 + b2)`` of a pair tile, in the compute dtype."""
    acc = _dot(h1, weights2, tl.zeros((BLOCK_P, H2), dtype=tl.float32), PRECISION, INTERPRET)
    return _leaky(_compute(acc + bias2[None, :], PRECISION, INTERPRET), slope, PRECISION, INTERPRET)


@triton.jit
def _store_inputs(x0_scratch, x0, pairs, basis, K_PAD: tl.constexpr):
    """A pair tile's inputs ``[BLOCK_P, K_PAD]`` (columns from ``M`` on: zeros) to the scratch."""
    tl.store(x0_scratch + pairs[:, None] * K_PAD + basis[None, :], x0)


@triton.jit
def _load_inputs(x0_scratch, pairs, basis, K_PAD: tl.constexpr):
    """A pair tile's inputs ``[BLOCK_P, K_PAD]`` from the scratch that :func:`_store_inputs` wrote."""
    return tl.load(x0_scratch + pairs[:, None] * K_PAD + basis[None, :])


@triton.jit
def _forward_tile(x0, pairs, weights1, weights2, bias1, bias2, w3_row, bias3, slope, h1_scratch, h2_scratch,
                  logit_scratch, hidden1, hidden2, BLOCK_P: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr,
                  PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """The navigator's forward of a pair tile: ``h1``, ``h2`` and the logits ``−(h2·w3 + b3)`` to the scratch."""
    h1 = _hidden1(x0, weights1, bias1, slope, BLOCK_P, H1, PRECISION, INTERPRET)
    tl.store(h1_scratch + pairs[:, None] * H1 + hidden1[None, :], h1)
    h2 = _hidden2(h1, weights2, bias2, slope, BLOCK_P, H2, PRECISION, INTERPRET)
    tl.store(h2_scratch + pairs[:, None] * H2 + hidden2[None, :], h2)
    out = _rounded(tl.sum(h2.to(tl.float32) * w3_row[None, :], axis=1), PRECISION, INTERPRET)
    tl.store(logit_scratch + pairs, -(out + bias3))


@triton.jit
def _backward_tile(pairs, pair_ok, x0, weights2, w3_row, ones_row, row0, slope, gout_scratch, h1_scratch,
                   h2_scratch, hidden1, hidden2, grad_w1, grad_w2, sums_w3, sums_b2, grad_b1, grad_b3,
                   BLOCK_P: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, PRECISION: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """The backward of a pair tile from ``∂L/∂logits`` in the scratch: every gradient sum updated (``w3``'s and
    ``b2``'s as :func:`_pair_sums`; ``row0``: ``[16]``, true in row 0); ``h1`` and ``h2`` from the scratch."""
    g_out = tl.load(gout_scratch + pairs, mask=pair_ok, other=0.0)
    grad_b3 += g_out
    h2 = tl.load(h2_scratch + pairs[:, None] * H2 + hidden2[None, :])
    g_out_row = tl.load(gout_scratch + pairs[None, :] + 0 * row0[:, None], mask=row0[:, None] & pair_ok[None, :],
                        other=0.0)
    sums_w3 = _pair_sums(sums_w3, _compute(g_out_row, PRECISION, INTERPRET), h2, PRECISION, INTERPRET)
    g3 = _rounded(g_out, PRECISION, INTERPRET)
    g2 = _leaky_backward(_compute(g3[:, None] * w3_row[None, :], PRECISION, INTERPRET), h2, slope, PRECISION,
                         INTERPRET)
    sums_b2 = _pair_sums(sums_b2, ones_row, g2, PRECISION, INTERPRET)
    h1 = tl.load(h1_scratch + pairs[:, None] * H1 + hidden1[None, :])
    grad_w2 = _dot(tl.trans(h1), g2, grad_w2, PRECISION, INTERPRET)
    g1 = _dot(g2, tl.trans(weights2), tl.zeros((BLOCK_P, H1), dtype=tl.float32), PRECISION, INTERPRET)
    g1 = _leaky_backward(_compute(g1, PRECISION, INTERPRET), h1, slope, PRECISION, INTERPRET)
    grad_b1 += tl.sum(g1.to(tl.float32), axis=0)
    grad_w1 = _dot(tl.trans(x0), g1, grad_w1, PRECISION, INTERPRET)
    return grad_w1, grad_w2, sums_w3, sums_b2, grad_b1, grad_b3


@triton.jit
def _adam_block(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, offsets, grad, mask, step_size, bc2_sqrt, weight1, beta2,
                one_minus_beta2, eps, LERP_FROM_END: tl.constexpr):
    """:func:`.triton_ops._adam` over one flat block of a weight matrix: the square root and the divisions correctly
    rounded, as torch's Adam computes them."""
    m = tl.load(exp_avg_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0.0)
    p = tl.load(params_ptr + offsets, mask=mask, other=0.0)
    if LERP_FROM_END:  # torch.lerp with a weight >= 0.5: end − (end − start)·(1 − weight)
        m = grad - (grad - m) * (1.0 - weight1)
    else:
        m = m + weight1 * (grad - m)
    v = v * beta2 + (one_minus_beta2 * grad) * grad
    p = p + tl.div_rn(-step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    tl.store(params_ptr + offsets, p, mask=mask)


@triton.jit(do_not_specialize=RUNTIME_INTEGERS)
def e_step_kernel_wide(
    query_ptr, proto_ptr, cost_ptr,  # [T, Q, M], [T, N, M], [T, Q, N] float32
    params_ptr, exp_avg_ptr, exp_avg_sq_ptr,  # flat navigator buffers (Navigator.flat's layout), float32
    active_ptr,  # [T] int8: 0 = skip the task
    schedule_ptr,  # [≥ step0 + inner_steps, 2] float32: lr/(1 − β1^s), √(1 − β2^s) of Adam steps s = 1, 2…
    forward_ptr, backward_ptr,  # [T, Q, N] float32 outputs: π_f, π_b of the last step, before its update
    x0_ptr, h1_ptr, h2_ptr, logit_ptr, gout_ptr, grad_ptr,  # scratch: [G, P_PAD, K_PAD|H1|H2], [G, P_PAD] twice,
    num_tasks, inner_steps, step0,                          # [G, M·H1 + H1·H2]
    off_w2, off_w3, off_b1, off_b2, off_b3,  # where each segment of the flat buffer starts (W1 at 0)
    slope, rho, theta, weight1, beta2, one_minus_beta2, eps,
    Q: tl.constexpr, N: tl.constexpr, M: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, W3S: tl.constexpr,
    Q_PAD: tl.constexpr, N_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_P: tl.constexpr, K_PAD: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRET: tl.constexpr, LERP_FROM_END: tl.constexpr, BALANCE: tl.constexpr,
    ADAM_BLOCK: tl.constexpr = 2048,
):
    """``inner_steps`` Adam steps of every active task's navigator (one program, several tasks in turn; see the
    module docstring)."""
    P: tl.constexpr = Q * N
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    hidden1 = tl.arange(0, H1)
    hidden2 = tl.arange(0, H2)
    tile = tl.arange(0, BLOCK_P)
    basis = tl.arange(0, K_PAD)
    rows = tl.arange(0, Q_PAD)
    classes = tl.arange(0, N_PAD)
    head_mask = (rows[:, None] < Q) & (classes[None, :] < N)
    head_index = rows[:, None] * N + classes[None, :]
    x0_scratch = x0_ptr + pid.to(tl.int64) * (P_PAD * K_PAD)
    h1_scratch = h1_ptr + pid.to(tl.int64) * (P_PAD * H1)
    h2_scratch = h2_ptr + pid.to(tl.int64) * (P_PAD * H2)
    logit_scratch = logit_ptr + pid.to(tl.int64) * P_PAD
    gout_scratch = gout_ptr + pid.to(tl.int64) * P_PAD
    dw1_scratch = grad_ptr + pid.to(tl.int64) * (M * H1 + H1 * H2)  # laid out like W1 and W2 in the flat buffer
    dw2_scratch = dw1_scratch + M * H1
    adam_block = tl.arange(0, ADAM_BLOCK)
    row0 = tl.arange(0, 16) == 0
    ones_row = tl.where(row0[:, None] & (tile[None, :] >= 0), 1.0, 0.0)  # [16, BLOCK_P]: _pair_sums's plain sum
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
            # ---- 0. the navigator's inputs, once per E-step (they do not change during it)
            for p0 in range(0, P_PAD, BLOCK_P):
                pairs = p0 + tile
                x0 = _rounded(_inputs(query, protos, pairs, pairs < P, basis, N, M), PRECISION, INTERPRET)
                _store_inputs(x0_scratch, x0, pairs, basis, K_PAD)
            tl.debug_barrier()
            for step in range(inner_steps):
                bias1 = _rounded(tl.load(params_ptr + b1 + hidden1), PRECISION, INTERPRET)
                bias2 = _rounded(tl.load(params_ptr + b2 + hidden2), PRECISION, INTERPRET)
                w3_row = _rounded(tl.load(params_ptr + w3 + hidden2 * W3S), PRECISION, INTERPRET)
                bias3 = tl.load(params_ptr + b3)
                weights2 = _compute(tl.load(params_ptr + w2 + hidden1[:, None] * H2 + hidden2[None, :]), PRECISION,
                                    INTERPRET)
                # ---- 1. forward, tile by tile: h1, h2 and the logits to the scratch
                weights1 = _compute(tl.load(params_ptr + w1 + basis[:, None] * H1 + hidden1[None, :],
                                            mask=(basis < M)[:, None], other=0.0), PRECISION, INTERPRET)
                for p0 in range(0, P, BLOCK_P):
                    pairs = p0 + tile
                    x0 = _load_inputs(x0_scratch, pairs, basis, K_PAD)
                    _forward_tile(x0, pairs, weights1, weights2, bias1, bias2, w3_row, bias3, slope, h1_scratch,
                                  h2_scratch, logit_scratch, hidden1, hidden2, BLOCK_P, H1, H2, PRECISION, INTERPRET)
                tl.debug_barrier()
                # ---- 2. the CT head (loss.ct_loss_gradient): π_f, π_b and ∂L/∂logits on the [Q, N] block
                _ct_head(logit_scratch, gout_scratch, forward_ptr + t * (Q * N), backward_ptr + t * (Q * N), cost,
                         head_index, head_mask, classes, rho, theta, step == inner_steps - 1, Q, N, BALANCE)
                tl.debug_barrier()
                # ---- 3. backward in one pass over the pair tiles: ∂W1 and ∂W2 accumulate together
                grad_w1 = tl.zeros((K_PAD, H1), dtype=tl.float32)
                grad_w2 = tl.zeros((H1, H2), dtype=tl.float32)
                sums_w3 = tl.zeros((16, H2), dtype=tl.float32)  # row 0: Σ_p ∂L/∂logit_p · h2[p, :] (_pair_sums)
                sums_b2 = tl.zeros((16, H2), dtype=tl.float32)  # row 0: Σ_p ∂h2[p, :]
                grad_b1 = tl.zeros((H1,), dtype=tl.float32)
                grad_b3 = tl.zeros((BLOCK_P,), dtype=tl.float32)
                for p0 in range(0, P, BLOCK_P):
                    pairs = p0 + tile
                    x0 = _load_inputs(x0_scratch, pairs, basis, K_PAD)
                    grad_w1, grad_w2, sums_w3, sums_b2, grad_b1, grad_b3 = _backward_tile(
                        pairs, pairs < P, x0, weights2, w3_row, ones_row, row0, slope, gout_scratch, h1_scratch,
                        h2_scratch, hidden1, hidden2, grad_w1, grad_w2, sums_w3, sums_b2, grad_b1, grad_b3, BLOCK_P,
                        H1, H2, PRECISION, INTERPRET)
                grad_w3 = tl.sum(sums_w3, axis=0)
                grad_b2 = tl.sum(sums_b2, axis=0)
                # ∂W1 and ∂W2 through the scratch, so that Adam updates each as flat blocks of ADAM_BLOCK elements
                # (the whole matrices at once, with the weights and both moments in registers, would spill)
                tl.store(dw1_scratch + basis[:, None] * H1 + hidden1[None, :], _rounded(grad_w1, PRECISION,
                                                                                         INTERPRET),
                         mask=(basis < M)[:, None])
                tl.store(dw2_scratch + hidden1[:, None] * H2 + hidden2[None, :], _rounded(grad_w2, PRECISION,
                                                                                           INTERPRET))
                tl.debug_barrier()
                step_size = tl.load(schedule_ptr + 2 * (step0 + step))
                bc2_sqrt = tl.load(schedule_ptr + 2 * (step0 + step) + 1)
                # W1's and W2's updates: two loops written out here, not one helper, because the sm_90 instruction
                # estimate (tools/triton_resources.py) weighs machine-code loops by the kernel's own source loops
                for e0 in range(0, M * H1, ADAM_BLOCK):
                    flat = e0 + adam_block
                    _adam_block(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, w1 + flat,
                                tl.load(dw1_scratch + flat, mask=flat < M * H1, other=0.0).to(tl.float32),
                                flat < M * H1, step_size, bc2_sqrt, weight1, beta2, one_minus_beta2, eps,
                                LERP_FROM_END)
                for e0 in range(0, H1 * H2, ADAM_BLOCK):
                    flat = e0 + adam_block
                    _adam_block(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, w2 + flat,
                                tl.load(dw2_scratch + flat, mask=flat < H1 * H2, other=0.0).to(tl.float32),
                                flat < H1 * H2, step_size, bc2_sqrt, weight1, beta2, one_minus_beta2, eps,
                                LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, w3 + hidden2 * W3S,
                      _rounded(grad_w3, PRECISION, INTERPRET), hidden2 < H2, step_size, bc2_sqrt, weight1, beta2,
                      one_minus_beta2, eps, LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, b1 + hidden1, grad_b1, hidden1 < H1, step_size,
                      bc2_sqrt, weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, b2 + hidden2, grad_b2, hidden2 < H2, step_size,
                      bc2_sqrt, weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                _adam(params_ptr, exp_avg_ptr, exp_avg_sq_ptr, b3 + tile, tl.where(tile == 0, tl.sum(grad_b3), 0.0),
                      tile == 0, step_size, bc2_sqrt, weight1, beta2, one_minus_beta2, eps, LERP_FROM_END)
                tl.debug_barrier()
