"""UNEM, vision-only (Gaussian) variant: "UNEM: UNrolled generalized EM for transductive few-shot learning"
(Zhou et al., CVPR 2025, arXiv 2412.16739), re-implemented from the paper and batched over tasks. Reference code:
github.com/ZhouLong0/UNEM-Transductive, folder ``UNEM_Gaussian`` (``src/methods/U_Paddle_embt.py``, the
``U_PADDLE_EMBT_L`` model; training in ``src/unroll_trainer.py``).

UNEM unrolls a generalized EM for a Gaussian mixture with unit covariance whose class proportions are penalised
(PADDLE, Martin et al. 2024: a class-count term that lets empty classes vanish), and *learns* the hyper-parameters
of every EM step on validation tasks instead of sweeping them by hand: each iteration is a layer with its own
class-balance weight λ^(ℓ) and temperature T^(ℓ) (the paper's Fig. 2; here ``γ_l`` and ``1 + τ₂,l``). Per task, with
features ``z`` (support and query, as given: no normalisation by default, like the reference):

1. Scale every row by ``τ₁ = softplus(t1)`` (learned feature temperature).
2. Prototypes ``w_k`` = support class means (of the scaled rows); log-proportions ``v_k = 1``.
3. For each layer ``l = 1..L`` (``L = 10``):
   a. E-step: ``u_jk = softmax_k[(−½‖z_j − w_k‖² + γ_l·v_k) / (1 + τ₂,l)]`` with ``γ_l = softplus(gamma_l)``
      (class-balance weight) and ``τ₂,l = softplus(t2_l)`` (assignment temperature), both learned per layer;
   b. proportions: ``v_k = log(mean_j u_jk + 1e-6) + 1``;
   c. M-step: ``w_k = (Σ_j u_jk z_j + Σ_{i∈S_k} z_i) / (Σ_j u_jk + |S_k|)``.
4. Output the last layer's ``u`` (the reference returns it; the last M-step is unused).

The class proportions are *estimated* from the soft assignments; nothing about the true query counts is used, so
the method is fair on every protocol (``uses_class_prior = False``: it can never receive ``query_counts``).

Parameters (``t1``, ``gamma[L]``, ``t2[L]``, raw pre-softplus values as the reference stores them) come from, in
order: ``params_file`` (a JSON written by :func:`lightning_putm.methods.unem_fit.save_params`, or the authors'
``.pt`` state dict, read with ``weights_only=True``), else ``learned``: the authors' published learned values for a
dataset and backbone (:mod:`~lightning_putm.methods.unem_presets`; the entry for the nearest published shot count),
``initial`` (the reference's untrained initialisation t1 = gamma = t2 = 1), or ``auto`` (the default). Learned
values belong to the features they were learned on: the published ones put UNEM below its own untrained start on
features they were not fitted on (docs/methods/unem.md). So ``auto`` is the untrained start here, and
``evaluate.py`` replaces it, where the checkpoint's data has validation classes, by parameters fitted on them
(:mod:`lightning_putm.evaluation.unem_default`, through ``params_file``); for a feature file, fit them on its
validation classes yourself (:mod:`lightning_putm.methods.unem_fit`, ``python -m lightning_putm fit-unem``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.peer_settings import AUTO, DEFAULT_LAYERS, PRESETS, UNEMSettings
from lightning_putm.methods.preprocessing import l2_normalise
from lightning_putm.methods.unem_presets import PUBLISHED
from lightning_putm.signals import check_stop
from lightning_putm.tasks import TaskBatch, weighted_class_means
from lightning_putm.methods.registry import register_method

#: The ``+ 1e-6`` inside the log of the class proportions (reference ``V = log(U.sum(1)/n_query + 1e-6) + 1``).
PROPORTION_EPS = 1e-6
PARAMS_FORMAT = "lightning-putm/unem-gaussian/1"


@dataclass(frozen=True)
class UNEMParams:
    """The learned parameters of UNEM-Gaussian as raw values (the model applies softplus): ``t1`` (scalar),
    ``gamma`` and ``t2`` (one per layer). Tensors may require grad (the fit optimises them)."""

    t1: torch.Tensor
    gamma: torch.Tensor
    t2: torch.Tensor

    def __post_init__(self) -> None:
        if self.t1.dim() != 0 or self.gamma.dim() != 1 or self.t2.shape != self.gamma.shape or len(self.gamma) < 1:
            raise ValueError(f"UNEM parameters need a scalar t1 and gamma, t2 of the same length >= 1; got shapes "
                             f"{tuple(self.t1.shape)}, {tuple(self.gamma.shape)}, {tuple(self.t2.shape)}")

    @property
    def layers(self) -> int:
        return int(self.gamma.shape[0])

    @classmethod
    def from_values(cls, t1: float, gamma: list[float], t2: list[float]) -> UNEMParams:
        as_tensor = lambda v: torch.as_tensor(v, dtype=torch.float32)  # noqa: E731
        return cls(as_tensor(float(t1)), as_tensor([float(g) for g in gamma]), as_tensor([float(t) for t in t2]))

    @classmethod
    def initial(cls, layers: int = DEFAULT_LAYERS, value: float = 1.0) -> UNEMParams:
        """The reference's untrained initialisation: every raw value ``value`` (1.0)."""
        return cls.from_values(value, [value] * layers, [value] * layers)

    def to_dict(self) -> dict[str, Any]:
        return {"t1": float(self.t1), "gamma": [float(g) for g in self.gamma], "t2": [float(t) for t in self.t2]}

    def detached(self) -> UNEMParams:
        return UNEMParams(self.t1.detach().clone(), self.gamma.detach().clone(), self.t2.detach().clone())


def preset_params(preset: str, shots: int | None) -> UNEMParams:
    """A named preset: the authors' learned values for ``preset`` at the published shot count nearest to ``shots``
    (1, 5, 10, 20; nearest in log scale, so 3 shots take 5), or the untrained initialisation (``initial``, and
    ``auto`` where nothing was fitted: see the module's docstring)."""
    if preset in ("initial", AUTO):
        return UNEMParams.initial()
    if preset not in PUBLISHED:
        raise ConfigError(f"method.unem.learned must be one of {', '.join(PRESETS)}, got {preset!r}")
    table = PUBLISHED[preset]
    k = max(1, int(shots or 1))
    nearest = min(table, key=lambda s: (abs(math.log(s) - math.log(k)), s))
    entry = table[nearest]
    return UNEMParams.from_values(entry["t1"], entry["gamma"], entry["t2"])  # type: ignore[arg-type]


def params_path(template: str, shots: int | None) -> str:
    """``params_file`` for this setting: ``{shots}`` in it becomes the number of shots (one fitted file per shot
    count, e.g. ``omniglot_{shots}shot.json``), so one evaluation over several shot counts can name them all."""
    if "{shots}" not in template:
        return template
    if shots is None:
        raise ConfigError(f"method.unem.params_file={template!r} has {{shots}} but the number of shots is unknown")
    return template.replace("{shots}", str(int(shots)))


def load_params(path: str | Path) -> UNEMParams:
    """Parameters from ``path``: our JSON (:func:`lightning_putm.methods.unem_fit.save_params`) or the authors'
    ``U_PADDLE_EMBT_L`` state dict (``t1``, ``gamma.<i>``, ``t2.<i>``) in a ``.pt`` file, read with
    ``weights_only=True`` (never unpickled). Anything else is a :class:`ConfigError` naming the file."""
    path = Path(path)
    where = f"UNEM parameter file {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist; fit one with `python -m lightning_putm fit-unem` "
                          "or set method.unem.params_file=null to use method.unem.learned")
    try:
        if path.suffix.lower() in (".pt", ".pth"):
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or "t1" not in state:
                raise ValueError("expected a state dict with keys t1, gamma.<i>, t2.<i>")
            layers = sum(1 for key in state if str(key).startswith("gamma."))
            if set(state) != {"t1", *(f"gamma.{i}" for i in range(layers)), *(f"t2.{i}" for i in range(layers))}:
                raise ValueError(f"expected keys t1, gamma.0..{layers - 1}, t2.0..{layers - 1}; got "
                                 f"{', '.join(sorted(map(str, state)))} (only the per-layer U_PADDLE_EMBT_L model)")
            return UNEMParams.from_values(float(state["t1"]), [float(state[f"gamma.{i}"]) for i in range(layers)],
                                          [float(state[f"t2.{i}"]) for i in range(layers)])
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != PARAMS_FORMAT:
            raise ValueError(f"not a UNEM parameter file (expected \"format\": \"{PARAMS_FORMAT}\")")
        params = UNEMParams.from_values(data["t1"], list(data["gamma"]), list(data["t2"]))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- every way a file can be wrong becomes one clear message
        raise ConfigError(f"{where} cannot be read as UNEM parameters: {exc}") from None
    values = torch.cat([params.t1.view(1), params.gamma, params.t2])
    if not torch.isfinite(values).all():
        raise ConfigError(f"{where} holds non-finite values")
    return params


def params_summary(path: str | Path) -> str:
    """The one-line ``summary`` a parameter JSON's ``meta`` holds (``learned=auto``'s: fitted or not, on what), or
    ``""`` (the authors' ``.pt``, a file without one)."""
    if Path(path).suffix.lower() in (".pt", ".pth"):
        return ""
    try:
        summary = json.loads(Path(path).read_text()).get("meta", {}).get("summary", "")
    except (OSError, ValueError, AttributeError):
        return ""
    return summary if isinstance(summary, str) else ""


def unem_forward(support: torch.Tensor, support_one_hot: torch.Tensor, query: torch.Tensor,
                 params: UNEMParams) -> torch.Tensor:
    """The unrolled generalized EM (the paper's Fig. 2; reference ``U_Paddle_EMBT.forward``) on ``T`` tasks at once:
    support ``[T, S, d]`` with one-hot labels ``[T, S, N]``, query ``[T, Q, d]`` → soft assignments ``[T, Q, N]`` of
    the last layer. Differentiable in ``params`` (the fit backpropagates through every layer)."""
    dtype = query.dtype
    scale = F.softplus(params.t1.to(query.device, dtype))
    gammas = F.softplus(params.gamma.to(query.device, dtype))
    temperatures = 1.0 + F.softplus(params.t2.to(query.device, dtype))
    support, query = support * scale, query * scale
    counts = support_one_hot.sum(1)  # [T, N]
    support_sums = support.transpose(1, 2).bmm(support_one_hot).transpose(1, 2)  # [T, N, d]
    prototypes = weighted_class_means(support, support_one_hot)
    log_prop = torch.ones(query.shape[0], support_one_hot.shape[2], dtype=dtype, device=query.device)
    query_sq = query.pow(2).sum(2, keepdim=True)  # [T, Q, 1]
    assignments = query.new_zeros(query.shape[0], query.shape[1], support_one_hot.shape[2])
    for layer in range(params.layers):
        check_stop()  # Ctrl-C / SIGTERM between layers (lightning_putm.signals)
        logits = query.bmm(prototypes.transpose(1, 2)) - 0.5 * prototypes.pow(2).sum(2).unsqueeze(1) - 0.5 * query_sq
        assignments = torch.softmax((logits + gammas[layer] * log_prop.unsqueeze(1)) / temperatures[layer], dim=2)
        log_prop = torch.log(assignments.mean(1) + PROPORTION_EPS) + 1.0
        totals = query.transpose(1, 2).bmm(assignments).transpose(1, 2) + support_sums
        prototypes = totals / (assignments.sum(1) + counts).unsqueeze(2)
    return assignments


@register_method("unem")
class UNEM(FewShotMethod):
    """UNEM-Gaussian (Zhou et al., CVPR 2025): an unrolled, learned generalized EM for imbalanced query sets."""

    plot_slot = 11  # its colour and marker in every figure
    display_name = "UNEM"
    Settings = UNEMSettings

    def __init__(self, settings: UNEMSettings | None = None, *, shots: int | None = None,
                 params: UNEMParams | None = None, **kwargs: Any) -> None:
        """``params`` (learned values) overrides ``params_file`` and ``learned``. ``shots`` chooses the published
        preset's shot count (and ``{shots}`` in ``params_file``): without it, give ``params``, a ``params_file``
        or ``learned=initial``."""
        super().__init__(settings, shots=shots, **kwargs)
        if params is None and shots is None and not self.params_file and self.learned not in ("initial", AUTO):
            raise ConfigError(f"unem: the number of shots is needed to choose the published parameters of "
                              f"learned={self.learned} (fitted at 1, 5, 10 and 20 shots); build it with shots=K "
                              "(support examples per class), or give params_file or learned=initial")
        if params is not None:
            self.params = params.detached()
            self.params_source = "given"
        elif self.params_file:
            path = params_path(self.params_file, shots)
            self.params = load_params(path)
            summary = params_summary(path)
            self.params_source = f"{path} ({summary})" if summary else str(path)
        else:
            self.params = preset_params(self.learned, shots)
            self.params_source = ("learned auto: the untrained start (nothing fitted)" if self.learned == AUTO
                                  else f"learned {self.learned}")

    def learned_inputs(self) -> dict[str, Any]:
        """The parameters in use and where they came from (a run's provenance names them): a rewritten
        ``params_file``, or ``learned=auto`` fitted rather than the untrained start, is a new input."""
        return {"params": {name: getattr(self.params, name).detach().cpu().tolist() for name in ("t1", "gamma", "t2")},
                "source": self.params_source}

    def bytes_per_task(self, tasks: TaskBatch) -> int:
        n = tasks.num_support + tasks.num_queries
        return 4 * (3 * n * tasks.dim + 8 * tasks.num_queries * tasks.ways + 4 * tasks.ways * tasks.dim)

    def preprocess(self, rows: torch.Tensor) -> torch.Tensor:
        return l2_normalise(rows) if self.normalise == "l2" else rows

    @torch.no_grad()
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        return unem_forward(self.preprocess(tasks.support), tasks.one_hot_support(), self.preprocess(tasks.query),
                            self.params)


__all__ = ["UNEM", "UNEMParams", "UNEMSettings", "load_params", "params_path", "params_summary", "preset_params",
           "unem_forward", "PRESETS"]
