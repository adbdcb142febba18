"""The peer methods' settings: one frozen dataclass per method declares its options (PUTM's are in
:mod:`~lightning_putm.methods.putm.settings`); and the settings of UNEM's parameter fit (``fit-unem``).

Each method module sets its class's ``Settings`` to its dataclass here (``PTMAP.Settings = PTMAPSettings``). They
live apart from the methods because they import no torch: ``--help`` and every job's config check read a method's
options from them (:mod:`~lightning_putm.methods.catalog`) without importing the methods, so a mistyped
``method.<name>.<key>`` is an error before torch loads. The option machinery is
:mod:`~lightning_putm.methods.options`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lightning_putm.errors import ConfigError
from lightning_putm.methods.options import MethodOptions, option, shots_needed


# ---------------------------------------------------------------- SimpleShot: methods/simpleshot.py
@dataclass(frozen=True)
class SimpleShotSettings(MethodOptions):
    method: ClassVar[str] = "simpleshot"

    temperature: float = option(10.0, low=0, low_open=True,
                                help="softmax temperature on -squared distance; does not change the prediction")


# -------------------------------------------------------------------- ProtoNet: methods/protonet.py
@dataclass(frozen=True)
class ProtoNetSettings(MethodOptions):
    method: ClassVar[str] = "protonet"

    temperature: float = option(1.0, low=0, low_open=True, help="probabilities = softmax(-temperature * "
                                "||x - mean_k||^2); does not change the prediction")


# ------------------------------------------------------------------------- PT-MAP: methods/ptmap.py
@dataclass(frozen=True)
class PTMAPSettings(MethodOptions):
    method: ClassVar[str] = "ptmap"

    beta: float = option(0.5, low=0, low_open=True,
                         help="power transform (x + 1e-6)^beta; features must be non-negative")
    lam: float = option(10.0, low=0, low_open=True, help="Sinkhorn on exp(-lam * squared distance)")
    inertia: float = option(0.2, low=0, high=1, help="centre update mu <- mu + inertia * (estimate - mu)")
    iterations: int = option(20, low=0, help="MAP iterations (a final transport plan gives the probabilities)")
    sinkhorn_eps: float = option(1e-6, low=0, low_open=True,
                                 help="per-task Sinkhorn stop when the row sums move by at most this")
    sinkhorn_max_iters: int = option(1000, low=1, help="Sinkhorn iteration cap")


# -------------------------------------------------------------------- TIM and α-TIM: methods/tim.py
LOSS_WEIGHTS_HELP = "[CE, H(Y_Q), H(Y_Q|X_Q)] weights"


@dataclass(frozen=True)
class TIMSettings(MethodOptions):
    method: ClassVar[str] = "tim"

    temperature: float = option(15.0, low=0, low_open=True, help="T of the logits -T/2 ||z - w_k||^2")
    loss_weights: tuple[float, ...] | None = option(
        None, low=0, length=3, by_setting="loss_weights_balanced on balanced tasks, else loss_weights_dirichlet",
        help=f"{LOSS_WEIGHTS_HELP}; null = loss_weights_balanced on balanced tasks, else loss_weights_dirichlet")
    loss_weights_dirichlet: tuple[float, ...] = option(
        (1.0, 1.0, 1.0), low=0, length=3, help=f"{LOSS_WEIGHTS_HELP} on Dirichlet tasks (realistic-imbalance benchmark)")
    loss_weights_balanced: tuple[float, ...] = option(
        (0.1, 1.0, 0.1), low=0, length=3, help=f"{LOSS_WEIGHTS_HELP} on balanced tasks (TIM paper)")
    lr: float = option(1e-4, low=0, low_open=True, help="Adam learning rate")
    iterations: int = option(1000, low=0, help="Adam steps")

    def resolve(self, *, shots: int | None, balanced: bool | None) -> TIMSettings:
        if self.loss_weights is not None:
            return self
        return self.replace(loss_weights=self.loss_weights_balanced if balanced else self.loss_weights_dirichlet)


@dataclass(frozen=True)
class AlphaTIMSettings(MethodOptions):
    method: ClassVar[str] = "alpha_tim"

    alpha: float | None = option(
        None, low=0, low_open=True, by_setting="alpha_one_shot at 1 shot, alpha_five_shot at >= 5 shots, else "
        "alpha_other", help="Tsallis order; null = alpha_one_shot at 1 shot, alpha_five_shot at >= 5 shots, "
        "else alpha_other")
    alpha_one_shot: float = option(2.0, low=0, low_open=True, help="Tsallis order at 1 shot")
    alpha_five_shot: float = option(7.0, low=0, low_open=True, help="Tsallis order at >= 5 shots")
    alpha_other: float = option(5.0, low=0, low_open=True, help="Tsallis order at 2-4 shots")
    temperature: float = option(15.0, low=0, low_open=True, help="T of the logits -T/2 ||z - w_k||^2")
    loss_weights: tuple[float, ...] = option((1.0, 1.0, 1.0), low=0, length=3,
                                             help="[CE, marginal alpha-entropy, conditional alpha-entropy] weights")
    lr: float = option(1e-4, low=0, low_open=True, help="Adam learning rate")
    iterations: int = option(1000, low=0, help="Adam steps")

    def resolve(self, *, shots: int | None, balanced: bool | None) -> AlphaTIMSettings:
        if self.alpha is not None:
            return self
        if shots is None:
            raise shots_needed(self.method, ["alpha"])
        return self.replace(alpha=self.alpha_one_shot if shots == 1 else self.alpha_five_shot if shots >= 5
                            else self.alpha_other)


# ----------------------------------------------------------------------- BD-CSPN: methods/bdcspn.py
VARIANTS = ("benchmark", "paper")


@dataclass(frozen=True)
class BDCSPNSettings(MethodOptions):
    method: ClassVar[str] = "bdcspn"

    variant: str = option("benchmark", choices=VARIANTS,
                          help="benchmark = the realistic-imbalance benchmark's code, which made the peer numbers of "
                               "PUTM's Table 1: support + shifted queries pseudo-labelled by cosine, weights softmax "
                               "over classes of temperature*cos averaged over each class's rows, nearest rectified "
                               "prototype in Euclidean distance on the unshifted queries | paper = support rows by "
                               "true label + shifted queries, weights softmax over each class's members, shifted "
                               "queries classified by cosine")
    temperature: float = option(10.0, low=0, low_open=True,
                                help="epsilon of the rectification weights and of the output softmax")
    top_z: int | None = option(None, low=0, null="all pseudo-labelled queries",
                               help="pseudo-labelled queries kept per class: null = all, else the top_z most similar")


# ---------------------------------------------------------- LaplacianShot: methods/laplacianshot.py
AFFINITIES = ("directed", "symmetric")
ENERGIES = ("benchmark", "half")


@dataclass(frozen=True)
class LaplacianShotSettings(MethodOptions):
    method: ClassVar[str] = "laplacianshot"

    knn: int = option(3, low=1, help="neighbourhood size counting the query itself (benchmark: 3)")
    affinity: str = option("directed", choices=AFFINITIES,
                           help="directed = benchmark's W = A (A_ij = 1 for the knn-1 nearest others of i, not "
                                "symmetric); symmetric = (A + A^T)/2")
    lmd: float | None = option(None, low=0, by_setting="lmd_balanced on balanced tasks, else lmd_dirichlet",
                               help="Laplacian weight; null = by setting from lmd_dirichlet / lmd_balanced")
    lmd_dirichlet: tuple[float, ...] = option((1.0, 0.7), low=0, length=2,
                                              help="lmd on Dirichlet tasks: [1 shot, more shots]")
    lmd_balanced: tuple[float, ...] = option((0.7, 0.3), low=0, length=2,
                                             help="lmd on balanced tasks: [1 shot, more shots]")
    iterations: int = option(20, low=0, help="maximum number of bound updates")
    tol: float = option(1e-6, low=0, help="stop a task when |E_new - E_old| <= tol * |E_old|")
    energy: str = option("benchmark", choices=ENERGIES,
                         help="stopping energy: benchmark = sum y log y + sum y.a - lmd * sum w y.y; half = "
                              "pairwise term weighted by lmd/2 (the energy the update minimises for symmetric W)")
    proto_rect: bool | None = option(None, by_setting="true on balanced tasks, false on Dirichlet tasks",
                                     help="BD-CSPN (benchmark variant) rectified prototypes instead of the support means; "
                                          "null = on balanced tasks only (the benchmark's choice); true / false forces it")
    rect_temperature: float = option(10.0, low=0, low_open=True, help="epsilon of that rectification")

    def resolve(self, *, shots: int | None, balanced: bool | None) -> LaplacianShotSettings:
        changes: dict[str, object] = {}
        if self.lmd is None:
            if shots is None:
                raise shots_needed(self.method, ["lmd"])
            if balanced is None:
                raise ConfigError("laplacianshot: the protocol (balanced) is needed to choose lmd; set "
                                  "method.laplacianshot.lmd")
            table = self.lmd_balanced if balanced else self.lmd_dirichlet
            changes["lmd"] = table[0] if shots == 1 else table[1]
        if self.proto_rect is None:  # the benchmark's per-protocol choice: rectify on balanced tasks only
            changes["proto_rect"] = bool(balanced)
        return self.replace(**changes) if changes else self


# ---------------------------------------------------------------------------- iLPC: methods/ilpc.py
BALANCE_CHOICES = ("auto", "uniform", "none")


@dataclass(frozen=True)
class ILPCSettings(MethodOptions):
    method: ClassVar[str] = "ilpc"

    balance: str = option("auto", choices=BALANCE_CHOICES,
                          help="class balancing of the pseudo-labels: auto = uniform on balanced tasks, none on "
                               "Dirichlet tasks; uniform = Sinkhorn to Q/N per class minus those moved (iLPC's; "
                               "assumes a balanced query set); none = argmax of the propagated scores (PUTM's code). "
                               "With oracle_prior=true the marginal is the TRUE counts (a leak; results are marked)")
    alpha: float = option(0.8, low=0, high=1, high_open=True, why="so that I - alpha*W is invertible",
                          help="label propagation alpha of (I - alpha*W)^-1 Y")
    k: int = option(20, low=1, help="kNN neighbours of the graph")
    positive_affinity: bool = option(True, help="affinity [s]_+^gamma; false = the iLPC code's s^gamma, whose "
                                     "negative weights break tiny tasks (n <= k + 1; docs/methods/ilpc.md)")
    gamma: float = option(3.0, low=0, low_open=True, help="affinity = similarity^gamma")
    power: float = option(3.0, low=0, low_open=True, help="scores^power before Sinkhorn")
    sinkhorn_passes: int = option(1, low=1, help="power + Sinkhorn passes")
    sinkhorn_eps: float = option(1e-6, low=0, low_open=True, help="Sinkhorn stop tolerance on the row sums")
    sinkhorn_max_iters: int = option(1000, low=1, help="Sinkhorn iteration cap (all passes)")
    best_samples: int = option(3, low=1, help="queries moved per class per round")
    min_moved: int = option(5, low=1, help="stop a task when fewer queries would move")
    denoising_iterations: int = option(100, low=1, help="SGD steps of the cleaning classifier per round")
    lr: float = option(0.1, low=0, low_open=True, help="cleaning SGD learning rate")
    momentum: float = option(0.9, low=0, high=1, high_open=True, help="cleaning SGD momentum")
    weight_decay: float = option(5e-4, low=0, help="cleaning SGD weight decay (weights and bias)")
    beta: float = option(0.5, low=0, low_open=True, help="power transform sign(x)(|x| + 1e-6)^beta")


# ------------------------------------------------------------------ BAVARDAGE: methods/bavardage.py
@dataclass(frozen=True)
class BAVARDAGESettings(MethodOptions):
    method: ClassVar[str] = "bavardage"

    vb_temperature: float = option(40.0, low=0, low_open=True,
                                   help="T_vb = 1/sigma^2 of the isotropic Gaussians (mini-ImageNet/CIFAR-FS value)")
    clip: float = option(1.0, low=0, low_open=True, help="cap on the whitening scale lambda^-1/2")
    km_temperature: float = option(10.0, low=0, low_open=True, help="T_km of the soft k-means initialisation")
    km_iterations: int = option(5, low=1, help="soft k-means iterations")
    vb_iterations: int = option(5, low=0, help="variational-Bayes EM iterations")
    beta0: float = option(10.0, low=0, low_open=True, help="prior precision factor of the class means")
    dirichlet_prior: float = option(1.0, low=0, low_open=True,
                                    help="alpha_0 of the symmetric Dirichlet prior on the class weights: flat, "
                                         "protocol-independent (ours; the paper's code uses the sampling alpha: "
                                         "oracle_dirichlet_alpha)")
    oracle_dirichlet_alpha: float | None = option(
        None, low=0, low_open=True, null="off",
        help="ORACLE: the benchmark's sampling alpha as prior; setting it marks results oracle_prior=true")
    covariance_ridge: float = option(1e-6, low=0, help="added to the base within-class scatter before inversion")
    task_centring: bool = option(True, help="without base_features: centre on the mean of the task's own rows "
                                   "before L2 (ours); false = plain L2N (docs/methods/bavardage.md)")


# ------------------------------------------------------------------------ α-AM: methods/alpha_am.py
#: Which parameters Adam learns (the reference's ``--phi``): centroids, plus kernel scales G, edge weights W_b.
PHI_CHOICES = ("mus", "mus+G", "mus+Wb", "mus+G+Wb")


def by_shots(shots: int, one: float, five: float, other: float) -> float:
    """The reference's per-shot choice: ``one`` at 1 shot, ``five`` at ≥ 5 shots, ``other`` in between."""
    return one if shots == 1 else five if shots >= 5 else other


@dataclass(frozen=True)
class AlphaAMSettings(MethodOptions):
    method: ClassVar[str] = "alpha_am"

    alpha: float | None = option(
        None, low=0, high=1, high_open=True, by_setting="alpha_one_shot at 1 shot, alpha_five_shot at >= 5 shots, "
        "else alpha_other", why="so that I - alpha*W is invertible",
        help="label propagation alpha of (I - alpha*W)^-1 Y, also W_b's start; null = by shots")
    alpha_one_shot: float = option(0.8, low=0, high=1, high_open=True, help="propagation alpha at 1 shot")
    alpha_five_shot: float = option(0.9, low=0, high=1, high_open=True, help="propagation alpha at >= 5 shots")
    alpha_other: float = option(0.8, low=0, high=1, high_open=True, help="propagation alpha at 2-4 shots")
    k: int | None = option(None, low=1, by_setting="k_one_shot at 1 shot, k_five_shot at >= 5 shots, else k_other",
                           help="kNN neighbours per node; null = by shots")
    k_one_shot: int = option(20, low=1, help="kNN neighbours at 1 shot")
    k_five_shot: int = option(10, low=1, help="kNN neighbours at >= 5 shots")
    k_other: int = option(20, low=1, help="kNN neighbours at 2-4 shots")
    entropy_alpha: float | None = option(
        None, low=0, low_open=True, by_setting="entropy_alpha_one_shot at 1 shot, entropy_alpha_five_shot at >= 5 "
        "shots, else entropy_alpha_other",
        help="Tsallis order of the marginal and conditional entropies (1 = Shannon); null = by shots")
    entropy_alpha_one_shot: float = option(2.0, low=0, low_open=True, help="Tsallis order at 1 shot")
    entropy_alpha_five_shot: float = option(5.0, low=0, low_open=True, help="Tsallis order at >= 5 shots")
    entropy_alpha_other: float = option(1.0, low=0, low_open=True,
                                        help="Tsallis order at 2-4 shots (1 = Shannon, the limit of the yaml's 1.0)")
    temperature: float = option(15.0, low=0, low_open=True, help="scores = temperature * (I - alpha*W)^-1 Y")
    loss_weights: tuple[float, ...] = option((1.0, 1.0, 1.0), low=0, length=3,
                                             help="[CE, marginal alpha-entropy, conditional alpha-entropy] weights")
    lr: float = option(1e-4, low=0, low_open=True, help="Adam learning rate")
    iterations: int = option(1000, low=0, help="Adam steps")
    phi: str = option("mus+G+Wb", choices=PHI_CHOICES,
                      help="parameters learnt: centroids (mus), kernel scales (G), edge weights (Wb)")
    plc: bool = option(True, help="power, L2, centre, L2 preprocessing (the reference's --plc); false = L2 only")
    beta: float = option(0.5, low=0, low_open=True, help="power transform sign(x)(|x| + 1e-6)^beta (plc only)")
    integer_powers: bool = option(
        False, help="Tsallis powers of integral orders (2, 5) by multiplications, so that on the CPU a task's result "
        "does not depend on how many tasks share its chunk; false = torch.pow, the reference's")

    def resolve(self, *, shots: int | None, balanced: bool | None) -> AlphaAMSettings:
        missing = [name for name in ("alpha", "k", "entropy_alpha") if getattr(self, name) is None]
        if not missing:
            return self
        if shots is None:
            raise shots_needed(self.method, missing)
        chosen = {
            "alpha": by_shots(shots, self.alpha_one_shot, self.alpha_five_shot, self.alpha_other),
            "k": int(by_shots(shots, self.k_one_shot, self.k_five_shot, self.k_other)),
            "entropy_alpha": by_shots(shots, self.entropy_alpha_one_shot, self.entropy_alpha_five_shot,
                                      self.entropy_alpha_other),
        }
        return self.replace(**{name: chosen[name] for name in missing})


# ---------------------------------------------------------------------------- UNEM: methods/unem.py
#: The number of unrolled layers of the published models.
DEFAULT_LAYERS = 10
#: ``initial`` = the reference model's initial values (``gamma=1.0, t1=1.0, t2=1.0`` in ``U_Paddle_EMBT``).
PRESETS = ("mini_resnet18", "tiered_resnet18", "cub_resnet18", "mini_wideres", "tiered_wideres", "initial")
#: ``auto``: fitted on the validation classes of the evaluated checkpoint's data where ``evaluate.py`` has them
#: (:mod:`~lightning_putm.evaluation.unem_default`), else the untrained start (``initial``).
AUTO = "auto"
NORMALISATIONS = ("none", "l2")


@dataclass(frozen=True)
class UNEMSettings(MethodOptions):
    method: ClassVar[str] = "unem"

    learned: str = option(AUTO, choices=(AUTO, *PRESETS),
                          help="parameters when params_file is null: auto = fitted on the checkpoint's validation "
                               "classes (cached), else the untrained start; a dataset_backbone = the authors' "
                               "published values (nearest published shot count: 1, 5, 10, 20; far below the untrained start on "
                               "other features); initial = untrained t1=gamma=t2=1")
    params_file: str | None = option(None, null="use learned",
                                     help="learned parameters (overrides learned): a JSON from `python -m "
                                          "lightning_putm fit-unem` (fitted on your validation classes) or "
                                          "the authors' .pt; {shots} in the name becomes the number of shots")
    normalise: str = option("none", choices=NORMALISATIONS,
                            help="feature rows before UNEM: none = as given (the reference), l2 = unit norm")
    fit_tasks: int = option(1000, low=1, help="learned=auto: validation tasks the fit learns on per shot count (the "
                                              "reference: 1000; its time grows with them), as many again checked")


# ------------------------------------------ UNEM's parameter fit (fit-unem): methods/unem_fit.py
LOSSES = ("reference", "nll")


@dataclass(frozen=True)
class FitSettings:
    """The reference trainer's settings (``config/main_config.yaml`` ``U_TRAIN``, ``unroll_trainer.py``)."""

    layers: int = DEFAULT_LAYERS  # train_n_layers
    iterations: int = 100  # train_iter
    lr: float = 0.1  # train_lr (Adam)
    step_size: int = 50  # StepLR(step_size=50, gamma=0.5)
    step_gamma: float = 0.5
    initial: float = 1.0  # U_Paddle_EMBT(gamma=1.0, t1=1.0, t2=1.0)
    loss: str = "reference"  # CE on the output probabilities (reference) | nll
    normalise: str = "none"  # as UNEMSettings.normalise: the features the parameters are learned for

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.layers < 1 or self.iterations < 0 or not self.lr > 0:
            raise ValueError("layers >= 1, iterations >= 0 and lr > 0 are required")
