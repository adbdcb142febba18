"""The report of an evaluation: the console table, ``results.csv``, ``per_task.csv``, ``config.yaml``, figures
and W&B entries.

The figures reproduce the paper's views (Tian et al., ICCV 2023): accuracy against the Dirichlet α, the true
per-class query counts of one task against PUTM's estimate ``Σ_j π_f(k|j)``, and a t-SNE of one task's
prototypes before and after the CT-EM refinement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from lightning_putm.atomic import atomic_write_dict_csv, atomic_write_text
from lightning_putm.evaluation import keff_plot, plot_style, plots
from lightning_putm.evaluation.records import (QUERY_CLASSES_COLUMN, Provenance, Summary, summary_columns,
                                               uses_query_classes)
from lightning_putm.evaluation.runner import SettingResult
from lightning_putm.evaluation.settings import EvaluationSettings
from lightning_putm.features.files import FeatureSet
from lightning_putm.methods import build_method
from lightning_putm.metrics import task_accuracy
from lightning_putm.validators import UNIFORM, query_classes_label


def format_table(summaries: Sequence[Summary]) -> str:
    """A fixed-width text table: method, shot, (K_eff,) α, accuracy ± 95% CI, tasks, seconds, oracle prior; the K_eff
    column only when a result has one."""
    keff = uses_query_classes(summaries)
    header = ["method", "shots", *(["K_eff"] if keff else []), "alpha", "accuracy (%)", "tasks", "time (s)",
              "oracle_prior"]
    body = [
        [s.method, str(s.shots), *([s.query_classes_label] if keff else []), s.alpha_label,
         f"{s.accuracy:.2f} ± {s.ci95:.2f}", str(s.tasks), f"{s.seconds:.1f}", "true" if s.oracle_prior else "false"]
        for s in summaries
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(b) for b in body)])


def precision_note(summaries: Sequence[Summary]) -> str | None:
    """One line under the table when a method computed in reduced precision (PUTM's ``precision=auto`` picks bf16
    where the hardware multiplies bf16 natively): its last digits then differ from an fp32 run and between machines,
    so a user comparing with a published table knows why and how to get fp32."""
    reduced = sorted({(s.method, s.precision) for s in summaries if s.precision in ("bf16", "tf32")})
    if not reduced:
        return None
    ran = ", ".join(f"{method} in {precision}" for method, precision in reduced)
    fixes = " ".join(f"method.{method}.precision=fp32" for method in sorted({m for m, _ in reduced}))
    return (f"precision: {ran}; accuracies can differ by about a tenth of a point from an fp32 run and between "
            f"machines ({fixes} for fp32; the default precision=auto picks bf16 where the hardware multiplies it "
            "natively)")


def wrote_line(paths: dict[str, Path], folder: Path) -> str:
    """What an evaluation wrote, in one short line: the folder once, then file names; figures counted, not listed
    (each is a PNG and a PDF), e.g. ``wrote results to out/ (results.csv, per_task.csv, 3 figures in plots/)``."""
    folder = Path(folder)

    def inside(path: Path) -> str:
        return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)

    names, figures = [], set()
    for key, path in paths.items():
        path = Path(path)
        if key.startswith("plot_"):
            figures.add(path.with_suffix(""))
        else:
            names.append(inside(path))
    if figures:
        where = sorted({inside(f.parent) for f in figures})
        names.append(f"{len(figures)} figure{'s' if len(figures) != 1 else ''} in {', '.join(w + '/' for w in where)}")
    return f"wrote results to {folder}/ ({', '.join(names)})"


#: The per-task column of the classes drawn present in a task's query set (with K_eff; dataset class ids, in the
#: order of ``class_ids``); a present class can still get no query when its count is drawn 0 (Dirichlet, uniform).
PRESENT_CLASSES_COLUMN = "present_classes"


def per_task_rows(results: list[SettingResult]) -> list[dict[str, Any]]:
    """One row per (method, shot, K_eff, α, task) with the task's query counts and imbalance; when a result has a
    K_eff, every row also gets its ``query_classes`` and ``present_classes`` (a default run's rows are as before)."""
    keff = uses_query_classes(results)
    rows = []
    for result in results:
        bank = result.bank
        imbalance = bank.imbalance()
        for t in range(len(bank)):
            counts = bank.query_counts[t].tolist()
            class_ids = bank.class_ids[t].tolist()
            row: dict[str, Any] = {"method": result.method, "shots": result.shots}
            if keff:
                row[QUERY_CLASSES_COLUMN] = query_classes_label(result.query_classes)
            row.update({
                "alpha": result.alpha_label,
                "task": t,
                "accuracy": f"{float(result.accuracies[t]):.6f}",
                "oracle_prior": "true" if result.oracle_prior else "false",
                "query_counts": ";".join(str(c) for c in counts),
                "class_ids": ";".join(str(c) for c in class_ids),
            })
            if keff:
                present = bank.present[t].tolist()
                row[PRESENT_CLASSES_COLUMN] = ";".join(str(c) for c, p in zip(class_ids, present) if p)
            row.update({
                "max_min_ratio": f"{float(imbalance['max_min_ratio'][t]):.4f}",
                "normalised_entropy": f"{float(imbalance['normalised_entropy'][t]):.6f}",
            })
            rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> Path:
    """Write rows atomically (``csv.DictWriter`` defaults; the columns of the first row unless given)."""
    return atomic_write_dict_csv(path, columns or (list(rows[0].keys()) if rows else []), rows)


def write_report(results: Sequence[SettingResult], output_dir: Path, config_yaml: str | None = None,
                 provenance: Provenance | None = None) -> dict[str, Path]:
    """``results.csv`` (summary, with provenance columns), ``per_task.csv`` and ``config.yaml`` in ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    summaries = [r.summary() for r in results]
    columns = summary_columns(summaries, provenance is not None)
    keff = QUERY_CLASSES_COLUMN in columns
    paths = {
        "results": write_csv(output_dir / "results.csv", [s.csv_row(provenance, keff) for s in summaries], columns),
        "per_task": write_csv(output_dir / "per_task.csv", per_task_rows(results)),
    }
    if config_yaml is not None:
        paths["config"] = atomic_write_text(output_dir / "config.yaml", config_yaml)
    return paths


def putm_case_study(results: Sequence[SettingResult], feature_set: FeatureSet, settings: EvaluationSettings,
                    task: int = 0) -> dict[str, Any] | None:
    """Re-solve one task with PUTM alone and return what the case-study figures need.

    The task is ``task`` of the first shot's first imbalanced bank (α or K_eff; balanced if none). A task's PUTM
    result is bit-identical alone or in a batch, so the estimate shown is exactly the one that was evaluated
    (``matches_evaluation`` records the check).
    """
    putm = [r for r in results if r.method == "putm"]
    if not putm:
        return None
    first_shot = putm[0].shots
    candidates = [r for r in putm if r.shots == first_shot]
    chosen = next((r for r in candidates if not r.bank.balanced), candidates[0])
    bank = chosen.bank
    t = max(0, min(int(task), len(bank) - 1))
    gathered = bank.gather(feature_set.features, settings.device)
    single = gathered.batch.slice(t, t + 1)
    method = build_method("putm", settings.method_params.get("putm", {}), shots=chosen.shots,
                          balanced=chosen.bank.balanced, memory_budget_mb=settings.memory_budget_mb)
    probabilities = method.predict(single)
    accuracy = float(task_accuracy(probabilities, gathered.query_labels[t:t + 1])[0])
    state = method.last_state
    rows = state["rows"][0]
    query_labels = gathered.query_labels[t]
    if "query_order" in state:  # rows are in PUTM's canonical query order
        query_labels = query_labels[state["query_order"][0]]
    support = single.num_support
    return {
        "shots": chosen.shots,
        "alpha": chosen.alpha_label,
        "query_classes": chosen.query_classes,
        "task": t,
        "class_names": [feature_set.class_names[c] for c in bank.class_ids[t].tolist()],
        "true_counts": bank.query_counts[t].tolist(),
        "estimated_counts": probabilities[0].sum(0).cpu().tolist(),
        "accuracy": accuracy,
        "matches_evaluation": abs(accuracy - float(chosen.accuracies[t])) < 1e-12,
        "queries": rows[support:].cpu(),
        "query_labels": query_labels.cpu(),
        "support": rows[:support].cpu(),
        "support_labels": single.support_labels[0].cpu(),
        "initial_prototypes": state["initial_prototypes"][0].cpu(),
        "refined_prototypes": state["prototypes"][0].cpu(),
    }


def make_plots(results: Sequence[SettingResult], feature_set: FeatureSet, settings: EvaluationSettings, folder: Path, task: int = 0,
               log: Callable[[str], None] = print) -> dict[str, Path]:
    """Write the figures into ``folder`` (each as PNG and PDF, see ``plot_style.DEFAULT_FORMATS``); returns
    ``{name: PNG path, name_pdf: PDF path}``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dataset = plot_style.dataset_label(feature_set.metadata.get("source"))  # every figure names its features
    summaries = [r.summary() for r in results]
    figures = {}
    for keff in dict.fromkeys(s.query_classes for s in summaries):  # one accuracy-vs-α figure per K_eff
        name = "accuracy_vs_alpha" if keff is None else f"accuracy_vs_alpha_keff{keff}"
        figures[name] = plots.plot_accuracy_vs_alpha(
            [s for s in summaries if s.query_classes == keff], folder / f"{name}.png", dataset=dataset,
            ways=settings.ways, queries=settings.queries, query_classes=keff)
    for alpha in dict.fromkeys(s.alpha for s in summaries):  # several K_eff at one α: accuracy against K_eff
        rows = [s for s in summaries if s.alpha == alpha]
        if len({s.query_classes for s in rows}) > 1:
            name = f"accuracy_vs_keff_alpha_{rows[0].alpha_label}"
            figures[name] = keff_plot.plot_accuracy_vs_query_classes(
                rows, folder / f"{name}.png", dataset=dataset, ways=settings.ways, queries=settings.queries)
    case = putm_case_study(results, feature_set, settings, task)
    if case is not None:
        keff = "" if case["query_classes"] is None else f" K_eff={case['query_classes']}"
        where = f"{case['shots']}-shot{keff} alpha={case['alpha']} task {case['task']}"
        typeset = plot_style.task_caption(case["shots"], case["alpha"], case["task"], dataset, settings.ways,
                                          settings.queries, case["query_classes"])
        figures["putm_query_counts"] = plots.plot_query_counts(
            case["true_counts"], case["estimated_counts"], folder / "putm_query_counts.png",
            class_names=case["class_names"], title=f"PUTM class-count estimate\n{typeset}")
        figures["putm_tsne"] = plots.plot_prototype_tsne(
            case["queries"], case["query_labels"], case["initial_prototypes"], case["refined_prototypes"],
            folder / "putm_tsne.png", support=case["support"], support_labels=case["support_labels"],
            seed=settings.seed, title=f"PUTM prototypes (queries coloured by their true class)\n{typeset}",
            class_names=case["class_names"])
        estimate = ", ".join(f"{e:.1f}" for e in case["estimated_counts"])
        log(f"PUTM case study ({where}): true query counts {case['true_counts']}, estimated [{estimate}]")
    # every file of each figure (the PDF next to the PNG), so a re-run's stale-file cleanup keeps them
    for name, png in list(figures.items()):
        for extra in plot_style.figure_paths(png)[1:]:
            figures[f"{name}_{extra.suffix.lstrip('.')}"] = extra
    return figures


# --------------------------------------------------------------------------------------------- loggers
def _is_wandb(logger: Any) -> bool:
    return type(logger).__name__ == "WandbLogger"


def log_to_loggers(loggers: Iterable[Any], summaries: Sequence[Summary], figures: dict[str, Path], prefix: str) -> None:
    """W&B extras (table, accuracy-vs-α line plots, images); scalar metrics go through ``LightningModule.log``."""
    for logger in loggers:
        if _is_wandb(logger):
            log_to_wandb(logger.experiment, summaries, figures, prefix)


#: An evaluation's result files that go to its W&B run as one artifact (:func:`log_results_artifact`).
RESULT_FILES = ("results.csv", "per_task.csv")
#: The W&B artifact type of those files.
RESULTS_ARTIFACT_TYPE = "evaluation-results"


def log_results_artifact(loggers: Iterable[Any], folder: Path) -> None:
    """``results.csv`` and ``per_task.csv`` of a finished evaluation in ``folder`` as a W&B artifact of its run,
    named ``results-<run id>``: the run's own files, downloadable, and a new version of the same artifact when a
    re-run into the same folder (the same W&B run) changes them."""
    files = [Path(folder) / name for name in RESULT_FILES if (Path(folder) / name).is_file()]
    for logger in loggers:
        if _is_wandb(logger) and files:
            import wandb

            run = logger.experiment
            artifact = wandb.Artifact(f"results-{run.id}", type=RESULTS_ARTIFACT_TYPE,
                                      description=f"results.csv and per_task.csv of the evaluation in {folder}")
            for path in files:
                artifact.add_file(str(path), name=path.name)
            run.log_artifact(artifact)


#: The baseline every run's ``worst_gain_over_<baseline>`` metric compares with (when the run includes it).
BASELINE = "simpleshot"


def run_summary_metrics(summaries: Sequence[Summary], prefix: str) -> dict[str, float]:
    """``<prefix>/<method>/acc``: each method's mean accuracy over this run's own (shot, K_eff, α) settings.

    Every run logs it whatever its settings, so a W&B sweep can optimise one metric name over grid points that
    differ in shots or α (a run with one shot and one α: that setting's accuracy).
    """
    by_method: dict[str, list[float]] = {}
    for summary in summaries:
        by_method.setdefault(summary.method, []).append(summary.accuracy)
    metrics = {f"{prefix}/{method}/acc": round(sum(values) / len(values), 4) for method, values in by_method.items()}
    if BASELINE in by_method:  # "does it ever lose to nearest class mean?" as one number a sweep can select on
        for method in by_method:
            if method != BASELINE:
                metrics[f"{prefix}/{method}/worst_gain_over_{BASELINE}"] = round(
                    worst_gain(summaries, method, BASELINE), 4)
    return metrics


def worst_gain(summaries: Sequence[Summary], method: str, other: str) -> float:
    """``min`` over the (shot, K_eff, α) settings both methods ran of ``acc(method) − acc(other)``, in points.

    Positive: ``method`` beats ``other`` in every setting; it is the number to maximise when selecting a setting
    that must never lose to a baseline. Raises ``ValueError`` when the two share no setting.
    """
    accuracy = {(s.method, s.shots, s.query_classes_label, s.alpha_label): s.accuracy for s in summaries}
    gains = [accuracy[(method, *setting)] - value for (name, *setting), value in accuracy.items()
             if name == other and (method, *setting) in accuracy]
    if not gains:
        raise ValueError(f"{method} and {other} share no (shot, alpha) setting")
    return min(gains)


def log_to_wandb(run: Any, summaries: Sequence[Summary], figures: dict[str, Path], prefix: str) -> None:
    import wandb

    columns = summary_columns(summaries)
    rows = [s.csv_row(query_classes=QUERY_CLASSES_COLUMN in columns) for s in summaries]
    payload: dict[str, Any] = {
        f"{prefix}/results": wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows]),
        **run_summary_metrics(summaries, prefix),
    }
    for shots, keff in dict.fromkeys((s.shots, s.query_classes) for s in sorted(summaries, key=lambda s: s.shots)):
        numeric = [s for s in summaries
                   if s.shots == shots and s.query_classes == keff and s.alpha not in (None, UNIFORM)]
        alphas = sorted({s.alpha for s in numeric})
        methods = list(dict.fromkeys(s.method for s in numeric))
        if not alphas:
            continue
        accuracy = {(s.method, s.alpha): round(s.accuracy, 4) for s in numeric}
        where = f"{shots}shot" if keff is None else f"{shots}shot_keff{keff}"
        present = "" if keff is None else f", {keff} classes in the query set"
        payload[f"{prefix}/accuracy_vs_alpha/{where}"] = wandb.plot.line_series(
            xs=alphas, ys=[[accuracy.get((m, a), float("nan")) for a in alphas] for m in methods], keys=methods,
            title=f"{shots}-shot accuracy (%) vs Dirichlet alpha{present}", xname="alpha")
    for name, path in figures.items():
        if Path(path).suffix.lower() == ".png":  # W&B shows images; the PDFs stay in the run folder
            payload[f"{prefix}/plots/{name}"] = wandb.Image(str(path))
    run.log(payload)
