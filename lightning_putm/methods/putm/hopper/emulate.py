"""The Hopper kernel's arithmetic replayed with torch on any device: the CPU check of its numerics.

:func:`e_step` computes what one launch of ``e_step.cu`` computes, step by step in the kernel's order: the inputs
``bf16((x_j − μ_k)²)`` with the ones column, padded to whole passes of 128 pairs; the fp32 W, m, v gathered into the
threads' fragment slots through :attr:`.layout.Layout.slot_index` and scattered back at the end; per Adam step the
bf16 weights made from the slots; each product accumulated in fp32 k-step by k-step from the bias (16 inputs a step,
then 8), rounded to bf16 where the kernel rounds (every product's output, LeakyReLU's ``x·slope`` as
``bf16(x·hi + bf16(x·lo))``, the gradients of the weights but not of the biases, which sum in fp32 through the ones
columns); ``∂W1ᵀ``, ``∂W2ᵀ`` accumulated pass by pass and 16 pairs at a time; L3's sum in the lanes' order; Adam on
the slots with the bias corrections of a schedule; ``(π_f, π_b)`` of the last step before its update.

``w3``'s and ``b3``'s gradients are summed in the kernel's order too (:func:`w3_gradient`, :func:`b3_gradient`).

What it cannot replay: the order of the 16 products inside one tensor-core instruction, the GPU's approximate
``exp``, square root and reciprocal (``__expf``, ``sqrt.approx``, ``rcp.approx``: within 2 ulp; here the exact
functions), and the order of the CT head's softmax sums. Each is a float-rounding difference.

:class:`EmulatedEngine` runs it as an E-step :class:`~..engines.Engine`, so the emulation runs the ordinary EM loop
(``PUTM(engine=EmulatedEngine)``) and is checked end to end against the ``fused`` engine (tests/test_putm_hopper.py).
:class:`KernelEngine` is what it shares with the GPU engine, :class:`.launch.HopperEngine`.
"""

from __future__ import annotations

import torch

from lightning_putm.methods.putm.adam import ADAM_EPS
from lightning_putm.methods.putm.engines import Engine
from lightning_putm.methods.putm.hopper.layout import B1, B2, H1, H2, PASS, THREADS, W1, W2, Layout
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings


def bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest bf16 (ties to even), as float32."""
    return x.to(torch.bfloat16).to(torch.float32)


def split_slope(slope: float) -> tuple[float, float]:
    """The fp32 slope as ``hi + lo``, both bf16 (the kernel's ``Slope``)."""
    hi = float(bf16(torch.tensor(slope, dtype=torch.float32)))
    lo = float(bf16(torch.tensor(slope, dtype=torch.float32) - hi))
    return hi, lo


def times_slope(x: torch.Tensor, slope: tuple[float, float]) -> torch.Tensor:
    """``bf16(x·hi + bf16(x·lo))`` of bf16 values ``x``: the kernel's packed ``x·slope``."""
    hi, lo = slope
    return bf16(x * hi + bf16(x * lo))


def leaky(x: torch.Tensor, slope: tuple[float, float]) -> torch.Tensor:
    return torch.maximum(x, times_slope(x, slope))


def leaky_backward(g: torch.Tensor, h: torch.Tensor, slope: tuple[float, float]) -> torch.Tensor:
    return torch.where(h <= 0, times_slope(g, slope), g)


def chunked_product(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """``start + a @ b`` accumulated in fp32 over consecutive slices of the inner dimension (the k-steps)."""
    acc, k0 = start, 0
    for width in widths:
        acc = acc + a[..., k0:k0 + width] @ b[..., k0:k0 + width, :]
        k0 += width
    return acc


class Parts:
    """Where the W1, W2, b1, b2 segments start in a navigator's flat buffer and their sizes per task."""

    def __init__(self, navigator: Navigator) -> None:
        weights, biases = navigator.views(navigator.flat)
        sizes = [part[0].numel() for part in [*weights, *biases]]
        starts = [0]
        for part in [*weights, *biases][:-1]:
            starts.append(starts[-1] + part.numel())
        self.starts = (starts[0], starts[1], starts[3], starts[4])
        self.sizes = (sizes[0], sizes[1], sizes[3], sizes[4])
        self.w3, self.b3 = starts[2], starts[5]


def e_step(layout: Layout, query: torch.Tensor, prototypes: torch.Tensor, cost: torch.Tensor,
           navigator: Navigator, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, schedule: torch.Tensor,
           active: torch.Tensor, settings: PUTMSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """One E-step (``settings.inner_steps`` Adam steps; ``schedule[s]`` = Adam's step size and √(1 − β2^s) of its
    ``s``-th step) of the active tasks, in place on the navigator's flat buffer and the moments; returns
    ``(π_f, π_b)`` ``[T, Q, N]`` of the last step before its update (zeros for inactive tasks)."""
    s, flat = settings, navigator.flat
    t_all, q, m = query.shape
    n = prototypes.shape[1]
    forward_out = torch.zeros(t_all, q, n, device=flat.device)
    backward_out = torch.zeros_like(forward_out)
    tasks = active.nonzero().squeeze(1)
    if not len(tasks):
        return forward_out, backward_out
    t = len(tasks)
    parts = Parts(navigator)
    p, p_pad, xs = layout.pairs, layout.padded_pairs, layout.row_stride
    slope = split_slope(s.negative_slope)
    beta1, beta2 = s.adam_betas
    weight1 = 1 - beta1
    rho, theta = s.rho, s.theta
    # ---- per E-step setup: the inputs with their ones column, the slots' fp32 state
    x, mu = query[tasks], prototypes[tasks]
    x0 = torch.zeros(t, p_pad, xs, device=flat.device)
    x0[:, :p, :m] = bf16((x.unsqueeze(2) - mu.unsqueeze(1)).pow(2).reshape(t, p, m))
    x0[:, :p, m] = 1.0
    c = torch.zeros(t, p_pad, device=flat.device)
    c[:, :p] = cost[tasks].reshape(t, p)
    positions = layout.flat_positions(parts.starts, parts.sizes, t_all)[tasks.cpu()].to(flat.device)
    real = positions >= 0
    where = positions.clamp(min=0)
    state = [torch.where(real, buffer[where], 0.0) for buffer in (flat, exp_avg, exp_avg_sq)]
    w3_at = parts.w3 + tasks.unsqueeze(1) * (H2 * 8) + torch.arange(H2, device=flat.device) * 8
    b3_at = parts.b3 + tasks
    k_widths = [16] * layout.k16 + [8] * layout.k8
    with_bias = torch.zeros(t, p_pad, H1 + 8, device=flat.device)  # staged h1 | 1 | 0
    with_bias[:, :, H1] = 1.0
    for step in range(s.inner_steps):
        # the bf16 operands, from the slots (what the previous step's Adam wrote to shared memory)
        work = flat.clone()
        work[positions[real]] = state[0][real]
        weights, biases = navigator.views(work)
        w1 = torch.zeros(t, xs, H1, device=flat.device)
        w1[:, :m] = bf16(weights[0][tasks])
        w2 = bf16(weights[1][tasks])
        w3 = bf16(flat[w3_at])
        b1, b2, b3 = bf16(biases[0][tasks]), bf16(biases[1][tasks]), flat[b3_at]
        # ---- forward, pass by pass (the passes do not interact: all rows at once)
        h1 = leaky(bf16(chunked_product(x0, w1, b1.expand(t, p_pad, H1), k_widths)), slope)
        h2 = leaky(bf16(chunked_product(h1, w2, b2.expand(t, p_pad, H2), [16] * (H1 // 16))), slope)
        lanes = []
        for lane in range(4):  # each lane of a quad sums its columns 8n + 2t + 1, then 8n + 2t, n = 0..7
            acc = torch.zeros(t, p_pad, device=flat.device)
            for block in range(8):
                for column in (8 * block + 2 * lane + 1, 8 * block + 2 * lane):
                    acc = acc + h2[:, :, column] * w3[:, column].unsqueeze(1)
            lanes.append(acc)
        out = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
        logits = -(bf16(out) + b3.unsqueeze(1))[:, :p].reshape(t, q, n)
        # ---- the CT head, fp32
        forward = torch.softmax(logits, dim=2)
        backward = torch.softmax(logits, dim=1)
        grad_f = ((1 - theta) * rho / q) * c[:, :p].reshape(t, q, n)
        grad_b = ((1 - theta) * (1 - rho) / n) * c[:, :p].reshape(t, q, n)
        if theta != 0:
            balance = (rho * forward + (1 - rho) * backward).sum(1, keepdim=True)
            slope_k = theta / n * (2 * (balance - 1 / n))
            grad_f, grad_b = grad_f + slope_k * rho, grad_b + slope_k * (1 - rho)
        grad = (forward * (grad_f - (grad_f * forward).sum(2, keepdim=True))
                + backward * (grad_b - (grad_b * backward).sum(1, keepdim=True)))
        gout = torch.zeros(t, p_pad, device=flat.device)
        gout[:, :p] = -grad.reshape(t, p)
        if step == s.inner_steps - 1:
            forward_out[tasks], backward_out[tasks] = forward, backward
        # ---- backward
        gr = bf16(gout)
        grad_w3 = w3_gradient(gr, h2)
        g2 = leaky_backward(bf16(gr.unsqueeze(2) * w3.unsqueeze(1)), h2, slope)
        g1 = leaky_backward(bf16(chunked_product(g2, w2.transpose(1, 2), torch.zeros(t, p_pad, H1, device=flat.device),
                                                 [16] * (H2 // 16))), h1, slope)
        with_bias[:, :, :H1] = h1
        dw1t = torch.zeros(t, H1, xs, device=flat.device)
        dw2t = torch.zeros(t, H2, H1 + 8, device=flat.device)
        for p0 in range(0, p_pad, 16):  # pass by pass, 16 pairs a k-step
            dw1t = dw1t + g1[:, p0:p0 + 16].transpose(1, 2) @ x0[:, p0:p0 + 16]
            dw2t = dw2t + g2[:, p0:p0 + 16].transpose(1, 2) @ with_bias[:, p0:p0 + 16]
        # the slots' gradients: weights rounded to bf16 (the products' outputs), biases fp32
        slot_grad = slot_gradients(layout, dw1t, dw2t)
        step_size, bc2 = float(schedule[step, 0]), float(schedule[step, 1])
        params, mean, square = state
        adam(params, mean, square, slot_grad, weight1, beta2, step_size, bc2)
        small = torch.cat([grad_w3, b3_gradient(gout[:, :p].reshape(t, q, n))], dim=1)
        small_at = torch.cat([w3_at, b3_at.unsqueeze(1)], dim=1)
        small_state = [buffer[small_at] for buffer in (flat, exp_avg, exp_avg_sq)]
        adam(*small_state, small, weight1, beta2, step_size, bc2)
        for buffer, value in zip((flat, exp_avg, exp_avg_sq), small_state):
            buffer[small_at] = value
    for buffer, value in zip((flat, exp_avg, exp_avg_sq), state):
        buffer[positions[real]] = value[real]
    return forward_out, backward_out


def w3_gradient(gr: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
    """``bf16(Σ_p gr_p · h2_p)`` ``[T, 64]`` in the kernel's order: warp ``w`` owns rows ``16w..16w+15`` of every
    pass; per pass it adds its 8 row pairs ``(r, r + 8)`` in order, each pair's two products (exact in fp32: bf16
    times bf16) rounded once by their sum; then the 8 warps' sums, warp 0 first, from 0."""
    t, padded = gr.shape
    products = (gr.unsqueeze(2) * h2).reshape(t, padded // PASS, THREADS // 32, 16, H2)
    pairs = products[:, :, :, :8] + products[:, :, :, 8:]  # [T, passes, warps, 8, 64]
    per_warp = torch.zeros(t, THREADS // 32, H2, dtype=gr.dtype, device=gr.device)
    for pass_ in range(pairs.shape[1]):
        for r in range(8):
            per_warp = per_warp + pairs[:, pass_, :, r]
    total = torch.zeros(t, H2, dtype=gr.dtype, device=gr.device)
    for warp in range(per_warp.shape[1]):
        total = total + per_warp[:, warp]
    return bf16(total)


def b3_gradient(gout: torch.Tensor) -> torch.Tensor:
    """``Σ dL/dlogit`` ``[T, 1]`` in the kernel's order (fp32, not rounded: a bias): thread ``j`` sums query ``j``'s
    row over the classes in order, each warp's 32 threads by a butterfly (``x + x[lane ^ o]``, o = 16, 8, 4, 2, 1),
    then the 8 warps' sums, warp 0 first, from 0; threads past the last query hold 0."""
    t, q, n = gout.shape
    rows = torch.zeros(t, THREADS, dtype=gout.dtype, device=gout.device)
    for k in range(n):
        rows[:, :q] = rows[:, :q] + gout[:, :, k]
    lanes = rows.reshape(t, THREADS // 32, 32)
    index = torch.arange(32, device=gout.device)
    for offset in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, :, index ^ offset]
    total = torch.zeros(t, 1, dtype=gout.dtype, device=gout.device)
    for warp in range(lanes.shape[1]):
        total = total + lanes[:, warp, :1]
    return total


def slot_gradients(layout: Layout, dw1t: torch.Tensor, dw2t: torch.Tensor) -> torch.Tensor:
    """``[T, slots, 256]``: each slot's gradient from the accumulated ``∂W1ᵀ`` ``[T, 128, XS]`` and ``∂W2ᵀ``
    ``[T, 64, 136]``, rounded to bf16 for the weights (0 for padding slots)."""
    table = layout.slot_index.to(torch.int64).to(dw1t.device)
    segment, offset = table >> 24, table & 0xFFFFFF
    t = dw1t.shape[0]
    # every segment's gradient laid out like the navigator's segment: W1 [M, 128], W2 [128, 64], b1, b2
    w1 = bf16(dw1t[:, :, :layout.dim].transpose(1, 2)).reshape(t, -1)
    w2 = bf16(dw2t[:, :, :H1].transpose(1, 2)).reshape(t, -1)
    b1, b2 = dw1t[:, :, layout.dim], dw2t[:, :, H1]
    out = torch.zeros(t, *table.shape, device=dw1t.device)
    for code, values in ((W1, w1), (W2, w2), (B1, b1), (B2, b2)):
        mask = segment == code
        out[:, mask] = values[:, offset[mask]]
    return out


def adam(params: torch.Tensor, mean: torch.Tensor, square: torch.Tensor, grad: torch.Tensor, weight1: float,
         beta2: float, step_size: float, bc2: float) -> None:
    """The kernel's Adam (``adam1``, its exact form) in place: torch.lerp's form for the weight, then
    ``p − step_size · m / (√v / bc2 + ε)``."""
    if weight1 >= 0.5:
        mean.copy_(grad - (grad - mean) * (1 - weight1))
    else:
        mean.copy_(mean + weight1 * (grad - mean))
    square.copy_(square * beta2 + ((1 - beta2) * grad) * grad)
    params.copy_(params + (-step_size) * (mean / (square.sqrt() / bc2 + ADAM_EPS)))


class KernelEngine(Engine):
    """What the kernel's two engines share (:class:`EmulatedEngine` here, :class:`.launch.HopperEngine`): fp32 Adam
    moments laid out like the navigator's flat buffer, Adam's step count carried across E-steps (the bias
    corrections of a schedule), bf16 products whatever ``compute_dtype`` is asked (``solver=hopper`` refuses any
    other ``precision`` first, :mod:`.support`), and a fixed batch: settled tasks are skipped through an ``active``
    mask, as the kernel's blocks return at once for them."""

    fixed_batch = True
    #: The dtype of :attr:`active` the kernel reads (int8) or the emulation indexes with (bool).
    active_dtype = torch.bool

    def __init__(self, navigator: Navigator, settings: PUTMSettings,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(navigator, settings, torch.bfloat16)
        self.exp_avg = torch.zeros_like(navigator.flat)
        self.exp_avg_sq = torch.zeros_like(navigator.flat)
        self.steps = 0
        self.active = torch.ones(navigator.num_tasks, dtype=self.active_dtype, device=navigator.flat.device)

    @classmethod
    def unsupported(cls, queries: int, ways: int, m: int, settings: PUTMSettings) -> str | None:
        from lightning_putm.methods.putm.hopper.support import settings_reason, shape_reason

        return settings_reason(settings.hidden, settings.precision) or shape_reason(queries, ways, m)

    def layout(self, query: torch.Tensor, ways: int) -> Layout:
        """The kernel's layout for this E-step's shape (refused with the reason where it cannot take it: the
        method checks it before any work, :meth:`unsupported`, so this is a guard)."""
        layout = Layout(query.shape[1], ways, query.shape[2])
        reason = layout.unsupported()
        if reason is not None:
            raise ValueError(f"the Hopper kernel does not take this shape: {reason}")
        return layout

    def reinit(self, generators: list[torch.Generator]) -> None:
        self.navigator.redraw(generators)
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.steps = 0

    def keep_only(self, live: torch.Tensor) -> None:
        self.active = live.to(device=self.navigator.flat.device, dtype=self.active_dtype)


class EmulatedEngine(KernelEngine):
    """:func:`e_step` as an E-step engine (any device): the CPU stand-in of :class:`.launch.HopperEngine`, run
    through the EM loop by handing it to the method (``PUTM(engine=EmulatedEngine)``); not a ``solver`` value."""

    @classmethod
    def bytes_per_task(cls, pairs: int, m: int, settings: PUTMSettings) -> int:
        """:func:`e_step`'s largest tensors per task (fp32 unless said): the navigator, its two moments and the
        step's copy of it; the slots' W, m, v, their gradient and their flat positions (two int64 tables); the
        padded inputs and their staged bias copy; h1, h2 and their gradients with one product's temporary each;
        ∂W1ᵀ, ∂W2ᵀ; the bf16-rounded weight copies; the costs, π_f, π_b and the CT head's terms."""
        layout = Layout(1, 1, m)
        params = Navigator.numel([m, *settings.hidden, 1], 1)
        slot_words = layout.slots * THREADS
        rows = layout.row_stride
        padded = -(-pairs // PASS) * PASS
        activations = padded * (rows + (H1 + 8) + 2 * (2 * H1 + 2 * H2))
        accumulators = H1 * rows + H2 * (H1 + 8)
        return 4 * (5 * params + (layout.workspace_floats + slot_words + 4 * slot_words) + activations
                    + accumulators + 10 * pairs)

    def schedule(self) -> torch.Tensor:
        """Adam's ``lr / (1 − β1^s)`` and ``√(1 − β2^s)`` of this E-step's steps, in double then float32."""
        beta1, beta2 = self.settings.adam_betas
        rows = [[self.settings.lr / (1 - beta1 ** float(k)), (1 - beta2 ** float(k)) ** 0.5]
                for k in range(self.steps + 1, self.steps + self.settings.inner_steps + 1)]
        return torch.tensor(rows, dtype=torch.float32)

    @torch.no_grad()
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        from lightning_putm.methods.putm.step import pair_inputs

        layout = self.layout(query, ways)
        cost = pair_inputs(query, prototypes)[1]
        out = e_step(layout, query, prototypes, cost, self.navigator, self.exp_avg, self.exp_avg_sq,
                     self.schedule(), self.active, self.settings)
        self.steps += self.settings.inner_steps
        return out
