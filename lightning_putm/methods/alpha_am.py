"""α-AM: adaptive manifold with α-entropies (Lazarou, Avrithis & Stathaki, "Adaptive manifold for imbalanced
transductive few-shot learning", WACV 2024, arXiv 2304.14281), re-implemented from the paper and batched over
tasks. Reference code: github.com/MichalisLazarou/AM (``src/methods/AM.py``, class ``ALPHA_AM``; settings in
``config/{dirichlet,balanced}/methods_config/alpha_am.yaml``, identical for both protocols; ``src/main.py``).

Per task, with ``n = N + N·K + Q`` graph nodes (the N class centroids, the support rows, the query rows, in
that order):

1. Preprocessing (``plc``, the reference's ``--plc``, on by default because ``src/main.py`` declares it
   ``default=True``): signed power ``sign(x)·(|x| + 1e-6)^β`` (β = 0.5), L2-normalise, subtract the task mean
   of support and query rows, L2-normalise. ``plc=false``: L2-normalise only.
2. Parameters, per task (the paper's φ): the centroids ``μ`` ``[N, d]`` (start: support class means), the
   graph's kernel scales ``G`` ``[n, n]`` (start: 1) and edge weights ``W_b`` ``[n, n]`` (start: the
   propagation α). ``phi`` picks which of them are learnt (the reference's ``--phi``, default all three).
3. Each iteration builds the manifold from the current centroids and propagates their labels:
   ``D_ij = ‖z_i − z_j‖ / std(D)`` (Euclidean distances over all node pairs, divided by their unbiased
   standard deviation over the whole ``n × n`` matrix); ``A_ij = exp(−G_ij·D_ij)`` with a zero diagonal and
   the centroids' own rows zeroed (a centroid is a neighbour, never a node with neighbours of its own); each
   row keeps its ``k`` largest entries; ``W = W_b ⊙ (A + Aᵀ)/2``; ``Ŵ = D^-1/2 W D^-1/2`` (degrees + 1e-12);
   scores ``S = T·(I − αŴ)^-1 Y`` with ``Y`` one-hot on the centroid nodes only (support and query rows
   start unlabelled) and the temperature T = 15.
4. Loss (summed over tasks; every task has its own parameters and Adam is element-wise, so tasks stay
   independent): ``λ_ce·CE(softmax S_support, y_s) − λ_H·H_α(mean_j p_j) + λ_c·mean_j H_α(p_j)`` with
   ``p_j = softmax S_j`` over the queries and Tsallis entropies ``H_α(p) = (1 − Σ_k p_k^α)/(α − 1)``
   (Shannon at α = 1), minimised by Adam (lr 1e-4, 1000 steps).
5. Output: the query scores of the last iteration (computed before its Adam step, as the reference's ``Z``),
   as softmax probabilities; their argmax is the reference's prediction.

Defaults by shots (``ALPHA_AM.run_adaptation``/``get_alpha_values`` with ``use_tuned_alpha_values: True``):
1 shot: α = 0.8, k = 20, entropy α = 2; ≥ 5 shots: α = 0.9, k = 10, entropy α = 5; other shots fall back to
the yaml's ``alpha: 0.8, K: 20, alpha_values: [1.0, 1.0, 1.0]`` — an entropy α of 1 divides 0 by 0 in the
reference (NaN), so here it is the Shannon limit. The method needs no class prior and never sees counts.

Deviations from the reference (docs/methods/alpha_am.md): ``k`` is capped at ``n − 1`` (the reference's
``topk`` fails for ``k ≥ n + 1``; at ``k = n`` it also picks the zero diagonal, the same graph); works for any
N, K, Q and device (the reference calls ``.cuda()``); the Tsallis entropies at α = 1 are Shannon's. Option
``integer_powers`` (off: the reference's ``torch.pow``): whole-number entropy orders by multiplications, so that on
the CPU a task's result does not depend on how many tasks share its chunk (:class:`_IntegerPower`).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.ilpc import signed_power
from lightning_putm.methods.peer_settings import AlphaAMSettings
from lightning_putm.methods.preprocessing import l2_normalise
from lightning_putm.signals import check_stop
from lightning_putm.tasks import TaskBatch
from lightning_putm.methods.registry import register_method

#: The reference's guards: ``log(p + 1e-12)`` in the cross-entropy, ``(p + 1e-12)^α`` in the conditional
#: α-entropy, ``1/sqrt(D + 1e-12)`` for the degrees.
EPS = 1e-12


def integer_power(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x**n`` for an integer ``n ≥ 1`` by repeated squaring: multiplications only, which round the same in
    every element whatever tensor it is in."""
    result, base = None, x
    while True:
        if n & 1:
            result = base if result is None else result * base
        n >>= 1
        if not n:
            return result
        base = base * base


class _IntegerPower(torch.autograd.Function):
    """``x**n`` (integer ``n ≥ 2``) and its gradient ``g·n·x**(n−1)``, the formulas of ``torch.pow``'s, by
    multiplications (:func:`integer_power`). Why: ``torch.pow``'s CPU kernel computes the vectorized body and the
    scalar tail of a tensor with routines that can differ in the last bit, so which routine a task's entries get
    depends on how many tasks share the tensor, and 1000 Adam steps turn that into different predictions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.n = n
        return integer_power(x, n)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * (ctx.n * integer_power(x, ctx.n - 1)), None


def tsallis(p: torch.Tensor, alpha: float, eps: float = 0.0, integer_powers: bool = False) -> torch.Tensor:
    """Tsallis α-entropy ``(1 − Σ_k (p_k + eps)^α)/(α − 1)`` over the last dimension; at α = 1 its limit,
    Shannon's ``−Σ_k p_k log(p_k + eps)`` (with a floor that keeps ``0·log 0 = 0``). ``integer_powers``: an
    integral α ≥ 2 by multiplications (:class:`_IntegerPower`: the same result in any batch), else ``torch.pow``
    (the reference's)."""
    if alpha == 1.0:
        return -(p * (p + eps).clamp_min(1e-30).log()).sum(-1)
    if integer_powers and float(alpha).is_integer() and alpha >= 2:
        return (1.0 - _IntegerPower.apply(p + eps, int(alpha)).sum(-1)) / (alpha - 1.0)
    return (1.0 - (p + eps).pow(alpha).sum(-1)) / (alpha - 1.0)


@register_method("alpha_am")
class AlphaAM(FewShotMethod):
    """α-AM: learn class centroids and a kNN manifold so that label propagation from the centroids fits the
    support labels and gives confident, α-entropy-spread query predictions (Lazarou et al., WACV 2024)."""

    plot_slot = 10  # its colour and marker in every figure
    display_name = "α-AM"
    Settings = AlphaAMSettings

    def __init__(self, settings: AlphaAMSettings | None = None, *, shots: int | None = None, **kwargs) -> None:
        """Without ``shots``, ``alpha``, ``k`` and ``entropy_alpha`` must be given (chosen by shots)."""
        super().__init__(settings, shots=shots, **kwargs)
        self.last_state: dict[str, torch.Tensor] = {}

    def bytes_per_task(self, tasks: TaskBatch) -> int:
        n = tasks.ways + tasks.num_support + tasks.num_queries
        # about 40 live n × n tensors per step (graph, autograd, Adam state of G and W_b) plus the rows
        return 4 * (40 * n * n + 6 * n * tasks.dim + 8 * n * tasks.ways)

    # ------------------------------------------------------------------------------------------- pieces
    def preprocess(self, tasks: TaskBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Support and query rows after PLC (signed power β → L2 → centre on the task mean → L2) or L2 alone."""
        if not self.plc:
            return l2_normalise(tasks.support), l2_normalise(tasks.query)
        x = torch.cat([tasks.support, tasks.query], dim=1)
        x = l2_normalise(signed_power(x, self.beta))
        x = l2_normalise(x - x.mean(1, keepdim=True))
        s = tasks.num_support
        return x[:, :s], x[:, s:]

    def graph(self, nodes: torch.Tensor, kernel: torch.Tensor, edge_weights: torch.Tensor, centroids: int,
              k: int) -> torch.Tensor:
        """Normalised adaptive affinity ``Ŵ`` ``[T, n, n]`` of ``nodes`` ``[T, n, d]`` (centroids first).

        ``A = exp(−G ⊙ D/std(D))`` (zero diagonal, centroid rows zero), each row's ``k`` largest kept,
        ``W = W_b ⊙ (A + Aᵀ)/2``, ``D^-1/2 W D^-1/2``. Differentiable in nodes, ``G`` and ``W_b``; the kNN
        selection is not.
        """
        n = nodes.shape[1]
        distance = torch.cdist(nodes, nodes)
        distance = distance / distance.std(dim=(1, 2), keepdim=True)
        eye = torch.eye(n, dtype=torch.bool, device=nodes.device)
        affinity = torch.exp(-distance * kernel).masked_fill(eye, 0.0)
        affinity = torch.cat([torch.zeros_like(affinity[:, :centroids]), affinity[:, centroids:]], dim=1)
        index = affinity.detach().topk(min(k, n - 1), dim=2).indices
        keep = torch.zeros_like(affinity).scatter_(2, index, 1.0)
        affinity = affinity * keep
        weights = edge_weights * ((affinity + affinity.transpose(1, 2)) * 0.5)
        scale = (1.0 / (weights.sum(2) + EPS)).sqrt()
        return scale.unsqueeze(2) * weights * scale.unsqueeze(1)

    def scores(self, centroids: torch.Tensor, support: torch.Tensor, query: torch.Tensor, kernel: torch.Tensor,
               edge_weights: torch.Tensor) -> torch.Tensor:
        """Propagated scores ``T·(I − αŴ)^-1 Y`` ``[T, n, N]`` with ``Y`` one-hot on the centroid nodes."""
        ways = centroids.shape[1]
        nodes = torch.cat([centroids, support, query], dim=1)
        normalised = self.graph(nodes, kernel, edge_weights, ways, self.k)
        n = nodes.shape[1]
        eye = torch.eye(n, dtype=nodes.dtype, device=nodes.device)
        propagator = torch.linalg.inv(eye - self.alpha * normalised)  # the reference's full inverse
        return propagator[:, :, :ways] * self.temperature  # = propagator @ Y, Y = [I_N; 0]

    def objective(self, scores: torch.Tensor, support_one_hot: torch.Tensor) -> torch.Tensor:
        """Per-task loss ``λ_ce·CE − λ_H·H_α(marginal) + λ_c·mean H_α(conditional)`` from scores ``[T, n, N]``."""
        ways, s = support_one_hot.shape[2], support_one_hot.shape[1]
        ce = -(support_one_hot * torch.log(torch.softmax(scores[:, ways:ways + s], dim=2) + EPS)).sum(2).mean(1)
        probs = torch.softmax(scores[:, ways + s:], dim=2)
        marginal = tsallis(probs.mean(1), self.entropy_alpha, integer_powers=self.integer_powers)
        conditional = tsallis(probs, self.entropy_alpha, EPS, integer_powers=self.integer_powers).mean(1)
        w_ce, w_marginal, w_conditional = self.loss_weights
        return w_ce * ce - (w_marginal * marginal - w_conditional * conditional)

    # ------------------------------------------------------------------------------------------- solve
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        with torch.no_grad():
            support, query = self.preprocess(tasks)
            one_hot = tasks.one_hot_support().to(support.dtype)
            centroids = tasks.support_means(support).clone()
            t, n = tasks.num_tasks, tasks.ways + tasks.num_support + tasks.num_queries
            edge_weights = torch.full((t, n, n), float(self.alpha), dtype=support.dtype, device=support.device)
            kernel = torch.ones(t, n, n, dtype=support.dtype, device=support.device)
        learnt = [centroids] + ([kernel] if "G" in self.phi else []) + ([edge_weights] if "Wb" in self.phi else [])
        for parameter in learnt:
            parameter.requires_grad_(True)
        optimiser = torch.optim.Adam(learnt, lr=self.lr)
        history = torch.empty(self.iterations, t, dtype=support.dtype, device=support.device)
        steps = range(max(self.iterations, 1))
        if self.show_progress:
            steps = tqdm(steps, desc=f"{self.name} ({t} tasks)", leave=False, disable=None)
        for i in steps:
            check_stop()  # Ctrl-C / SIGTERM between Adam steps (lightning_putm.signals)
            with torch.enable_grad():
                scores = self.scores(centroids, support, query, kernel, edge_weights)
                if i == self.iterations:  # iterations = 0: one propagation from the support means, no step
                    break
                loss = self.objective(scores, one_hot)
                optimiser.zero_grad(set_to_none=True)
                loss.sum().backward()
            optimiser.step()
            history[i] = loss.detach()
        query_scores = scores.detach()[:, tasks.ways + tasks.num_support:]
        self.last_state = {"objective": history, "centroids": centroids.detach(), "kernel": kernel.detach(),
                           "edge_weights": edge_weights.detach(), "query_scores": query_scores}
        return torch.softmax(query_scores, dim=2)
