"""PT-MAP (Hu, Gripon & Pateux, "Leveraging the Feature Distribution in Transfer-based Few-Shot Learning",
ICANN 2021), re-implemented from the paper, batched over tasks.

1. Preprocess each task (support then query rows): power transform ``(x + 1e-6)^β`` with β = 0.5, reduce to
   the task's own basis (QR), L2-normalise, centre the support rows and the query rows separately (each
   by its own mean) and L2-normalise again.
2. Class centres start at the support means.
3. MAP loop, ``iterations`` (20) times: the soft assignment of queries to classes is the Sinkhorn transport
   plan of ``exp(−λ·‖x_j − μ_k‖²)`` (λ = 10) whose rows sum to 1 and whose columns sum to ``Q/N`` (the
   uniform class marginal); new centres are the mean of support (one-hot) and query rows weighted by the
   plan; inertia ``μ ← μ + a(μ̂ − μ)`` with a = 0.2. A final plan gives the probabilities.

The uniform column marginal is PT-MAP's assumption of balanced queries, which is what makes it fragile
under Dirichlet imbalance (Veilleux et al., 2021). With the explicit ``oracle_prior`` switch the columns sum
to the true per-task query counts instead; such results are labelled by the evaluation.

Sinkhorn stops per task when the row sums move by at most ``sinkhorn_eps`` (the reference code stops
when the whole batch has converged; freezing converged tasks makes a task's result independent of the
other tasks in its batch).
"""

from __future__ import annotations

import torch

from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.peer_settings import PTMAPSettings
from lightning_putm.methods.preprocessing import check_power_transform_input, l2_normalise, power_transform, qr_reduce
from lightning_putm.signals import check_stop
from lightning_putm.tasks import TaskBatch, weighted_class_means
from lightning_putm.methods.registry import register_method


def sinkhorn(
    cost: torch.Tensor,
    row_sums: torch.Tensor,
    column_sums: torch.Tensor,
    lam: float,
    eps: float = 1e-6,
    max_iters: int = 1000,
) -> torch.Tensor:
    """Entropic transport plan ``[T, Q, N]`` of ``exp(−lam·cost)`` with the given marginals.

    ``row_sums`` ``[T, Q]`` and ``column_sums`` ``[T, N]`` must have equal totals per task. Alternate row
    and column scaling (the columns last, so they are exact) until, per task, the row sums before a row
    scaling differ from those of the previous iteration by at most ``eps``; a converged task is frozen.
    A column whose target is 0 becomes all zeros.
    """
    tiny = torch.finfo(cost.dtype).tiny  # 0/0 → 0 for a column (or row) whose target and mass are both 0
    plan = torch.exp(-lam * cost)
    plan = plan / plan.sum(dim=(1, 2), keepdim=True)
    previous = torch.zeros_like(row_sums)
    active = torch.ones(cost.shape[0], dtype=torch.bool, device=cost.device)
    for _ in range(max_iters):
        current = plan.sum(2)
        active = active & ((previous - current).abs().amax(1) > eps)
        if not bool(active.any()):
            break
        previous = current
        scaled = plan * (row_sums / current.clamp_min(tiny)).unsqueeze(2)
        scaled = scaled * (column_sums / scaled.sum(1).clamp_min(tiny)).unsqueeze(1)
        plan = torch.where(active.view(-1, 1, 1), scaled, plan)
    return plan


@register_method("ptmap")
class PTMAP(FewShotMethod):
    """PT-MAP with the uniform class marginal (or the true counts under the oracle prior)."""

    plot_slot = 1  # its colour and marker in every figure
    display_name = "PT-MAP"
    uses_class_prior = True
    Settings = PTMAPSettings

    def __init__(self, settings: PTMAPSettings | None = None, **kwargs) -> None:
        super().__init__(settings, **kwargs)
        self.last_state: dict[str, torch.Tensor] = {}

    def bytes_per_task(self, tasks: TaskBatch) -> int:
        n = tasks.num_support + tasks.num_queries
        m = min(tasks.dim, n)
        return 4 * (3 * n * tasks.dim + n * m * (tasks.ways + 4) + 8 * n * tasks.ways)

    def check_features(self, features: torch.Tensor) -> None:
        check_power_transform_input(features, self.beta, self.name)

    def preprocess(self, tasks: TaskBatch) -> torch.Tensor:
        """Rows ``[T, S+Q, m]``: power β → QR → L2 → centre support and query separately → L2."""
        x = torch.cat([tasks.support, tasks.query], dim=1)
        x = l2_normalise(qr_reduce(power_transform(x, self.beta, self.name)))
        s = tasks.num_support
        support = l2_normalise(x[:, :s] - x[:, :s].mean(1, keepdim=True))
        query = l2_normalise(x[:, s:] - x[:, s:].mean(1, keepdim=True))
        return torch.cat([support, query], dim=1)

    def column_marginal(self, tasks: TaskBatch, class_counts: torch.Tensor | None) -> torch.Tensor:
        """``[T, N]``: ``Q/N`` per class (uniform), or the true counts under the oracle prior."""
        q = tasks.num_queries
        if class_counts is None:
            return torch.full((tasks.num_tasks, tasks.ways), q / tasks.ways, device=tasks.device,
                              dtype=tasks.query.dtype)
        counts = class_counts.to(tasks.device, tasks.query.dtype)
        if tuple(counts.shape) != (tasks.num_tasks, tasks.ways) or (counts < 0).any() or \
                not torch.allclose(counts.sum(1), torch.full_like(counts[:, 0], q)):
            raise ValueError(f"{self.name}: oracle class counts must be [T, N], non-negative, summing to Q={q}")
        return counts

    def transport(self, query: torch.Tensor, centres: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        cost = (query.unsqueeze(2) - centres.unsqueeze(1)).pow(2).sum(-1)  # [T, Q, N]
        rows = torch.ones(query.shape[:2], device=query.device, dtype=query.dtype)
        return sinkhorn(cost, rows, columns, self.lam, self.sinkhorn_eps, self.sinkhorn_max_iters)

    @torch.no_grad()
    def solve(self, tasks: TaskBatch, class_counts: torch.Tensor | None = None) -> torch.Tensor:
        x = self.preprocess(tasks)
        s = tasks.num_support
        query = x[:, s:]
        one_hot = tasks.one_hot_support()
        centres = tasks.support_means(x[:, :s])
        columns = self.column_marginal(tasks, class_counts)
        plan = self.transport(query, centres, columns)
        for _ in range(self.iterations):
            check_stop()  # Ctrl-C / SIGTERM between iterations (lightning_putm.signals)
            estimate = weighted_class_means(x, torch.cat([one_hot, plan], dim=1))  # support one-hot + plan
            centres = centres + self.inertia * (estimate - centres)
            plan = self.transport(query, centres, columns)
        self.last_state = {"transport": plan, "column_marginal": columns, "prototypes": centres, "rows": x}
        return plan / plan.sum(2, keepdim=True)
