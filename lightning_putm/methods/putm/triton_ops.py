"""Device functions of ``solver=triton``'s kernels (:mod:`.triton_wide`, the E-step; :mod:`.triton_em` holds the
M-step's own): bf16 rounding, the products in each precision, Adam's update, the navigator's inputs and the CT head.

``PRECISION``: 0 = fp32 products (``input_precision="ieee"``), 1 = TF32, 2 = bf16 operands with fp32
accumulation; in bf16 the values are rounded to bf16 exactly where the ``fused`` engine rounds them (its
products write bf16), so the kernel and that engine run the same arithmetic up to the order of the sums. Under the
Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) a bf16 ``tl.dot`` multiplies raw bit patterns and the
fp32 → bf16 cast truncates (interpreter bugs of triton 3.8), so there (``INTERPRET``) the rounding to bf16 is
done on the bits and the bf16 values are multiplied in fp32, which is the same arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Whether the kernels below were built for the interpreter (``@triton.jit`` reads ``TRITON_INTERPRET`` when it
#: decorates, i.e. when this module is imported).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

#: The kernels' ``PRECISION``.
FP32, TF32, BF16 = 0, 1, 2
#: Runtime integers that Triton must not specialize on (it compiles a separate kernel for an integer equal to 1 and
#: for one divisible by 16): the task count and Adam's step counts change between launches of one shape (a
#: one-task warm-up, then 1000 tasks; E-step 9 starts at step 240), and each new value class cost a compilation of
#: seconds in the middle of a run. They are loop bounds and schedule indices, so the hints gain nothing.
RUNTIME_INTEGERS = ("num_tasks", "inner_steps", "step0")


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
    """The squared differences ``(x_j − μ_k)²`` ``[BLOCK_P, len(cols)]`` of pairs ``p = j·N + k``, at ``cols``."""
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
