"""ProtoNet-style nearest class mean (Snell et al., "Prototypical Networks for Few-shot Learning", NeurIPS 2017).

Inductive baseline with no normalisation at all: prototypes are the support class means of the raw
features, and a query's class probabilities are ``softmax(−temperature·‖x − μ_k‖²)`` (squared Euclidean
distance, as in the paper; temperature 1). It shows what the feature normalisation of SimpleShot and the
transductive methods add on top of the same prototypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.options import MethodOptions, option
from lightning_putm.methods.preprocessing import squared_distances
from lightning_putm.tasks import TaskBatch


@dataclass(frozen=True)
class ProtoNetSettings(MethodOptions):
    method: ClassVar[str] = "protonet"

    temperature: float = option(1.0, low=0, low_open=True, help="probabilities = softmax(-temperature * "
                                "||x - mean_k||^2); does not change the prediction")


class ProtoNet(FewShotMethod):
    name = "protonet"
    display_name = "ProtoNet"
    Settings = ProtoNetSettings

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        prototypes = tasks.support_means()
        return torch.softmax(-self.temperature * squared_distances(tasks.query, prototypes), dim=2)
