"""PUTM's hyper-parameters, their defaults by setting, and their validation.

Defaults follow the reference implementation (github.com/RashLog/PUTM) and the paper's §4 (implementation
details): power transform β = 0.6; CT weight ρ = 0.5 on Dirichlet-imbalanced tasks and 1.0 on balanced ones;
balance weight θ = 0 on imbalanced and 0.001 on balanced tasks; prototype inertia a = 0.2 at 1 shot and 0.1
otherwise; 50 EM steps of 30 Adam steps (lr 1e-3, betas (0.5, 0.99)); navigator widths 128 → 64 → 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_putm.errors import ConfigError
from lightning_putm.methods.putm.navigator import GEMM_MIN_WIDTH
from lightning_putm.methods.putm.precision import PRECISIONS

PROTOTYPE_UPDATES = ("forward", "backward", "mixed")
SOLVERS = ("auto", "compiled", "fused", "autograd")
INIT_DRAWS = ("cpu", "device")
BASES = ("qr", "cholesky")


@dataclass(frozen=True)
class PUTMSettings:
    """Resolved hyper-parameters (``None`` in the config, 'by setting', is resolved by :func:`resolve_settings`)."""

    beta: float = 0.6
    rho: float = 0.5
    theta: float = 0.0
    inertia: float = 0.2
    support_weight: float = 1.0
    inner_steps: int = 30
    em_steps: int = 50
    lr: float = 1e-3
    adam_betas: tuple[float, float] = (0.5, 0.99)
    hidden: tuple[int, ...] = (128, 64)
    init_tasks: int = 1000
    reinit_navigator: bool = False
    prototype_update: str = "forward"
    canonical_query_order: bool = True
    negative_slope: float = 0.01
    solver: str = "auto"
    init_draw: str = "cpu"
    precision: str = "auto"
    early_stop_tol: float | None = None
    max_chunk_tasks: int | None = None
    cpu_workers: int | None = None
    basis: str = "qr"


def resolve_settings(*, shots: int, balanced: bool, beta, rho, theta, inertia, inertia_one_shot, inertia_few_shot,
                     inner_steps, em_steps, lr, adam_betas, hidden, init_tasks, reinit_navigator, prototype_update,
                     canonical_query_order, solver, precision, early_stop_tol, max_chunk_tasks,
                     cpu_workers, init_draw="cpu", basis="qr", support_weight=1.0) -> PUTMSettings:
    """Checked settings; ``rho``/``theta``/``inertia`` of ``None`` take the reference's value for the setting
    (balanced or Dirichlet tasks, 1 shot or more). Raises :class:`ConfigError` on a bad value."""
    for key, value, allowed in (("prototype_update", prototype_update, PROTOTYPE_UPDATES),
                                ("solver", solver, SOLVERS), ("precision", precision, PRECISIONS),
                                ("init_draw", init_draw, INIT_DRAWS), ("basis", basis, BASES)):
        if value not in allowed:
            raise ConfigError(f"putm.{key} must be one of {', '.join(allowed)}; got {value!r}")
    if rho is None:
        rho = 1.0 if balanced else 0.5
    if theta is None:
        theta = 0.001 if balanced else 0.0
    if inertia is None:
        inertia = inertia_one_shot if shots == 1 else inertia_few_shot
    for key, value in (("rho", rho), ("theta", theta), ("inertia", inertia)):
        if not 0.0 <= float(value) <= 1.0:
            raise ConfigError(f"putm.{key} must lie in [0, 1], got {value}")
    for key, value in (("inner_steps", inner_steps), ("init_tasks", init_tasks)):
        if int(value) < 1:
            raise ConfigError(f"putm.{key} must be >= 1, got {value}")
    if int(em_steps) < 0:
        raise ConfigError(f"putm.em_steps must be >= 0, got {em_steps}")
    if beta <= 0:
        raise ConfigError(f"putm.beta must be positive, got {beta}")
    if not float(support_weight) > 0:
        raise ConfigError(f"putm.support_weight must be positive (1 = the reference code), got {support_weight}")
    if early_stop_tol is not None and float(early_stop_tol) < 0:
        raise ConfigError(f"putm.early_stop_tol must be null (off) or >= 0, got {early_stop_tol}")
    for key, value in (("max_chunk_tasks", max_chunk_tasks), ("cpu_workers", cpu_workers)):
        if value is not None and int(value) < 1:
            raise ConfigError(f"putm.{key} must be null (automatic) or >= 1, got {value}")
    hidden = tuple(int(h) for h in hidden)
    if solver != "autograd" and min(hidden, default=GEMM_MIN_WIDTH) < GEMM_MIN_WIDTH:
        raise ConfigError(f"putm.solver={solver} needs hidden widths >= {GEMM_MIN_WIDTH}, got {list(hidden)}; "
                          "use solver=autograd")
    return PUTMSettings(
        beta=float(beta), rho=float(rho), theta=float(theta), inertia=float(inertia),
        support_weight=float(support_weight), inner_steps=int(inner_steps), em_steps=int(em_steps), lr=float(lr),
        adam_betas=(float(adam_betas[0]), float(adam_betas[1])), hidden=hidden,
        init_tasks=int(init_tasks), reinit_navigator=bool(reinit_navigator), prototype_update=prototype_update,
        canonical_query_order=bool(canonical_query_order), solver=solver, init_draw=init_draw, precision=precision,
        early_stop_tol=None if early_stop_tol is None else float(early_stop_tol),
        max_chunk_tasks=None if max_chunk_tasks is None else int(max_chunk_tasks),
        cpu_workers=None if cpu_workers is None else int(cpu_workers), basis=basis,
    )
