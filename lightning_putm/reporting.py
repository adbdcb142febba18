"""Turning evaluation results into figures and logger entries (W&B table, line plots, images).

The figures reproduce the paper's views (Tian et al., ICCV 2023): accuracy against the Dirichlet α, the true
per-class query counts of one task against PUTM's estimate ``Σ_j π_f(k|j)``, and a t-SNE of one task's
prototypes before and after the CT-EM refinement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from lightning_putm.features import FeatureSet

SUMMARY_COLUMNS = ["method", "shots", "alpha", "accuracy", "ci95", "tasks", "seconds", "oracle_prior"]


def summary_rows(results: Sequence[Any]) -> list[dict[str, Any]]:
    """One summary dict per (method, shot, α) result (the rows of ``results.csv``)."""
    return [r.summary() for r in results]


# --------------------------------------------------------------------------------------------- PUTM case study
def putm_case_study(results: Sequence[Any], feature_set: FeatureSet, settings: Any, task: int = 0) -> dict[str, Any] | None:
    """Re-solve one task with PUTM alone and return what the case-study figures need.

    The task is ``task`` of the first shot's first imbalanced α (balanced if none). A task's PUTM result is
    bit-identical alone or in a batch, so the estimate shown is exactly the one that was evaluated
    (``matches_evaluation`` records the check).
    """
    from lightning_putm.methods import build_method
    from lightning_putm.metrics import task_accuracy

    putm = [r for r in results if r.method == "putm"]
    if not putm:
        return None
    first_shot = putm[0].shots
    candidates = [r for r in putm if r.shots == first_shot]
    chosen = next((r for r in candidates if r.alpha is not None), candidates[0])
    bank = chosen.bank
    t = max(0, min(int(task), len(bank) - 1))
    gathered = bank.gather(feature_set.features, settings.device)
    single = gathered.batch.slice(t, t + 1)
    method = build_method("putm", settings.method_params.get("putm", {}), shots=chosen.shots,
                          balanced=chosen.alpha is None, memory_budget_mb=settings.memory_budget_mb)
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


def make_plots(results: Sequence[Any], feature_set: FeatureSet, settings: Any, folder: Path, task: int = 0,
               log: Callable[[str], None] = print) -> dict[str, Path]:
    """Write the PNGs into ``folder``; returns ``{name: path}``."""
    from lightning_putm import plots

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figures = {"accuracy_vs_alpha": plots.plot_accuracy_vs_alpha(summary_rows(results), folder / "accuracy_vs_alpha.png")}
    case = putm_case_study(results, feature_set, settings, task)
    if case is not None:
        where = f"{case['shots']}-shot alpha={case['alpha']} task {case['task']}"
        figures["putm_query_counts"] = plots.plot_query_counts(
            case["true_counts"], case["estimated_counts"], folder / "putm_query_counts.png",
            class_names=case["class_names"], title=f"PUTM class-count estimate, {where}")
        figures["putm_tsne"] = plots.plot_prototype_tsne(
            case["queries"], case["query_labels"], case["initial_prototypes"], case["refined_prototypes"],
            folder / "putm_tsne.png", support=case["support"], support_labels=case["support_labels"],
            seed=settings.seed, title=f"PUTM prototypes, {where}")
        estimate = ", ".join(f"{e:.1f}" for e in case["estimated_counts"])
        log(f"PUTM case study ({where}): true query counts {case['true_counts']}, estimated [{estimate}]")
    return figures


# --------------------------------------------------------------------------------------------- loggers
def _is_wandb(logger: Any) -> bool:
    return type(logger).__name__ == "WandbLogger"


def log_to_loggers(loggers: Iterable[Any], rows: list[dict[str, Any]], figures: dict[str, Path], prefix: str) -> None:
    """W&B extras (table, accuracy-vs-α line plots, images); scalar metrics go through ``LightningModule.log``."""
    for logger in loggers:
        if _is_wandb(logger):
            log_to_wandb(logger.experiment, rows, figures, prefix)


def log_to_wandb(run: Any, rows: list[dict[str, Any]], figures: dict[str, Path], prefix: str) -> None:
    import wandb

    payload: dict[str, Any] = {
        f"{prefix}/results": wandb.Table(columns=SUMMARY_COLUMNS, data=[[row[c] for c in SUMMARY_COLUMNS] for row in rows])
    }
    for shots in sorted({int(r["shots"]) for r in rows}):
        numeric = [r for r in rows if int(r["shots"]) == shots and r["alpha"] != "balanced"]
        alphas = sorted({float(r["alpha"]) for r in numeric})
        methods = list(dict.fromkeys(r["method"] for r in numeric))
        if not alphas:
            continue
        accuracy = {(r["method"], float(r["alpha"])): float(r["accuracy"]) for r in numeric}
        payload[f"{prefix}/accuracy_vs_alpha/{shots}shot"] = wandb.plot.line_series(
            xs=alphas, ys=[[accuracy.get((m, a), float("nan")) for a in alphas] for m in methods], keys=methods,
            title=f"{shots}-shot accuracy (%) vs Dirichlet alpha", xname="alpha")
    for name, path in figures.items():
        payload[f"{prefix}/plots/{name}"] = wandb.Image(str(path))
    run.log(payload)
