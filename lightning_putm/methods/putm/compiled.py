"""The ``compiled`` E-step engine: the ``fused`` engine's mathematics in a form a GPU runs at full speed.

Not part of the paper (a speed option). Three things stop the ``fused`` engine (:mod:`.engines`) from being
captured in a CUDA graph or compiled well, and this engine removes each:

* Adam's step counter and bias corrections were Python numbers that change every step: here they live in a
  device tensor (:class:`DeviceAdam`), and the update is torch's own fused Adam kernel
  (``torch._fused_adam_``, the kernel behind ``torch.optim.Adam(fused=True)``) over the one flat buffer of
  all navigators, one pass instead of seven.
* the fused engine writes through ``out=`` into views of the flat buffer: here the navigator forward, the CT
  loss gradient and the navigator backward of one Adam step are one pure function (:func:`navigator_step`,
  bias and LeakyReLU folded in) that returns the flat gradient, so ``torch.compile`` can fuse it.
* early stopping shrank the batch: this engine keeps the batch fixed and freezes finished tasks with a mask
  (:func:`masked_em_loop`), so every E-step has the same shapes.

On CUDA the ``inner_steps`` Adam steps of an E-step are captured once in a CUDA graph and replayed (static
input and output buffers); :func:`navigator_step` is compiled there too. On CPU the same step function runs
eagerly unless ``compile_step=True``: on a 2-core CPU compiling did not pay off (docs/gpu.md).
The navigator re-draw can run on the device (``init_draw=device``, :func:`.navigator.device_normal`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from lightning_putm.methods.putm.adam import ADAM_EPS
from lightning_putm.methods.putm.loss import ct_loss_gradient
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings


# ------------------------------------------------------------------------------------------------ Adam
class DeviceAdam:
    """Adam (Kingma & Ba 2015) over one flat buffer with its step counter in a device tensor.

    The same update as :class:`~.adam.StackedAdam` (equal to float rounding, not bit-for-bit): the bias
    corrections ``1 − β^t`` are computed from the step tensor on the device, so a CUDA graph can replay a
    step without Python numbers that change. Uses ``torch._fused_adam_`` (one kernel over the buffer) where the
    installed torch has it for the buffer's device, else a plain tensor-op formulation of the same update.
    """

    def __init__(self, params: torch.Tensor, lr: float, betas: tuple[float, float], eps: float = ADAM_EPS) -> None:
        self.params, self.lr, self.betas, self.eps = params, lr, betas, eps
        self.exp_avg = torch.zeros_like(params)
        self.exp_avg_sq = torch.zeros_like(params)
        self.step_count = torch.zeros((), dtype=torch.float32, device=params.device)
        self.fused = fused_adam_available(params.device, params.dtype)

    @property
    def steps(self) -> torch.Tensor:
        """The step count, a 0-dim float32 tensor on the parameters' device."""
        return self.step_count

    def reset(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.step_count.zero_()

    @torch.no_grad()
    def step(self, grad: torch.Tensor) -> None:
        self.step_count.add_(1)
        beta1, beta2 = self.betas
        if self.fused:
            torch._fused_adam_([self.params], [grad], [self.exp_avg], [self.exp_avg_sq], [], [self.step_count],
                               lr=self.lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=self.eps,
                               amsgrad=False, maximize=False)
            return
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        correction1 = 1 - torch.pow(beta1, self.step_count)
        correction2_sqrt = (1 - torch.pow(beta2, self.step_count)).sqrt()
        denom = (self.exp_avg_sq.sqrt() / correction2_sqrt).add_(self.eps)
        self.params.sub_(self.exp_avg / denom * (self.lr / correction1))


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


# ------------------------------------------------------------------------------------------ the step
def navigator_step(inputs: torch.Tensor, cost: torch.Tensor, stored: list[torch.Tensor], biases: list[torch.Tensor],
                   out_width: int, slope: float, rho: float, theta: float,
                   compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(π_f, π_b, flat gradient)`` of one Adam step: navigator forward, CT-loss gradient, navigator backward.

    ``inputs`` ``[T, P, m]`` (compute dtype) are the squared differences, ``cost`` ``[T, Q, N]``; ``stored`` and
    ``biases`` are the navigator's float32 views (the last layer zero-padded to a GEMM width, as in the fused
    engine, so a task's products never depend on the batch size on CPU BLAS). The gradient is laid out like
    ``Navigator.flat`` (float32). Pure (no ``out=``, no in-place writes), so ``torch.compile`` can fuse it.
    """
    t, q, n = cost.shape
    weights = [w.to(compute_dtype) for w in stored]
    activations = []
    x = inputs
    for w, b in zip(weights[:-1], biases[:-1]):
        x = F.leaky_relu(torch.baddbmm(b.to(compute_dtype), x, w), slope)
        activations.append(x)
    out = torch.bmm(x, weights[-1])[:, :, :out_width].float() + biases[-1]
    logits = -out.view(t, q, n)
    forward, backward, grad_logits = ct_loss_gradient(cost, logits, rho, theta)
    grad_out = grad_logits.neg().view(t, q * n, 1)
    bias_grads = [grad_out.sum(1, keepdim=True)]
    grad = F.pad(grad_out, (0, weights[-1].shape[2] - out_width)).to(compute_dtype)
    weight_grads = []
    for i in range(len(weights) - 1, -1, -1):
        below = inputs if i == 0 else activations[i - 1]
        weight_grads.append(torch.bmm(below.transpose(1, 2), grad))
        if i > 0:
            grad = torch.ops.aten.leaky_relu_backward(torch.bmm(grad, weights[i].transpose(1, 2)), below, slope, False)
            bias_grads.append(grad.sum(1, keepdim=True, dtype=torch.float32))
    parts = [g.float().flatten() for g in reversed(weight_grads)] + [g.flatten() for g in reversed(bias_grads)]
    return forward, backward, torch.cat(parts)


# ------------------------------------------------------------------------------------------ the engine
class CompiledTrainer:
    """The E-step's ``inner_steps`` Adam steps as :func:`navigator_step` + :class:`DeviceAdam` (``solver=compiled``).

    ``compile_step``: ``torch.compile`` the step function (``None``: only on CUDA). ``use_graph``: capture the
    inner loop in a CUDA graph (``None``: on CUDA). Re-draws are the navigator's (on the device with
    ``init_draw=device``, :meth:`Navigator.redraw`).
    The batch never shrinks (:attr:`fixed_batch`): :func:`masked_em_loop` freezes finished tasks instead.
    """

    fixed_batch = True

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype,
                 compile_step: bool | None = None,
                 use_graph: bool | None = None) -> None:
        self.navigator, self.settings, self.compute_dtype = navigator, settings, compute_dtype
        device = navigator.flat.device
        self.adam = DeviceAdam(navigator.flat, settings.lr, settings.adam_betas)
        on_cuda = device.type == "cuda"
        self.compile_step = on_cuda if compile_step is None else compile_step
        self.use_graph = on_cuda if use_graph is None else use_graph
        if self.use_graph and not on_cuda:
            raise ValueError("CUDA graphs need a CUDA device; pass use_graph=None or False")
        self.step_function: Callable = torch.compile(navigator_step, dynamic=False) if self.compile_step \
            else navigator_step
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._runs_seen: set[tuple] = set()

    def reinit(self, generators: list[torch.Generator]) -> None:
        """A new navigator (Algorithm 1) and fresh Adam state, in place (the CUDA graph stays valid)."""
        self.navigator.redraw(generators)
        self.adam.reset()

    def one_step(self, inputs: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One Adam step; returns ``(π_f, π_b)`` before the update."""
        s, nav = self.settings, self.navigator
        arguments = (inputs, cost, nav.stored, nav.biases, nav.widths[-1], s.negative_slope, s.rho, s.theta,
                     self.compute_dtype)
        try:
            forward, backward, grad = self.step_function(*arguments)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop an evaluation
            if self.step_function is navigator_step:
                raise
            # the step is pure (nothing was updated yet), so the eager function gives this step's exact result
            fall_back("torch.compile of the navigator step", exc)
            self.step_function = navigator_step
            forward, backward, grad = navigator_step(*arguments)
        self.adam.step(grad)
        return forward, backward

    def inner_loop(self, inputs: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        forward = backward = cost
        for _ in range(self.settings.inner_steps):
            forward, backward = self.one_step(inputs, cost)
        return forward, backward

    @torch.no_grad()
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``inner_steps`` Adam steps on the CT loss; returns ``(π_f, π_b)`` of the last step, pre-update."""
        t, q, m = query.shape
        squared = (query.unsqueeze(2) - prototypes.unsqueeze(1)).pow(2)  # [T, Q, N, m]
        cost = squared.sum(-1)
        inputs = squared.reshape(t, q * ways, m).to(self.compute_dtype)
        if self.use_graph:
            try:
                return self._run_graph(inputs, cost)
            except Exception as exc:  # noqa: BLE001 - a capture failure must not stop an evaluation
                # the warm-up and the capture fail before they change the navigator or Adam state (a captured
                # graph runs nothing until replayed), so the eager loop below gives this E-step's result
                fall_back("the CUDA graph of the E-step", exc)
                self.use_graph, self._graph, self._static = False, None, {}
        return self.inner_loop(inputs, cost)

    def _run_graph(self, inputs: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CUDA: the first call of a shape runs eagerly (warm-up, compilation); the second captures the inner
        loop into a graph on static buffers; every later call copies its inputs in and replays."""
        shape = (tuple(inputs.shape), tuple(cost.shape))
        if shape not in self._runs_seen:
            self._runs_seen.add(shape)
            stream = torch.cuda.Stream(device=inputs.device)
            stream.wait_stream(torch.cuda.current_stream(inputs.device))
            with torch.cuda.stream(stream):
                result = self.inner_loop(inputs, cost)
            torch.cuda.current_stream(inputs.device).wait_stream(stream)
            return result
        static = self._static
        if self._graph is None or static["inputs"].shape != inputs.shape or static["cost"].shape != cost.shape:
            static["inputs"], static["cost"] = inputs.clone(), cost.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static["forward"], static["backward"] = self.inner_loop(static["inputs"], static["cost"])
            self._graph = graph
        static["inputs"].copy_(inputs)
        static["cost"].copy_(cost)
        self._graph.replay()
        return static["forward"].clone(), static["backward"].clone()


def fall_back(what: str, exc: BaseException) -> None:
    """One warning when a GPU speed-up fails and the engine continues with the same mathematics, eagerly."""
    warnings.warn(f"putm solver=compiled: {what} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                  "continuing without it (same results, slower). Please report this with your torch and GPU versions",
                  RuntimeWarning, stacklevel=3)


class EMHost(Protocol):
    """What :func:`masked_em_loop` uses of :class:`~lightning_putm.methods.putm.PUTM` (no import cycle)."""

    settings: PUTMSettings

    def update_weights(self, forward: torch.Tensor, backward: torch.Tensor) -> torch.Tensor: ...

    def m_step(self, *args: Any) -> torch.Tensor: ...

    def settled(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor | None: ...

    def _snapshot(self, trainer: Any) -> torch.Tensor | None: ...

    def _report(self, *args: Any) -> None: ...


def masked_em_loop(method: EMHost, trainer: CompiledTrainer, rows: torch.Tensor, one_hot: torch.Tensor,
                   prototypes: torch.Tensor, generators: list[torch.Generator],
                   ways: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The EM loop of :meth:`PUTM.em_loop` on a fixed batch; returns ``(π_f, prototypes, EM steps run)``.

    Early stopping freezes a settled task instead of removing it: its prototypes stop changing, and the next
    E-step of the whole batch is its final E-step (the one the shrinking loop would run for it alone, with the
    same navigator, Adam state and draw), whose π_f is kept; afterwards the task's rows are computed and
    ignored. Every E-step so has the same shapes (one CUDA graph), and a task's result is the one it gets
    alone, as with the shrinking loop.
    """
    s = method.settings
    total, num_support = rows.shape[0], one_hot.shape[1]
    query = rows[:, num_support:]
    forward_out = rows.new_empty(total, query.shape[1], ways)
    em_steps = torch.full((total,), s.em_steps, dtype=torch.long)
    everyone = torch.arange(total, device=rows.device)
    done = torch.zeros(total, dtype=torch.bool, device=rows.device)  # final E-step taken: result kept
    pending = torch.zeros_like(done)  # settled: the next E-step is their final one
    for step in range(s.em_steps):
        if s.reinit_navigator:
            trainer.reinit(generators)
        before = method._snapshot(trainer)
        forward, backward = trainer.run(query, prototypes, ways)
        if s.early_stop_tol is not None:
            forward_out[pending] = forward[pending]
            done |= pending
            if bool(done.all()):
                return forward_out, prototypes, em_steps
        weights = method.update_weights(forward, backward)
        updated = method.m_step(rows, one_hot, weights, prototypes, s.inertia)
        method._report(step, everyone, trainer, before, prototypes, forward, backward, weights, updated)
        settled = method.settled(prototypes, updated)
        if settled is None:
            prototypes = updated
            continue
        pending = settled & ~done
        em_steps[pending.cpu()] = step + 1
        prototypes = torch.where(done.view(-1, 1, 1), prototypes, updated)
    if s.reinit_navigator:
        trainer.reinit(generators)
    before = method._snapshot(trainer)
    forward, backward = trainer.run(query, prototypes, ways)
    method._report(None, everyone, trainer, before, prototypes, forward, backward)
    forward_out[~done] = forward[~done]
    return forward_out, prototypes, em_steps
