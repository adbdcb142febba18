"""ProtoNet-style nearest class mean (Snell et al., "Prototypical Networks for Few-shot Learning", NeurIPS 2017).

Inductive baseline with no normalisation at all: prototypes are the support class means of the raw
features, and a query's class probabilities are ``softmax(−temperature·‖x − μ_k‖²)`` (squared Euclidean
distance, as in the paper; temperature 1). It shows what the feature normalisation of SimpleShot and the
transductive methods add on top of the same prototypes.
"""

from __future__ import annotations

import torch

from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.peer_settings import ProtoNetSettings
from lightning_putm.methods.preprocessing import squared_distances
from lightning_putm.tasks import TaskBatch
from lightning_putm.methods.registry import register_method


@register_method("protonet")
class ProtoNet(FewShotMethod):
    plot_slot = 9  # its colour and marker in every figure
    display_name = "ProtoNet"
    Settings = ProtoNetSettings

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        prototypes = tasks.support_means()
        return torch.softmax(-self.temperature * squared_distances(tasks.query, prototypes), dim=2)
