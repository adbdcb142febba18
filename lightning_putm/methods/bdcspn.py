"""BD-CSPN (Liu, Song & Qin, "Prototype Rectification for Few-Shot Learning", ECCV 2020), batched over tasks.

Features are CL2N-normalised (base-class mean subtracted, then L2; plain L2N without a base mean). Both
variants first reduce the cross-class bias with the shift ``ξ = mean(support rows) − mean(query rows)`` of each
task, then rectify the support-mean prototypes ``P_k`` with pseudo-labelled rows. They differ as follows.

``variant="benchmark"`` (default): the behaviour of the realistic-imbalance benchmark's code (Veilleux et al.,
NeurIPS 2021), which produced the BD-CSPN numbers that PUTM's Table 1 compares against.

1. The augmented set holds the support rows and the shifted queries ``x_j + ξ``. EVERY row of it, support rows
   included, is pseudo-labelled with its most cosine-similar prototype ``P_k``.
2. Each row gets the weights ``w_ik = softmax_k(ε·cos(x_i, P_k))`` (a softmax over the classes, ε = 10).
   Class k's rectified prototype averages ``w_ik·x_i`` over the ``n_k`` rows pseudo-labelled k:
   ``P'_k = (1/n_k) Σ_{i→k} w_ik x_i`` (not renormalised: the weights shrink it).
3. The shift is local to step 1: queries are classified by the nearest ``P'_k`` in Euclidean distance on the
   UNshifted (normalised) queries. Probabilities are ``softmax(−ε·‖x_j − P'_k‖²)``.

A class's own support row is always its most similar prototype at 1 shot, and at more shots its support rows
are nearly always nearest to their mean, so ``n_k ≥ 1`` in practice (measured on the fidelity settings of
``benchmarks/fidelity_peers.py``: never 0). Should no row fall into a class, its prototype stays the support
mean ``P_k`` (the benchmark's code would then drop the class from its prototype list).

``variant="paper"``: the paper's equations as this project first implemented them.

1. Every query is shifted by ``ξ`` for the whole method.
2. Each shifted query is pseudo-labelled with its most cosine-similar ``P_k``; class k's set holds its support
   rows (TRUE labels) and those queries (all, or the ``top_z`` most similar). ``P'_k = Σ_i w_ik x_i`` with
   ``w_ik = softmax_i(ε·cos(x_i, P_k))`` over the MEMBERS of that set (the weights of a class sum to 1).
3. Shifted queries go to the most cosine-similar ``P'_k``; probabilities are ``softmax(ε·cos)``.

``top_z`` (both variants) keeps, per class, only the ``top_z`` pseudo-labelled queries most similar to its
prototype (support rows are unaffected); ``None`` keeps them all, as both the paper's experiments and the
benchmark do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.peer_settings import BDCSPNSettings
from lightning_putm.methods.preprocessing import cl2n
from lightning_putm.tasks import TaskBatch
from lightning_putm.methods.registry import register_method


def cosine(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Cosine similarity ``[T, Q, d] × [T, N, d] → [T, Q, N]``."""
    return F.normalize(x, dim=-1).bmm(F.normalize(centres, dim=-1).transpose(1, 2))


def exact_squared_distances(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """``‖x_j − c_k‖²`` ``[T, Q, N]`` computed from differences (no ``‖x‖² + ‖c‖² − 2x·c`` cancellation)."""
    return torch.cdist(x, centres, compute_mode="donot_use_mm_for_euclid_dist").pow(2)


def _limit_to_top_z(members: torch.Tensor, similarity: torch.Tensor, top_z: int | None) -> torch.Tensor:
    """Keep, per class (column), only the ``top_z`` most similar member rows."""
    if top_z is None:
        return members
    masked = similarity.masked_fill(~members, float("-inf"))
    rank = masked.argsort(dim=1, descending=True).argsort(dim=1)  # rank of each row within its column
    return members & (rank < top_z)


def shift_queries(support: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Cross-class bias reduction: ``x_j + mean(support rows) − mean(query rows)`` per task."""
    return query + (support.mean(1, keepdim=True) - query.mean(1, keepdim=True))


def rectify_prototypes_benchmark(
    support: torch.Tensor,
    support_one_hot: torch.Tensor,
    query: torch.Tensor,
    temperature: float = 10.0,
    top_z: int | None = None,
    return_counts: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The benchmark's rectification ``[T, N, d]`` from normalised support and UNshifted query rows.

    Every row of ``[support; shifted query]`` is pseudo-labelled by cosine to the support means; class k's
    prototype is the mean over its rows of ``softmax_k(temperature·cos)_k · x``. A class with no row keeps
    its support mean. ``return_counts`` also returns the rows per class ``[T, N]``.
    """
    prototypes = support_one_hot.transpose(1, 2).bmm(support) / support_one_hot.sum(1).unsqueeze(2).clamp_min(1)
    rows = torch.cat([support, shift_queries(support, query)], dim=1)  # [T, S+Q, d]
    similarity = cosine(rows, prototypes)  # [T, S+Q, N]
    ways = prototypes.shape[1]
    members = F.one_hot(similarity.argmax(2), ways).to(torch.bool)
    s = support.shape[1]
    if top_z is not None:
        members = torch.cat([members[:, :s], _limit_to_top_z(members[:, s:], similarity[:, s:], top_z)], dim=1)
    weights = torch.softmax(temperature * similarity, dim=2) * members  # softmax over classes, kept where a member
    counts = members.sum(1).to(rows.dtype)  # [T, N]
    rectified = rows.transpose(1, 2).bmm(weights).transpose(1, 2) / counts.clamp_min(1).unsqueeze(2)
    rectified = torch.where((counts > 0).unsqueeze(2), rectified, prototypes)
    return (rectified, counts) if return_counts else rectified


def rectify_prototypes(
    support: torch.Tensor,
    support_one_hot: torch.Tensor,
    query: torch.Tensor,
    temperature: float = 10.0,
    top_z: int | None = None,
) -> torch.Tensor:
    """The ``paper`` variant's rectified prototypes ``[T, N, d]`` from support rows and ALREADY SHIFTED queries."""
    prototypes = support_one_hot.transpose(1, 2).bmm(support) / support_one_hot.sum(1).unsqueeze(2).clamp_min(1)
    query_similarity = cosine(query, prototypes)  # [T, Q, N]
    ways = prototypes.shape[1]
    members = F.one_hot(query_similarity.argmax(2), ways).to(torch.bool)  # [T, Q, N]
    members = _limit_to_top_z(members, query_similarity, top_z)
    rows = torch.cat([support, query], dim=1)
    membership = torch.cat([support_one_hot.to(torch.bool), members], dim=1)  # [T, S+Q, N]
    scores = (temperature * cosine(rows, prototypes)).masked_fill(~membership, float("-inf"))
    weights = torch.softmax(scores, dim=1)  # over the members of each class's set; support rows keep it finite
    return weights.transpose(1, 2).bmm(rows)


@register_method("bdcspn")
class BDCSPN(FewShotMethod):
    plot_slot = 5  # its colour and marker in every figure
    display_name = "BD-CSPN"
    uses_base_mean = True
    Settings = BDCSPNSettings

    def __init__(self, settings: BDCSPNSettings | None = None, *, base_mean: torch.Tensor | None = None,
                 **kwargs) -> None:
        super().__init__(settings, **kwargs)
        self.base_mean = base_mean
        self.last_state: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        support = cl2n(tasks.support, self.base_mean, self.name)
        query = cl2n(tasks.query, self.base_mean, self.name)
        if self.variant == "benchmark":
            prototypes, counts = rectify_prototypes_benchmark(support, tasks.one_hot_support(), query,
                                                              self.temperature, self.top_z, return_counts=True)
            self.last_state = {"prototypes": prototypes, "rows_per_class": counts}
            return torch.softmax(-self.temperature * exact_squared_distances(query, prototypes), dim=2)
        query = shift_queries(support, query)
        prototypes = rectify_prototypes(support, tasks.one_hot_support(), query, self.temperature, self.top_z)
        self.last_state = {"prototypes": prototypes}
        return torch.softmax(self.temperature * cosine(query, prototypes), dim=2)
