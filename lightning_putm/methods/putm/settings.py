"""PUTM's hyper-parameters, their defaults by setting, and their validation.

Defaults follow the reference implementation (github.com/RashLog/PUTM) and the paper's §4 (implementation
details): power transform β = 0.6; CT weight ρ = 0.5 on Dirichlet-imbalanced tasks and 1.0 on balanced ones;
balance weight θ = 0 on imbalanced and 0.001 on balanced tasks; prototype inertia a = 0.2 at 1 shot and 0.1
otherwise; 50 EM steps of 30 Adam steps (lr 1e-3, betas (0.5, 0.99)); navigator widths 128 → 64 → 1.

This module imports no torch (nor does the package's ``__init__``), so that ``--help`` and the config checks read
PUTM's options without loading the solver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lightning_putm.errors import ConfigError
from lightning_putm.methods.options import MethodOptions, option, shots_needed

#: A navigator layer narrower than this is stored zero-padded to it (:class:`~.navigator.Navigator`); every
#: solver but ``autograd`` needs hidden widths of at least this.
GEMM_MIN_WIDTH = 8
#: ``precision``: the navigator products' arithmetic (:mod:`.precision`).
PRECISIONS = ("auto", "fp32", "tf32", "bf16")
PROTOTYPE_UPDATES = ("forward", "backward", "mixed")
#: The E-step engines, by ``solver`` value: ``"<module>.<class>"`` in ``lightning_putm.methods.putm``, imported on
#: first use (:func:`.solvers.engine_class`). A new engine is a module holding an :class:`.engines.Engine` subclass
#: and one line here (docs/design.md, "The engine layer").
ENGINES = {"compiled": "compiled.CompiledEngine", "fused": "engines.FusedEngine",
           "autograd": "engines.AutogradEngine", "triton": "triton_engine.TritonEngine"}
#: ``solver``: ``auto`` (chosen by device, :func:`.solvers.resolve_solver`) or an engine of :data:`ENGINES`.
SOLVERS = ("auto", *ENGINES)
INIT_DRAWS = ("cpu", "device")
BASES = ("auto", "qr", "cholesky")


@dataclass(frozen=True)
class PUTMSettings(MethodOptions):
    """PUTM's options, each declared once (name, type, default, bounds, help). Built from a config
    (:meth:`~lightning_putm.methods.options.MethodOptions.from_mapping`), ``rho``/``theta``/``inertia`` of ``None``
    are chosen by :meth:`resolve` for the setting; a directly built ``PUTMSettings()`` holds the Dirichlet 1-shot
    values."""

    method: ClassVar[str] = "putm"

    beta: float = option(0.6, low=0, low_open=True, help="power transform (x + 1e-6)^beta")
    rho: float | None = option(0.5, low=0, high=1, by_setting="0.5 on Dirichlet tasks, 1.0 on balanced tasks",
                               help="CT forward/backward weight; null = 0.5 on Dirichlet tasks, 1.0 on balanced tasks")
    theta: float | None = option(0.0, low=0, high=1, by_setting="0 on Dirichlet tasks, 0.001 on balanced tasks",
                                 help="balance-term weight; null = 0 on Dirichlet tasks, 0.001 on balanced tasks")
    inertia: float | None = option(0.2, low=0, high=1,
                                   by_setting="inertia_one_shot at 1 shot, else inertia_few_shot",
                                   help="prototype update rate a; null = inertia_one_shot at 1 shot, else "
                                        "inertia_few_shot")
    inertia_one_shot: float = option(0.2, low=0, high=1, help="inertia at 1 shot")
    inertia_few_shot: float = option(0.1, low=0, high=1, help="inertia at more than 1 shot")
    support_weight: float = option(1.0, low=0, low_open=True, why="1 = the reference code",
                                   help="M-step weight of each support row against one query's navigator mass")
    inner_steps: int = option(30, low=1, help="Adam steps per E-step")
    em_steps: int = option(50, low=0, help="EM iterations (one more E-step follows for the prediction)")
    lr: float = option(1e-3, low=0, low_open=True, help="Adam learning rate of the navigator")
    adam_betas: tuple[float, ...] = option((0.5, 0.99), low=0, high=1, high_open=True, length=2,
                                           help="Adam betas of the navigator")
    hidden: tuple[int, ...] = option((128, 64), low=1, help="navigator widths: input -> 128 -> 64 -> 1")
    init_tasks: int = option(1000, low=1, help="T in the reference's Xavier scale sqrt(2 / (out * (in + T)))")
    reinit_navigator: bool = option(False, help="true = paper's Algorithm 1 (new navigator every EM step)")
    prototype_update: str = option("forward", choices=PROTOTYPE_UPDATES,
                                   help="forward | backward | mixed (rho-weighted) navigator drives the M-step")
    canonical_query_order: bool = option(True, help="QR the queries in a fixed order (shuffle-invariant)")
    negative_slope: float = option(0.01, config=False, help="leaky-ReLU slope of the navigator (fixed)")
    solver: str = option("auto", choices=SOLVERS,
                         help="auto = triton on sm_90 GPUs (H100), compiled on other CUDA devices, fused elsewhere; "
                              "triton = fused Triton kernels, the EM loop on the device (CUDA)")
    init_draw: str = option("cpu", choices=INIT_DRAWS, help="where the navigator's random draws are made")
    precision: str = option("auto", choices=PRECISIONS, help="navigator products: auto | fp32 | tf32 | bf16")
    early_stop_tol: float | None = option(None, low=0, null="off",
                                          help="a task ends its EM loop once its prototypes move by <= tol")
    max_chunk_tasks: int | None = option(None, low=1, null="automatic", help="cap on tasks per chunk")
    cpu_workers: int | None = option(None, low=1, null="automatic",
                                     help="CPU threads solving parts of a chunk concurrently")
    basis: str = option("auto", choices=BASES,
                        help="per-task frame of the rows: auto = cholesky on CUDA, qr elsewhere | qr | cholesky")
    # solver=triton's launch settings: not config keys (benchmarks/bench_putm.py --triton-* and the tests set them
    # on a PUTMSettings); the defaults are the measured fastest, docs/lab/gpu-kernel.md
    triton_warps: int = option(8, low=1, high=32, config=False,
                               help="solver=triton: warps per kernel program (a power of two)")
    triton_stages: int = option(3, low=1, config=False,
                                help="solver=triton: software-pipelining stages of the kernel's loops over pair tiles "
                                     "(1: none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.triton_warps & (self.triton_warps - 1):
            raise ConfigError(f"{self.key('triton_warps')} must be a power of two, got {self.triton_warps}")

    def resolve(self, *, shots: int | None, balanced: bool | None) -> PUTMSettings:
        """``rho``/``theta``/``inertia`` of ``None`` take the reference's value for the setting (balanced or
        Dirichlet tasks, 1 shot or more); the solver must suit the navigator widths."""
        changes: dict[str, Any] = {}
        if self.rho is None:
            changes["rho"] = 1.0 if balanced else 0.5
        if self.theta is None:
            changes["theta"] = 0.001 if balanced else 0.0
        if self.inertia is None:
            if shots is None:
                raise shots_needed(self.method, ["inertia"])
            changes["inertia"] = self.inertia_one_shot if shots == 1 else self.inertia_few_shot
        if self.solver != "autograd" and min(self.hidden, default=GEMM_MIN_WIDTH) < GEMM_MIN_WIDTH:
            raise ConfigError(f"method.putm.solver={self.solver} needs hidden widths >= {GEMM_MIN_WIDTH}, got "
                              f"{list(self.hidden)}; use solver=autograd")
        if self.solver == "triton":  # refused on a machine where it cannot run, before any work
            from lightning_putm.methods.putm.triton_support import unavailable_reason

            reason = unavailable_reason(None)
            if reason is not None:
                raise ConfigError(reason)
        return self.replace(**changes) if changes else self


def resolve_settings(*, shots: int, balanced: bool, **options: Any) -> PUTMSettings:
    """Checked settings from keyword options (a config's ``method.putm``), resolved for the setting. Raises
    :class:`ConfigError` on a bad value or an unknown key."""
    return PUTMSettings.build(None, options, shots=shots, balanced=balanced)
