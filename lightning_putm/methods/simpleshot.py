"""SimpleShot (Wang et al., "SimpleShot: Revisiting Nearest-Neighbor Classification for Few-Shot Learning",
2019): nearest class mean after CL2N normalisation.

CL2N subtracts the base-class feature mean (the mean of the backbone's features over the base/training
classes), then L2-normalises each row. The evaluation passes that mean from ``base_features=<file>``.
Without it (``base_mean=None``) the method falls back to plain L2 normalisation, SimpleShot's "L2N" variant,
which needs no data beyond the task and stays inductive (a mean of the task's own rows would not); the
evaluation prints one notice when this happens. Probabilities are ``softmax(−temperature·‖x − μ_k‖²)``;
the prediction is the nearest mean whatever the temperature.
"""

from __future__ import annotations

import torch

from lightning_putm.methods.base import FewShotMethod, nearest_mean_probabilities
from lightning_putm.methods.peer_settings import SimpleShotSettings
from lightning_putm.methods.preprocessing import cl2n
from lightning_putm.tasks import TaskBatch
from lightning_putm.methods.registry import register_method


@register_method("simpleshot")
class SimpleShot(FewShotMethod):
    plot_slot = 2  # its colour and marker in every figure
    display_name = "SimpleShot"
    uses_base_mean = True
    Settings = SimpleShotSettings

    def __init__(self, settings: SimpleShotSettings | None = None, *, base_mean: torch.Tensor | None = None,
                 **kwargs) -> None:
        super().__init__(settings, **kwargs)
        self.base_mean = base_mean

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return cl2n(x, self.base_mean, self.name)

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        support, query = self.normalise(tasks.support), self.normalise(tasks.query)
        prototypes = tasks.support_means(support)
        return nearest_mean_probabilities(query, prototypes, self.temperature)
