"""PUTM: prototypes-oriented transductive few-shot learning with conditional transport.

Tian et al., "Prototypes-oriented Transductive Few-shot Learning with Conditional Transport", ICCV 2023
(arXiv 2308.03047). Re-implemented from the paper and DESIGN.md §3; all tasks of a batch are solved at
once as stacked tensors ``[T, ...]`` on the input's device, with no Python loop over tasks or pairs.

The CT-EM loop:

1. Preprocess each task: power transform β, QR reduction to the task's own basis, L2 normalisation.
2. Prototypes start at the support class means.
3. E-step: a per-task navigator MLP maps each (query j, class k) pair's squared difference
   ``(μ_k − x_j)²`` to a logit ``d_jk``; the forward navigator ``π_f(k|j)`` is a softmax over classes, the
   backward navigator ``π_b(j|k)`` a softmax over queries. Adam minimises the conditional-transport cost
   ``ρ·mean_j Σ_k c_jk π_f + (1−ρ)·mean_k Σ_j c_jk π_b`` (``c_jk = ‖x_j − μ_k‖²``, constant), plus an
   optional balance term weighted by θ. Navigator weights and Adam state persist across EM steps as in
   the reference code, or are re-drawn every EM step as in the paper's Algorithm 1
   (``reinit_navigator=True``).
4. M-step: the weighted mean of support (one-hot) and query rows (weights π_f) gives μ̂; inertia
   ``μ ← μ + a(μ̂ − μ)``.
5. After the EM steps one more E-step; the prediction is ``argmax_k π_f(k|j)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.preprocessing import l2_normalise, power_transform, qr_reduce
from lightning_putm.tasks import TaskBatch, weighted_class_means

PROTOTYPE_UPDATES = ("forward", "backward", "mixed")
GEMM_MIN_WIDTH = 8


@dataclass(frozen=True)
class PUTMSettings:
    """Resolved hyper-parameters (DESIGN §3 defaults; ``None`` in the config means 'by setting')."""

    beta: float = 0.6
    rho: float = 0.5
    theta: float = 0.0
    inertia: float = 0.2
    inner_steps: int = 30
    em_steps: int = 50
    lr: float = 1e-3
    adam_betas: tuple[float, float] = (0.5, 0.99)
    hidden: tuple[int, ...] = (128, 64)
    init_tasks: int = 1000
    reinit_navigator: bool = False
    prototype_update: str = "forward"
    canonical_query_order: bool = True
    negative_slope: float = 0.01


class Navigator:
    """Per-task MLP ``m → hidden… → 1`` with LeakyReLU, its weights stacked as ``[T, in, out]``.

    Weights are drawn per task from the task's own seed with the reference's Xavier-normal scale for a
    stacked tensor, ``std = sqrt(2 / (out · (in + T_init)))``, where ``T_init`` is fixed (default 1000,
    the batch size behind the published numbers) so results never depend on chunking. Biases start at 0.
    """

    def __init__(self, widths: list[int], generators: list[torch.Generator], init_tasks: int,
                 device: torch.device, dtype: torch.dtype, negative_slope: float) -> None:
        self.widths = widths
        self.init_tasks = init_tasks
        self.negative_slope = negative_slope
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = []
        for fan_in, fan_out in zip(widths[:-1], widths[1:]):
            self.weights.append(torch.empty(len(generators), fan_in, fan_out, device=device, dtype=dtype))
            self.biases.append(torch.zeros(len(generators), 1, fan_out, device=device, dtype=dtype))
        self.redraw(generators)
        for p in self.parameters():
            p.requires_grad_(True)

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


class PUTM(FewShotMethod):
    """The CT-EM solver of PUTM (DESIGN §3), batched over tasks."""

    name = "putm"

    def __init__(
        self,
        shots: int,
        balanced: bool,
        beta: float = 0.6,
        rho: float | None = None,
        theta: float | None = None,
        inertia: float | None = None,
        inertia_one_shot: float = 0.2,
        inertia_few_shot: float = 0.1,
        inner_steps: int = 30,
        em_steps: int = 50,
        lr: float = 1e-3,
        adam_betas: tuple[float, float] | list[float] = (0.5, 0.99),
        hidden: tuple[int, ...] | list[int] = (128, 64),
        init_tasks: int = 1000,
        reinit_navigator: bool = False,
        prototype_update: str = "forward",
        canonical_query_order: bool = True,
        memory_budget_mb: float = 2048.0,
        show_progress: bool = False,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb, show_progress=show_progress)
        if prototype_update not in PROTOTYPE_UPDATES:
            raise ConfigError(f"putm.prototype_update must be one of {PROTOTYPE_UPDATES}, got {prototype_update!r}")
        if rho is None:
            rho = 1.0 if balanced else 0.5
        if theta is None:
            theta = 0.001 if balanced else 0.0
        if inertia is None:
            inertia = inertia_one_shot if shots == 1 else inertia_few_shot
        for key, value in (("rho", rho), ("theta", theta), ("inertia", inertia)):
            if not 0.0 <= float(value) <= 1.0:
                raise ConfigError(f"putm.{key} must lie in [0, 1], got {value}")
        for key, value in (("inner_steps", inner_steps), ("init_tasks", init_tasks)):
            if int(value) < 1:
                raise ConfigError(f"putm.{key} must be >= 1, got {value}")
        if int(em_steps) < 0:
            raise ConfigError(f"putm.em_steps must be >= 0, got {em_steps}")
        if beta <= 0:
            raise ConfigError(f"putm.beta must be positive, got {beta}")
        self.settings = PUTMSettings(
            beta=float(beta), rho=float(rho), theta=float(theta), inertia=float(inertia),
            inner_steps=int(inner_steps), em_steps=int(em_steps), lr=float(lr),
            adam_betas=(float(adam_betas[0]), float(adam_betas[1])), hidden=tuple(int(h) for h in hidden),
            init_tasks=int(init_tasks), reinit_navigator=bool(reinit_navigator), prototype_update=prototype_update,
            canonical_query_order=bool(canonical_query_order),
        )
        self.last_state: dict[str, torch.Tensor] = {}

    # ----------------------------------------------------------------------------------------------- sizes
    def bytes_per_task(self, tasks: TaskBatch) -> int:
        n = tasks.num_support + tasks.num_queries
        m = min(tasks.dim, n)
        pairs = tasks.num_queries * tasks.ways
        hidden = sum(self.settings.hidden)
        # squared differences + per-layer activations saved for backward and their gradients
        floats = pairs * (2 * m + 5 * hidden + 8) + n * (tasks.dim + 2 * m)
        return 4 * floats

    # ----------------------------------------------------------------------------------------------- solve
    def preprocess(self, tasks: TaskBatch) -> torch.Tensor:
        """Rows ``[T, S+Q, m]``: power transform, per-task QR basis, L2 (DESIGN §3 step 1)."""
        x = torch.cat([tasks.support, tasks.query], dim=1)
        x = power_transform(x, self.settings.beta, self.name)
        return l2_normalise(qr_reduce(x))

    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        order = canonical_query_order(tasks.query) if self.settings.canonical_query_order else None
        if order is not None:
            tasks = TaskBatch(tasks.support, tasks.support_labels, tasks.query.gather(1, order.unsqueeze(2).expand_as(tasks.query)),
                              tasks.ways, tasks.task_seeds)
        forward = self._solve(tasks)
        if order is not None:
            forward = torch.empty_like(forward).scatter_(1, order.unsqueeze(2).expand_as(forward), forward)
            # rows of last_state are in canonical order: query_order[t, i] is the input index of query row i
            self.last_state["query_order"] = order
        return forward

    def _solve(self, tasks: TaskBatch) -> torch.Tensor:
        s = self.settings
        with torch.no_grad():
            x = self.preprocess(tasks)
        num_support = tasks.num_support
        query = x[:, num_support:]
        one_hot = tasks.one_hot_support()
        prototypes = weighted_class_means(x[:, :num_support], one_hot)
        initial_prototypes = prototypes.clone()

        generators = [torch.Generator().manual_seed(int(seed)) for seed in tasks.task_seeds.tolist()]
        navigator = Navigator([x.shape[2], *s.hidden, 1], generators, s.init_tasks, x.device, x.dtype,
                              s.negative_slope)
        optimiser = self._new_optimiser(navigator)

        steps = range(s.em_steps)
        if self.show_progress:
            steps = tqdm(steps, desc=f"putm EM ({tasks.num_tasks} tasks)", leave=False, disable=None)
        for _ in steps:
            if s.reinit_navigator:
                navigator.redraw(generators)
                optimiser = self._new_optimiser(navigator)
            forward, backward = self.e_step(navigator, optimiser, query, prototypes, tasks.ways)
            weights = self.update_weights(forward, backward)
            prototypes = self.m_step(x, one_hot, weights, prototypes, s.inertia)
        if s.reinit_navigator:
            navigator.redraw(generators)
            optimiser = self._new_optimiser(navigator)
        forward, _ = self.e_step(navigator, optimiser, query, prototypes, tasks.ways)
        # For inspection (plots): the last solved chunk, in the preprocessed space (support rows, then queries).
        self.last_state = {"initial_prototypes": initial_prototypes, "prototypes": prototypes, "rows": x,
                           "forward": forward.detach()}
        return forward

    def _new_optimiser(self, navigator: Navigator) -> torch.optim.Adam:
        return torch.optim.Adam(navigator.parameters(), lr=self.settings.lr, betas=self.settings.adam_betas)

    def e_step(self, navigator: Navigator, optimiser: torch.optim.Optimizer, query: torch.Tensor,
               prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``inner_steps`` Adam steps on the CT loss; returns ``(π_f, π_b)`` of the last step, pre-update."""
        s = self.settings
        t, q, m = query.shape
        squared = (query.unsqueeze(2) - prototypes.unsqueeze(1)).pow(2)  # [T, Q, N, m]
        cost = squared.sum(-1)  # [T, Q, N]
        inputs = squared.reshape(t, q * ways, m)
        forward = backward = cost
        for _ in range(s.inner_steps):
            optimiser.zero_grad(set_to_none=True)
            with torch.enable_grad():
                logits = -navigator(inputs).view(t, q, ways)
                forward = torch.softmax(logits, dim=2)
                backward = torch.softmax(logits, dim=1)
                loss = ct_loss(cost, forward, backward, s.rho, s.theta)
                loss.sum().backward()
            optimiser.step()
        return forward.detach(), backward.detach()

    def update_weights(self, forward: torch.Tensor, backward: torch.Tensor) -> torch.Tensor:
        """Query weights of the M-step: forward (default), backward, or the ρ-mixture of both navigators."""
        if self.settings.prototype_update == "forward":
            return forward
        if self.settings.prototype_update == "backward":
            return backward
        return self.settings.rho * forward + (1 - self.settings.rho) * backward

    @staticmethod
    def m_step(rows: torch.Tensor, support_one_hot: torch.Tensor, query_weights: torch.Tensor,
               prototypes: torch.Tensor, inertia: float) -> torch.Tensor:
        """``μ ← μ + a(μ̂ − μ)`` with μ̂ the weighted mean of support (one-hot) and query rows."""
        estimate = weighted_class_means(rows, torch.cat([support_one_hot, query_weights], dim=1))
        return prototypes + inertia * (estimate - prototypes)


def canonical_query_order(query: torch.Tensor) -> torch.Tensor:
    """Per-task permutation ``[T, Q]`` sorting queries by a fixed random projection of their features.

    The QR basis (Gram-Schmidt over support then query rows) depends on the order in which queries are
    listed, and the navigator is not rotation-invariant, so without a canonical order a task's predictions
    would change when its queries are shuffled. Sorting first makes PUTM exactly permutation-equivariant.
    """
    generator = torch.Generator().manual_seed(0x5EED)
    direction = torch.randn(query.shape[2], generator=generator).to(query.device, query.dtype)
    return torch.sort(query @ direction, dim=1, stable=True).indices


def ct_loss(cost: torch.Tensor, forward: torch.Tensor, backward: torch.Tensor, rho: float, theta: float) -> torch.Tensor:
    """Per-task loss ``θ·L_bal + (1−θ)·L_CT`` (DESIGN §3 step 4); ``cost``/navigators are ``[T, Q, N]``."""
    transport = rho * (cost * forward).sum(2).mean(1) + (1 - rho) * (cost * backward).sum(1).mean(1)
    if theta == 0:
        return transport
    ways = cost.shape[2]
    balance = (rho * forward + (1 - rho) * backward).sum(1)  # [T, N]
    balance_loss = (balance - 1.0 / ways).pow(2).mean(1)
    return theta * balance_loss + (1 - theta) * transport
