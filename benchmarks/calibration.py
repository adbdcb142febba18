#!/usr/bin/env python
"""How far each method's probabilities can be trusted, before and after its temperature is fitted.

For every method: a temperature is fitted on ``--tasks`` labelled tasks drawn from the validation classes (what
``evaluate.py predict calibration=auto`` does), then the raw and the calibrated probabilities are scored on
``--tasks`` tasks from the validation classes and from the test classes (other tasks, other classes). Printed
and written to ``--output``: a markdown table (accuracy, temperature, ECE with 15 equal-width bins, NLL, and how
often the 95% count interval Σp ± 1.96·√Σp(1−p) holds a class's true query count), a CSV, and a reliability
diagram per method (``reliability.png``).

Usage (from the repository root):

    python benchmarks/calibration.py --checkpoint checkpoints/omniglot/conv4/latest/classifier/best.ckpt
    python benchmarks/calibration.py --val-features val.pt --test-features test.pt [--base-features train.pt]
    python benchmarks/calibration.py --checkpoint CKPT --methods putm,simpleshot --tasks 200 --shots 5

With ``--checkpoint`` the val, test and train (base classes, for CL2N) splits of the data it records are
extracted once through ``evaluate.py``'s feature cache (``--feature-cache``). Tasks: ``--ways``-way
``--shots``-shot, ``--queries`` queries per task drawn with Dirichlet(``--alpha``) proportions (the imbalanced
protocol; a user's proportions are unknown). Each method gets its ``evaluate.py`` defaults for that setting.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_putm.atomic import atomic_savefig, atomic_write_csv, atomic_write_text
from lightning_putm.evaluation.calibration import draw_calibration_tasks, predict_in_chunks
from lightning_putm.evaluation.settings import checkpoint_data, load_evaluate_config, settings_from_config
from lightning_putm.evaluation.sources import Extraction, base_split_features, read_base_statistics
from lightning_putm.features.cache import file_sha256
from lightning_putm.features.files import FeatureSet, load_features
from lightning_putm.methods import (available_methods, build_method, method_display_name, method_uses_base_covariance,
                                    method_uses_base_mean)
from lightning_putm.methods.calibration import (ECE_BINS, expected_calibration_error, fit_temperature,
                                                negative_log_likelihood, reliability_bins, scale_probabilities,
                                                soft_counts)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a train_backbone.py checkpoint: its val/test/train splits are extracted")
    parser.add_argument("--data-root", help="where the checkpoint's data lives, if not where it records")
    parser.add_argument("--val-features", help="feature file of the validation classes (instead of --checkpoint)")
    parser.add_argument("--test-features", help="feature file of the test classes (instead of --checkpoint)")
    parser.add_argument("--base-features", help="feature file of the base classes, for CL2N (optional)")
    parser.add_argument("--feature-cache", default="outputs/feature_cache")
    parser.add_argument("--methods", default=",".join(available_methods()))
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per split (fit and score)")
    parser.add_argument("--slow-tasks", type=int, default=200,
                        help="tasks per split for alpha_am, which solves about 2 tasks/s on a 2-core CPU")
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--shots", type=int, default=1)
    parser.add_argument("--queries", type=int, default=15)
    parser.add_argument("--alpha", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default="outputs/calibration")
    args = parser.parse_args(argv)
    if not args.checkpoint and not (args.val_features and args.test_features):
        parser.error("give --checkpoint, or --val-features and --test-features")
    unknown = sorted(set(args.methods.split(",")) - set(available_methods()))
    if unknown:
        parser.error(f"unknown methods {unknown}; available: {', '.join(available_methods())}")
    return args


def split_features(args: argparse.Namespace) -> tuple[FeatureSet, FeatureSet, Path | None, str]:
    """Validation, test and base feature sets (the base one as a path, read per method), and their origin."""
    if not args.checkpoint:
        return (load_features(args.val_features), load_features(args.test_features), args.base_features and
                Path(args.base_features), f"{args.val_features}, {args.test_features}")
    checkpoint = Path(args.checkpoint)
    extraction = Extraction(checkpoint, Path(args.feature_cache), output_dir=Path(args.feature_cache))
    data = checkpoint_data(checkpoint, args.data_root)
    sha = file_sha256(checkpoint)
    paths = {split: base_split_features(data, extraction, split, sha, purpose=f"{split} features", use="")
             for split in ("val", "test", "train")}
    return load_features(paths["val"]), load_features(paths["test"]), paths["train"], f"{checkpoint} ({data.name})"


@dataclass
class Scores:
    accuracy: float
    ece_raw: float
    ece_calibrated: float
    nll_raw: float
    nll_calibrated: float
    coverage_raw: float
    coverage_calibrated: float


def count_coverage(probabilities: torch.Tensor, query_labels: torch.Tensor, ways: int) -> float:
    """Fraction of (task, class) pairs whose true query count lies in the 95% interval of the probabilities."""
    counts = soft_counts(probabilities)
    true = torch.nn.functional.one_hot(query_labels.long(), ways).sum(1).double()
    return float(((true >= counts.low - 1e-9) & (true <= counts.high + 1e-9)).double().mean())


def score(raw: torch.Tensor, labels: torch.Tensor, temperature: float, ways: int) -> tuple[Scores, torch.Tensor]:
    calibrated = scale_probabilities(raw, temperature)
    assert torch.equal(calibrated.argmax(-1), raw.argmax(-1)), "calibration changed a prediction"
    return Scores(100.0 * float((raw.argmax(-1) == labels).double().mean()),
                  expected_calibration_error(raw, labels), expected_calibration_error(calibrated, labels),
                  negative_log_likelihood(raw, labels), negative_log_likelihood(raw, labels, temperature),
                  count_coverage(raw, labels, ways), count_coverage(calibrated, labels, ways)), calibrated


def reliability_figure(curves: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], path: Path,
                       title: str) -> None:
    """One panel per method: accuracy against confidence per bin, raw and calibrated, and the diagonal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 4
    rows = math.ceil(len(curves) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 3.1 * rows), squeeze=False, sharex=True,
                                sharey=True)
    for ax in axes.flat[len(curves):]:
        ax.axis("off")
    for ax, (name, (raw, calibrated, labels)) in zip(axes.flat, curves.items()):
        ax.plot([0, 1], [0, 1], color="0.6", linewidth=0.8, linestyle="--")
        for probabilities, label, colour in ((raw, "raw", "tab:red"), (calibrated, "calibrated", "tab:blue")):
            table = [b for b in reliability_bins(probabilities, labels) if b.count]
            ece = expected_calibration_error(probabilities, labels)
            ax.plot([b.confidence for b in table], [b.accuracy for b in table], marker="o", markersize=3,
                    color=colour, label=f"{label} (ECE {ece:.3f})")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0, 1.02)
    for ax in axes[-1]:
        ax.set_xlabel("confidence (top probability)")
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    atomic_savefig(figure, path, dpi=110)
    plt.close(figure)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    output = Path(args.output)
    validation, test, base_path, origin = split_features(args)
    methods = args.methods.split(",")
    defaults = settings_from_config(load_evaluate_config([f"methods=[{','.join(methods)}]", "logger=none",
                                                          "plots=false"])).method_params
    header = ["method", "tasks", "accuracy", "temperature", "val ECE raw", "val ECE cal.", "test ECE raw",
              "test ECE cal.", "test NLL raw", "test NLL cal.", "count coverage raw", "count coverage cal.", "seconds"]
    rows, curves = [], {}
    for name in methods:
        tasks = args.slow_tasks if name == "alpha_am" else args.tasks
        start = time.perf_counter()
        statistics = None
        if base_path is not None and method_uses_base_mean(name):
            statistics, _ = read_base_statistics(base_path, validation.dim, method_uses_base_covariance(name))
        method = build_method(name, defaults.get(name, {}), shots=args.shots, balanced=False,
                              base_mean=None if statistics is None else statistics.mean,
                              base_covariance=None if statistics is None else statistics.covariance)
        drawn = {}
        for split, features, seed in (("val", validation, args.seed), ("test", test, args.seed + 1)):
            tasks_of_split, queries = draw_calibration_tasks(features, args.ways, args.shots, args.queries, tasks, seed,
                                                             alpha=args.alpha)
            if queries != args.queries:
                raise SystemExit(f"{split}: classes too small for {args.queries} queries; lower --queries")
            probabilities = predict_in_chunks(method, tasks_of_split.batch, progress=True,
                                              description=f"{name} {split}")
            drawn[split] = (probabilities, tasks_of_split.query_labels)
        temperature = fit_temperature(*drawn["val"])
        on_val, _ = score(*drawn["val"], temperature, args.ways)
        on_test, calibrated = score(*drawn["test"], temperature, args.ways)
        seconds = time.perf_counter() - start
        display = method_display_name(name)
        curves[display] = (drawn["test"][0], calibrated, drawn["test"][1])
        rows.append([display, tasks, f"{on_test.accuracy:.2f}", f"{temperature:.3g}", f"{on_val.ece_raw:.3f}",
                     f"{on_val.ece_calibrated:.3f}", f"{on_test.ece_raw:.3f}", f"{on_test.ece_calibrated:.3f}",
                     f"{on_test.nll_raw:.3f}", f"{on_test.nll_calibrated:.3f}", f"{100 * on_test.coverage_raw:.1f}%",
                     f"{100 * on_test.coverage_calibrated:.1f}%", f"{seconds:.0f}"])
        print(" | ".join(str(v) for v in rows[-1]), flush=True)
    setting = (f"{args.ways}-way {args.shots}-shot, {args.queries} queries, Dirichlet α = {args.alpha:g}; "
               f"temperature fitted on the validation tasks; features: {origin}")
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
                      ["| " + " | ".join(str(v) for v in row) + " |" for row in rows])
    stem = f"{args.ways}way_{args.shots}shot"
    atomic_write_text(output / f"calibration_{stem}.md", f"{setting}\n\n{table}\n")
    atomic_write_csv(output / f"calibration_{stem}.csv", header, rows)
    reliability_figure(curves, output / f"reliability_{stem}.png",
                       f"Reliability on the test classes ({setting.split(';')[0]}); ECE with {ECE_BINS} bins")
    print(f"\n{setting}\n\n{table}\n\nwrote {output / f'calibration_{stem}.md'}, .csv and reliability_{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
