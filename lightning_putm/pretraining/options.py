"""The keys of ``conf/train_backbone.yaml``, declared once (:mod:`lightning_putm.job_options`): default, the type
``--help`` shows and the help; the yaml is written from these fields by ``tools/sync_options.py``.
:mod:`lightning_putm.pretraining.settings` checks the values a run is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_putm.job_options import job_option, nested
from lightning_putm.loggers import LOGGERS
from lightning_putm.pretraining.choices import NCM_NORMALISATIONS, SCHEDULERS, STAGES


@dataclass(frozen=True)
class HeadOptions:
    scale: float | str = job_option("auto", type="float|auto", low=0, low_open=True,
                                    help="cosine classifier scale; auto = 2 up to 200 classes, else 10 (S2M2)")
    class_gain: bool = job_option(True, type="bool", help="learnable per-class norm of the classifier rows (weight "
                                  "normalisation)")


@dataclass(frozen=True)
class LoaderOptions:
    num_workers: int | str = job_option("auto", type="int|auto", help="auto = data.num_workers; on CUDA, for "
                                        "image-file datasets, at least min(8, CPU cores / GPUs)")
    pin_memory: bool | str = job_option("auto", type="bool|auto", help="auto = true on CUDA (page-locked batches "
                                        "copy to the GPU asynchronously), else false")
    persistent_workers: bool | str = job_option("auto", type="bool|auto", help="auto = true when there are workers "
                                                "(kept alive from one epoch to the next)")
    prefetch_factor: int | str = job_option("auto", type="int|auto", help="batches each worker loads ahead; auto = "
                                            "4 on CUDA, else PyTorch's default (2)")


@dataclass(frozen=True)
class ValEpisodeOptions:
    ways: int = job_option(5, type="int", low=1, help="classes per validation task")
    shots: int = job_option(1, type="int", low=1, help="labelled images per class")
    queries: int = job_option(75, type="int", low=1, help="queries per task")
    alpha: Any = job_option("balanced", type="float|balanced", help="balanced or a Dirichlet alpha > 0")
    tasks: int = job_option(500, type="int", low=1, help="tasks per validation epoch (the best checkpoint's "
                            "accuracy)")
    seed: int = job_option(0, type="int", help="seed of the episode bank", low=0)


@dataclass(frozen=True)
class TestEpisodeOptions:
    ways: int = job_option(5, type="int", low=1, help="classes per test task")
    shots: int = job_option(1, type="int", low=1, help="labelled images per class")
    queries: int = job_option(75, type="int", low=1, help="queries per task")
    alpha: Any = job_option("balanced", type="float|balanced", help="balanced or a Dirichlet alpha > 0")
    tasks: int = job_option(1000, type="int", low=1, help="tasks of the final test (run_test=true)")
    seed: int = job_option(0, type="int", help="seed of the episode bank", low=0)


@dataclass(frozen=True)
class FewShotEvalOptions:
    every_n_epochs: int | None = job_option(None, type="int", low=1, help="null = off; k = after every k-th "
                                            "validation epoch (logged as val_fewshot/...)")
    methods: list[str] = job_option(["simpleshot"], type="list", help="sized to cost less than the epoch it "
                                    "follows (docs/pretraining.md); PUTM costs far more per task: "
                                    "methods=[putm,simpleshot] with overrides=[method.putm.preset=fast]")
    shots: list[int] = job_option([1], type="list", help="labelled images per class of the checked tasks")
    alphas: list[Any] = job_option([2, "balanced"], type="list", help="Dirichlet alphas and/or balanced of the "
                                   "checked tasks")
    tasks: int = job_option(500, type="int", low=1, help="ways, queries and seed come from val_episodes")
    base_features: str | None = job_option(
        "split:train", type="str", help="CL2N's base-class mean (simpleshot, bdcspn, laplacianshot, bavardage): "
        "split:train = the train split's features with the checked weights, extracted at each check (only when such "
        "a method runs) | null = plain L2 normalisation (a notice says so)")
    overrides: list[str] = job_option([], type="list", help="more evaluate.py settings, e.g. "
                                      "[method.putm.em_steps=20]")


@dataclass(frozen=True)
class TrainWandbOptions:
    project: str = job_option("lightning-putm", type="str", help="W&B project of the runs")
    entity: str | None = job_option(None, type="str", help="W&B entity (team or user); null = your default entity")
    name: str | None = job_option(None, type="str", help="null = <dataset>-<backbone>-<run>-<stage>; the stages of "
                                  "one run share a W&B group")
    group: str | None = job_option(None, type="str", help="null = <dataset>-<backbone>-<run>")
    dir: str | None = job_option(None, type="path", help="W&B run folders go to <dir>/wandb; null = "
                                 "$WANDB_DIR/wandb, else ./wandb")
    mode: str | None = job_option(None, type="str", help="null = $WANDB_MODE (set offline to log without a key); "
                                  "online | offline | disabled")


@dataclass(frozen=True)
class TrainTrainerOptions:
    accelerator: str = job_option("auto", type="str", help="auto, cpu, gpu, ...")
    devices: int | str = job_option("auto", type="int|auto", help="auto = every device of the accelerator")
    strategy: str = job_option("auto", type="str", help="auto, ddp, ...")
    precision: str = job_option("32-true", type="str", help="on a GPU use bf16-mixed (faster on Ampere or newer: "
                                "A100, H100, ...); 16-mixed on older GPUs; 32-true keeps CPU results exact")
    max_epochs: int | None = job_option(None, type="int", help="null = the recipe's epochs for the stage "
                                        "(data.epochs.<stage>)")
    deterministic: bool = job_option(False, type="bool", help="Lightning's deterministic algorithms")
    log_every_n_steps: int = job_option(10, type="int", help="training steps between logged losses")
    enable_model_summary: bool = job_option(False, type="bool", help="true = Lightning's layer table at the start "
                                            "of every stage")


@dataclass(frozen=True)
class TrainBackboneOptions:
    data: str = job_option("digits", type="name", help="conf/data/<name>.yaml (dataset + its original recipe); its "
                           "keys become data.* (data.root=...)")
    backbone: str = job_option("auto", type="name|auto", help="conf/backbone/<name>.yaml: wrn28_10, resnet12, "
                               "resnet18, conv4; auto = the recipe's (data.backbone)")
    stages: Any = job_option("auto", type="list|auto", element="str", choices=STAGES, nonempty=True,
                             help=f"run in order ({' | '.join(STAGES)}); each "
                             "later stage starts from the previous stage's best; auto = the dataset's recipe "
                             "(data.stages: rotation, s2m2r; Omniglot: classifier)")
    init_from: str | None = job_option(None, type="path", help="checkpoint to start the first stage from (e.g. "
                                       "stages=[s2m2r] init_from=.../rotation/best.ckpt)")
    resume: bool = job_option(False, type="bool", help="true: continue every stage from its last.ckpt where one "
                              "exists (finished stages are skipped) and its W&B run (same id)")
    checkpoint_dir: str = job_option("checkpoints", type="path", help="<checkpoint_dir>/<dataset>/<backbone>/<run>/"
                                     "<stage>/{last,best}.ckpt (+ config.yaml)")
    run: str = job_option("auto", type="name|auto", help="auto = a new run folder <date>_<time> (and "
                          "<dataset>/<backbone>/latest points at it), so no run replaces another's checkpoints; a "
                          "name reuses that folder; resume=true continues latest")
    seed: int = job_option(0, type="int", help="seed of the weights' initialisation and the batches", low=0)
    lr: float = job_option(0.001, type="float", low=0, low_open=True, help="Adam (S2M2)")
    weight_decay: float = job_option(0.0, type="float", low=0, help="Adam's weight decay")
    scheduler: str = job_option("none", type="str", choices=SCHEDULERS, help="none (S2M2: constant lr) | cosine "
                                "(decay to 0 over the stage, stepped per batch)")
    mixup_alpha: float = job_option(2.0, type="float", low=0, low_open=True,
                                    help="s2m2r: lambda ~ Beta(alpha, alpha)")
    mix_layers: list[int] = job_option([0, 1, 2, 3], type="list", element="int", nonempty=True,
                                       help="s2m2r mix points: 0 = input, i = after block i")
    head: HeadOptions = nested(HeadOptions)
    ncm: str = job_option("none", type="str", choices=NCM_NORMALISATIONS, help="features before nearest class mean "
                          "in val/test: none (Euclidean) | l2")
    channels_last: bool | str = job_option(
        "auto", type="bool|auto", help="NHWC memory format for the backbone's weights and input images (faster "
        "convolutions on GPU tensor cores): auto = on when training on CUDA | true | false")
    compile: bool | str = job_option(
        False, type="bool|str", help="true = torch.compile the backbone's stem, blocks and neck (manifold mixup stays "
        "eager); slow first steps, then faster on a GPU | false | a torch.compile backend name (eager, ...)")
    loader: LoaderOptions = nested(LoaderOptions, help="pretraining DataLoaders; auto = chosen for the device the "
                                   "Trainer trains on")
    val_episodes: ValEpisodeOptions = nested(ValEpisodeOptions, help="few-shot validation tasks (the best "
                                             "checkpoint is the one with the best accuracy on them)")
    test_episodes: TestEpisodeOptions = nested(TestEpisodeOptions, help="few-shot test tasks of run_test")
    run_test: bool = job_option(True, type="bool", help="after the last stage: few-shot accuracy of its best "
                                "checkpoint on the test split")
    fewshot_eval: FewShotEvalOptions = nested(FewShotEvalOptions, help="PUTM and peers on validation episodes "
                                              "during pretraining (FewShotEvaluationCallback)")
    logger: str = job_option("csv", type="str", choices=tuple(LOGGERS), help=f"{' | '.join(LOGGERS)}; auto = wandb "
                             "when installed")
    log_dir: str = job_option("outputs/train_backbone", type="path", help="where the csv logger writes its "
                              "metrics")
    wandb: TrainWandbOptions = nested(TrainWandbOptions)
    trainer: TrainTrainerOptions = nested(TrainTrainerOptions, checked=False, help="passed to "
                                          "pytorch_lightning.Trainer; any Trainer argument works as "
                                          "trainer.<name>=value")
    verbose: bool = job_option(False, type="bool", help="true = print the whole effective config (always saved as "
                               "<run folder>/config.yaml)")
    debug: bool = job_option(False, type="bool", help="full tracebacks instead of one-line errors")


@dataclass(frozen=True)
class DataGroupOptions:
    """The keys every ``conf/data/<name>.yaml`` shares whose default (``null``, ``{}``) does not show their type;
    their meaning and defaults stay in each dataset's yaml (a dataset's recipe, not a job option)."""

    root: str | None = job_option(None, type="path")
    normalize: Any = job_option(None, type="mapping", help="")
    options: dict[str, Any] = job_option({}, type="mapping")
