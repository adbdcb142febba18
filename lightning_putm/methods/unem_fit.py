"""Learning UNEM's parameters by unrolling ("learning to optimize", Zhou et al., CVPR 2025; reference
``UNEM_Gaussian/src/unroll_trainer.py``), on tensors only: the tasks come from validation classes, never test ones.

The reference trains the ``U_PADDLE_EMBT_L`` model on one fixed set of 1000 validation tasks, full batch: Adam
(lr 0.1), 100 iterations, step decay ×0.5 every 50, starting from t1 = gamma = t2 = 1 (raw). Its loss is
``torch.nn.CrossEntropyLoss`` applied to the model's output, which is already a probability vector, i.e. the
cross-entropy of ``softmax(u)`` (``loss="reference"``, the default, so that our fit learns what theirs learns);
``loss="nll"`` is the negative log of the probabilities themselves (the textbook choice), an option.

The helpers here save and read the result as a small JSON (``save_params``; read back by
:func:`lightning_putm.methods.unem.load_params`), so a fit runs once per feature file and setting and is cached.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from lightning_putm.atomic import atomic_write_text
from lightning_putm.methods.peer_settings import LOSSES, FitSettings
from lightning_putm.methods.unem import PARAMS_FORMAT, UNEMParams, unem_forward
from lightning_putm.tasks import TaskBatch


def unrolling_loss(probabilities: torch.Tensor, labels: torch.Tensor, loss: str = "reference") -> torch.Tensor:
    """Mean loss over all queries of all tasks: ``reference`` = cross-entropy of ``softmax(probabilities)`` (what
    ``CrossEntropyLoss`` does to the reference's probability output), ``nll`` = ``−log p(true class)``."""
    flat, target = probabilities.reshape(-1, probabilities.shape[-1]), labels.reshape(-1)
    if loss == "reference":
        return F.cross_entropy(flat, target)
    return F.nll_loss(torch.log(flat.clamp_min(torch.finfo(flat.dtype).tiny)), target)


def _rows(tasks: TaskBatch, normalise: str) -> tuple[torch.Tensor, torch.Tensor]:
    if normalise == "l2":
        return F.normalize(tasks.support, dim=2), F.normalize(tasks.query, dim=2)
    return tasks.support, tasks.query


def evaluate_loss(params: UNEMParams, tasks: TaskBatch, query_labels: torch.Tensor,
                  settings: FitSettings = FitSettings()) -> float:
    """The unrolling loss of ``params`` on labelled tasks (e.g. held-out validation tasks)."""
    support, query = _rows(tasks, settings.normalise)
    with torch.no_grad():
        out = unem_forward(support, tasks.one_hot_support(), query, params)
        return float(unrolling_loss(out, query_labels, settings.loss))


def fit_params(tasks: TaskBatch, query_labels: torch.Tensor, settings: FitSettings = FitSettings(),
               initial: UNEMParams | None = None,
               on_iteration: Callable[[int, float], None] | None = None) -> tuple[UNEMParams, list[float]]:
    """Learn ``t1``, ``gamma[L]``, ``t2[L]`` on labelled validation tasks by backpropagating through all ``L``
    unrolled EM layers, full batch as the reference does. Returns the parameters and the loss per iteration
    (before each update). ``on_iteration(i, loss)`` is called after each (a caller's time estimate)."""
    start = initial if initial is not None else UNEMParams.initial(settings.layers, settings.initial)
    leaves = [p.detach().clone().to(tasks.device, tasks.query.dtype).requires_grad_(True)
              for p in (start.t1, start.gamma, start.t2)]
    params = UNEMParams(*leaves)
    optimiser = torch.optim.Adam(leaves, lr=settings.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimiser, step_size=settings.step_size, gamma=settings.step_gamma)
    support, query = _rows(tasks, settings.normalise)
    one_hot = tasks.one_hot_support()
    history: list[float] = []
    for _ in range(settings.iterations):
        optimiser.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = unrolling_loss(unem_forward(support, one_hot, query, params), query_labels, settings.loss)
            loss.backward()
        optimiser.step()
        scheduler.step()
        history.append(float(loss.detach()))
        if on_iteration is not None:
            on_iteration(len(history), history[-1])
    return UNEMParams(*(p.detach().cpu() for p in leaves)), history


def save_params(path: str | Path, params: UNEMParams, meta: dict[str, Any] | None = None) -> Path:
    """Write ``params`` as JSON (raw values, with a format tag and ``meta`` such as the fit's settings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": PARAMS_FORMAT, **params.to_dict(), "meta": dict(meta or {})}
    atomic_write_text(path, json.dumps(payload, indent=1) + "\n")
    return path


__all__ = ["FitSettings", "LOSSES", "evaluate_loss", "fit_params", "save_params", "unrolling_loss"]
