"""ProtoNet-style nearest class mean (Snell et al., "Prototypical Networks for Few-shot Learning", NeurIPS 2017).

Inductive baseline with no normalisation at all: prototypes are the support class means of the raw
features, and a query's class probabilities are ``softmax(−temperature·‖x − μ_k‖²)`` (squared Euclidean
distance, as in the paper; temperature 1). It shows what the feature normalisation of SimpleShot and the
transductive methods add on top of the same prototypes.
"""

from __future__ import annotations

import torch

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.preprocessing import squared_distances
from lightning_putm.tasks import TaskBatch


class ProtoNet(FewShotMethod):
    name = "protonet"
    display_name = "ProtoNet"

    def __init__(self, temperature: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not temperature > 0:
            raise ConfigError(f"protonet.temperature must be positive, got {temperature}")
        self.temperature = float(temperature)

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        prototypes = tasks.support_means()
        return torch.softmax(-self.temperature * squared_distances(tasks.query, prototypes), dim=2)
