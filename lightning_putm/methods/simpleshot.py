"""SimpleShot (Wang et al., 2019): nearest class mean after CL2N normalisation.

CL2N subtracts the base-class feature mean, then L2-normalises each row. Without a base-class mean
(``base_mean=None``) only L2 normalisation is applied (SimpleShot's "L2N" variant), which needs no data
beyond the task. Probabilities are ``softmax(−‖x − μ_k‖²)`` over classes; the prediction is the nearest mean.
"""

from __future__ import annotations

import torch

from lightning_putm.methods.base import FewShotMethod, nearest_mean_probabilities
from lightning_putm.methods.preprocessing import l2_normalise
from lightning_putm.tasks import TaskBatch


class SimpleShot(FewShotMethod):
    name = "simpleshot"

    def __init__(self, base_mean: torch.Tensor | None = None, temperature: float = 10.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.base_mean = base_mean
        self.temperature = float(temperature)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        if self.base_mean is not None:
            x = x - self.base_mean.to(x.device, x.dtype)
        return l2_normalise(x)

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        support, query = self.normalise(tasks.support), self.normalise(tasks.query)
        prototypes = tasks.support_means(support)
        return nearest_mean_probabilities(query, prototypes, self.temperature)
