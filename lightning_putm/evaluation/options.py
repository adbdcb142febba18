"""The keys of ``conf/evaluate.yaml``, declared once (:mod:`lightning_putm.job_options`): default, the type
``--help`` shows and the help; the yaml is written from these fields by ``tools/sync_options.py``.
:func:`~lightning_putm.evaluation.settings.settings_from_config` checks the values a run is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_putm.job_options import MEMORY_BUDGET, job_option, nested
from lightning_putm.loggers import LOGGERS

#: The splits of a dataset a checkpoint's features may come from.
SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class EvaluateWandbOptions:
    project: str = job_option("lightning-putm", type="str", help="W&B project of the runs")
    entity: str | None = job_option(None, type="str", help="W&B entity (team or user); null = your default entity")
    name: str | None = job_option(None, type="str", help="null = the run folder's name (<date>_<time>-<name>), "
                                                         "unique")
    group: str | None = job_option(None, type="str", help="null = the checkpoint's run name "
                                   "(<dataset>-<backbone>-<run>-<stage>) or timm-<model>, so a checkpoint's "
                                   "evaluations sit together in W&B; none for a feature file")
    dir: str | None = job_option(None, type="path", help="where W&B keeps its run folders: <dir>/wandb; null = "
                                 "$WANDB_DIR/wandb, else ./wandb")
    mode: str | None = job_option(None, type="str", help="null = $WANDB_MODE, else online with credentials / "
                                  "offline without; online|offline|disabled")


@dataclass(frozen=True)
class EvaluateTrainerOptions:
    accelerator: str = job_option("auto", type="str", help="auto, cpu, gpu, ...")
    devices: int | str = job_option(1, type="int|auto", help="devices the tasks are shared over")
    strategy: str = job_option("auto", type="str", help="auto, ddp, ...")
    precision: str = job_option("32-true", type="str", help="Lightning precision of the Trainer")


@dataclass(frozen=True)
class EvaluateOptions:
    checkpoint: str | None = job_option(
        None, type="path", help="backbone checkpoint from train_backbone.py: evaluate on features of data's split; "
        "or timm:<model name> (e.g. timm:resnet50.a1_in1k): a pretrained timm model (docs/timm.md)")
    pretrained_file: str | None = job_option(
        None, type="path", help="with checkpoint=timm:<name>: its weights file (.safetensors/.pth; no network); null "
        "= timm's hub cache (downloaded there once when online)")
    data: str = job_option(
        "digits", type="name", help="conf/data/<name>.yaml (data.root=... etc.); with checkpoint: default = the data "
        "the checkpoint records (dataset, root, options, image size, normalisation); another data= is refused")
    force_data: bool = job_option(False, type="bool", help="true = evaluate a checkpoint on another dataset than "
                                  "the one it records (on purpose)")
    split: str = job_option("test", type="str", choices=SPLITS, help="with checkpoint: the split whose features are "
                            "evaluated (novel classes: test)")
    backbone: str = job_option("auto", type="name|auto", help="with checkpoint: the backbone it must hold (auto = "
                               "whatever it holds)")
    feature_cache_dir: str = job_option("outputs/feature_cache", type="path", help="extracted features, keyed by "
                                        "checkpoint content hash, data, split, transform")
    refresh_features: bool = job_option(False, type="bool", help="true = extract again even when the cache matches")
    features: str = job_option(
        "auto", type="path|auto", help="feature file (.pt from lightning-putm; .plk/.pkl pickle needs "
        "allow_pickle=true), `demo`, or auto (= the checkpoint's features when checkpoint is set, else the demo)")
    allow_pickle: bool = job_option(False, type="bool", help="pickle files can run code when loaded: only enable "
                                    "for files you trust")
    methods: list[str] = job_option(["putm", "simpleshot", "ptmap"], type="list", help="any registered method "
                                    "(--help lists each one's options under method.<name>)")
    plugins: list[str] = job_option(
        [], type="list", help="your own modules to import first (module names or .py paths): a class there with "
        "@register_method(\"name\") is a method like the built-ins (docs/development.md#adding-a-method)")
    base_features: str | None = job_option(
        "auto", type="path|auto", help="base-class features for CL2N (simpleshot, bdcspn, laplacianshot subtract "
        "their mean; bavardage also whitens with their scatter): a feature file from the same backbone, or with "
        "checkpoint= `split:train` (extracted and cached); auto = split:train with a checkpoint, else null; null = "
        "plain L2 normalisation (L2N; bavardage centres each task on its own rows) and the run prints a notice")
    oracle_prior: bool = job_option(
        False, type="bool", help="true = methods using a class marginal (ptmap, ilpc, bavardage) get the TRUE query "
        "counts: unfair, and marked oracle_prior=true in the table and both CSVs")
    ways: int = job_option(5, type="int", help="classes per task (N)", low=2)
    shots: list[int] = job_option([1, 5], type="list", element="int", low=1, nonempty=True,
                                  help="labelled images per class; each shot count is a setting of its own")
    queries: int | None = job_option(None, type="int", help="total queries per task; null = 15 * ways",
                                        low=1)
    alphas: list[Any] = job_option(
        [2, "balanced"], type="list", help="Dirichlet concentrations (> 0) and/or `balanced`, `uniform` (queries "
        "drawn uniformly from the pooled images of the classes in the query set: PADDLE's sampling)")
    query_classes: Any = job_option(
        None, type="int|list", help="K_eff: classes of the N ways present in each query set (PADDLE's protocol, e.g. "
        "ways=20 query_classes=5 alphas=[uniform]; docs/protocol.md); null = all N; a list [null,1,3,5] runs each")
    tasks: int | str = job_option("auto", type="int|auto", help="tasks per (shot, K_eff, alpha); auto = 100 on the "
                                  "demo data, 1000 otherwise", low=1)
    seed: int = job_option(0, type="int", help="seed of the episode banks", low=0)
    device: str = job_option("auto", type="str", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    memory_budget_mb: float | str = job_option(
        2048, **MEMORY_BUDGET, help="working memory per method call (MB); larger task batches are chunked to fit. "
        "On CUDA it is a cap: chunks also fit in 80% of the free GPU memory, and a chunk that still runs out of "
        "memory is halved and retried (one notice). auto = free GPU memory alone (2048 on CPU)")
    name: str | None = job_option(
        None, type="str", help="run name (folder and W&B run); null = <dataset>-<backbone>-<run>-<stage> of a "
        "checkpoint from train_backbone.py (+ -last for last.ckpt), else the feature file's name")
    output_dir: str = job_option(
        "auto", type="path|auto", help="auto = outputs/evaluate/<date>/<time>-<name>/ (+ outputs/evaluate/latest); "
        "a folder you name is reused and the results of this run replace its previous results whole")
    progress: bool = job_option(True, type="bool", help="show progress bars")
    verbose: bool = job_option(False, type="bool", help="true = print the whole effective config (it is always "
                               "saved as config.yaml in the run folder)")
    logger: str = job_option("auto", type="str", choices=tuple(LOGGERS), help=f"{' | '.join(LOGGERS)}; auto = wandb "
                             "when installed (lightning_putm/loggers.py)")
    wandb: EvaluateWandbOptions = nested(EvaluateWandbOptions)
    plots: bool = job_option(True, type="bool", help="accuracy vs alpha, PUTM class-count estimate and prototype "
                             "t-SNE (PNGs in output_dir/plots)")
    plot_task: int = job_option(0, type="int", help="task shown in the PUTM case-study plots (first shot, first "
                                "imbalanced alpha)", low=0)
    trainer: EvaluateTrainerOptions = nested(EvaluateTrainerOptions, checked=False, help="pytorch_lightning.Trainer "
                                             "options (trainer.devices=2 trainer.strategy=ddp shards the tasks)")
    debug: bool = job_option(False, type="bool", help="show full tracebacks instead of one-line errors")
    method: dict[str, Any] = job_option({}, type="mapping", help="filled from conf/method/<name>.yaml; override "
                                        "e.g. method.putm.rho=0.7")
