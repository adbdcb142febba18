"""BD-CSPN (Liu, Song & Qin, "Prototype Rectification for Few-Shot Learning", ECCV 2020), batched over tasks.

Features are CL2N-normalised (base-class mean subtracted, then L2; plain L2N without a base mean). Then:

1. Cross-class bias: shift every query by ``ξ = mean(support) − mean(query)`` of its task.
2. Intra-class bias: pseudo-label each shifted query with its most cosine-similar support-mean prototype
   ``P_k``; class k's augmented set holds its support rows (true labels) and the queries pseudo-labelled k
   (all of them, or the ``top_z`` most similar ones). The rectified prototype is
   ``P'_k = Σ_i w_ik x_i`` with ``w_ik = softmax_i(ε·cos(x_i, P_k))`` over the members of that set, ε = 10.
3. Queries go to the most cosine-similar rectified prototype; probabilities are ``softmax(ε·cos)``.

Because a class's support rows always belong to its set, every class keeps exactly one prototype even when
no query is predicted into it (the benchmark's implementation averaged over predicted rows only and lost
such classes, which Dirichlet tasks with a class of 0 queries make common).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.preprocessing import cl2n
from lightning_putm.tasks import TaskBatch


def cosine(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Cosine similarity ``[T, Q, d] × [T, N, d] → [T, Q, N]``."""
    return F.normalize(x, dim=-1).bmm(F.normalize(centres, dim=-1).transpose(1, 2))


def rectify_prototypes(
    support: torch.Tensor,
    support_one_hot: torch.Tensor,
    query: torch.Tensor,
    temperature: float = 10.0,
    top_z: int | None = None,
) -> torch.Tensor:
    """Rectified prototypes ``[T, N, d]`` from support rows and (already shifted) query rows (step 2)."""
    prototypes = support_one_hot.transpose(1, 2).bmm(support) / support_one_hot.sum(1).unsqueeze(2).clamp_min(1)
    query_similarity = cosine(query, prototypes)  # [T, Q, N]
    ways = prototypes.shape[1]
    members = F.one_hot(query_similarity.argmax(2), ways).to(torch.bool)  # [T, Q, N]
    if top_z is not None:
        masked = query_similarity.masked_fill(~members, float("-inf"))
        rank = masked.argsort(dim=1, descending=True).argsort(dim=1)  # rank of each query within its column
        members = members & (rank < top_z)
    rows = torch.cat([support, query], dim=1)
    membership = torch.cat([support_one_hot.to(torch.bool), members], dim=1)  # [T, S+Q, N]
    scores = (temperature * cosine(rows, prototypes)).masked_fill(~membership, float("-inf"))
    weights = torch.softmax(scores, dim=1)  # over the members of each class's set; support rows keep it finite
    return weights.transpose(1, 2).bmm(rows)


class BDCSPN(FewShotMethod):
    name = "bdcspn"
    uses_base_mean = True

    def __init__(self, base_mean: torch.Tensor | None = None, temperature: float = 10.0, top_z: int | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if temperature <= 0:
            raise ConfigError(f"bdcspn.temperature must be positive, got {temperature}")
        if top_z is not None and int(top_z) < 0:
            raise ConfigError(f"bdcspn.top_z must be null (all pseudo-labelled queries) or >= 0, got {top_z}")
        self.base_mean = base_mean
        self.temperature = float(temperature)
        self.top_z = None if top_z is None else int(top_z)
        self.last_state: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        support = cl2n(tasks.support, self.base_mean, self.name)
        query = cl2n(tasks.query, self.base_mean, self.name)
        query = query + (support.mean(1, keepdim=True) - query.mean(1, keepdim=True))
        prototypes = rectify_prototypes(support, tasks.one_hot_support(), query, self.temperature, self.top_z)
        self.last_state = {"prototypes": prototypes}
        return torch.softmax(self.temperature * cosine(query, prototypes), dim=2)
