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
           "autograd": "engines.AutogradEngine", "triton": "triton_engine.TritonEngine",
           "hopper": "hopper.launch.HopperEngine"}
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
                                   help="M-step weight of each support row against one query's navigator mass; 1 = the reference "
                                       "code; larger keeps the prototypes nearer the support means (preset support_anchored)")
    inner_steps: int = option(30, low=1, help="Adam steps per E-step")
    em_steps: int = option(50, low=0, help="EM iterations (one more E-step follows for the prediction)")
    lr: float = option(1e-3, low=0, low_open=True, help="Adam learning rate of the navigator")
    adam_betas: tuple[float, ...] = option((0.5, 0.99), low=0, high=1, high_open=True, length=2,
                                           help="Adam betas of the navigator")
    hidden: tuple[int, ...] = option((128, 64), low=1, help="navigator widths: input -> 128 -> 64 -> 1")
    init_tasks: int = option(1000, low=1, help="T in the reference's Xavier scale sqrt(2 / (out * (in + T))); fixed, "
                                                     "not the batch size")
    reinit_navigator: bool = option(False, help="true = paper's Algorithm 1 (new navigator every EM step); "
                                                        "false = reference code")
    prototype_update: str = option("forward", choices=PROTOTYPE_UPDATES,
                                   help="forward | backward | mixed (rho-weighted) navigator drives the M-step")
    canonical_query_order: bool = option(True, help="QR the queries in a fixed order so shuffling queries never "
                                                          "changes predictions")
    negative_slope: float = option(0.01, config=False, help="leaky-ReLU slope of the navigator (fixed)")
    solver: str = option("auto", choices=SOLVERS,
                         help="auto = triton on sm_90 GPUs (H100), compiled on other CUDA devices, fused elsewhere (CPU "
                              "results unchanged) | fused = hand-written backward + one flat Adam update, "
                              "bit-identical to autograd in fp32 on CPU | autograd = the plain formulation | "
                              "compiled = fused's maths with device-side Adam counters, a torch.compile'd step and "
                              "the Adam steps replayed as one CUDA graph; agrees with fused to float rounding | "
                              "triton = one fused Triton kernel per E-step and an M-step kernel, the EM loop on the "
                              "device (CUDA; TRITON_INTERPRET=1 runs it on CPU for tests) | hopper = one CUDA C++ kernel "
                              "per E-step for H100/H200 (sm_90), bf16 products, navigator 128 -> 64 -> 1; not yet run "
                              "on a GPU, never picked by auto. Speed: docs/gpu.md")
    init_draw: str = option("cpu", choices=INIT_DRAWS, help="navigator draws: cpu = per-task torch.Generator on the CPU "
                                                        "(the published numbers) | device = counter-based hash -> "
                                                        "Box-Muller normals on the solver's device, no copies (another "
                                                        "random draw: docs/lab/gpu-kernel.md)")
    precision: str = option("auto", choices=PRECISIONS, help="navigator products: auto = bf16 where bf16 products "
                         "are native (CUDA sm80+, CPU AVX512-BF16/AMX), else fp32 | fp32 = exact float32 products "
                         "(TF32 off) | tf32 = TF32 on CUDA (= fp32 on CPU) | bf16 = bfloat16 navigator products, "
                         "float32 weights/Adam/loss. Accuracy and speed: "
                         "docs/methods/putm.md#precision-threads-early-stopping")
    early_stop_tol: float | None = option(None, low=0, null="off",
                                          help="a task ends its EM loop once max|change of its prototypes| "
                                               "<= tol, and leaves the batch (results stay chunk-independent). "
                                               "Accuracy and speed by tol: "
                                               "docs/methods/putm.md#precision-threads-early-stopping")
    max_chunk_tasks: int | None = option(None, low=1, null="automatic", help="cap on tasks per chunk; automatic = "
                                          "from the memory budget, on CPU also at most 16 tasks per worker (cache)")
    cpu_workers: int | None = option(None, low=1, null="automatic",
                                     help="CPU threads solving parts of a chunk concurrently, 1 kernel thread each; "
                                          "automatic = torch's thread count")
    basis: str = option("auto", choices=BASES,
                        help="per-task frame of the rows: auto = cholesky on CUDA, qr elsewhere (CPU results "
                             "unchanged) | qr = Householder R of X^T (the published numbers) | cholesky = Cholesky "
                             "factor of the float64 Gram matrix XX^T, the same frame up to the sign of each "
                             "coordinate (which PUTM never sees), in one batched call on CUDA; a task with n > d rows "
                             "or repeated rows falls back to QR (with a warning when asked for by name). docs/gpu.md")
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
        if self.solver == "hopper":  # the same, and options the kernel does not have
            from lightning_putm.methods.putm.hopper.support import device_reason, settings_reason

            reason = settings_reason(self.hidden, self.precision) or device_reason(None)
            if reason is not None:
                raise ConfigError(reason)
        return self.replace(**changes) if changes else self


def resolve_settings(*, shots: int, balanced: bool, **options: Any) -> PUTMSettings:
    """Checked settings from keyword options (a config's ``method.putm``), resolved for the setting. Raises
    :class:`ConfigError` on a bad value or an unknown key."""
    return PUTMSettings.build(None, options, shots=shots, balanced=balanced)
