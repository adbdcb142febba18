"""How far can PUTM's navigator be trusted? Its accuracy against two signals a task itself offers, per (shot, α).

A support weight that adapts to the task (trust the queries' mass when the features are good, keep the prototypes
at the support when they are not) needs a signal that tracks whether transduction helps. This command prints, for a
PUTM preset on one feature set:

- the accuracy of the final forward navigator π_f, and of the support-only nearest mean on the same preprocessed
  features (PUTM's power transform, basis and L2 normalisation; not SimpleShot's CL2N);
- PUTM's mean confidence (the largest class probability of each query, averaged over queries and tasks): far above
  the accuracy means the navigator is sure and wrong;
- the agreement between PUTM's and the nearest mean's labels: how much transduction changed the answer.

    python -m lightning_putm navigator-confidence --features demo --preset support_anchored
    python -m lightning_putm navigator-confidence --features outputs/feature_cache/<file>.pt --queries 15

``--features`` is ``demo`` (the built-in digits pixels) or a feature file in the format ``evaluate.py`` reads
(for example a file of its feature cache, which holds a checkpoint's test features).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_putm.config import conf_dir
from lightning_putm.validators import parse_alpha

if TYPE_CHECKING:  # the functions that compute import torch and the data themselves: --help needs neither
    import torch

    from lightning_putm.features.files import FeatureSet
    from lightning_putm.methods.putm import PUTM
    from lightning_putm.tasks import TaskBatch

#: the PUTM presets' folder, below the config folder (``conf/`` or ``$LIGHTNING_PUTM_CONF``)
PRESETS = Path("method") / "presets" / "putm"


def confidence_stats(probabilities: torch.Tensor, query_labels: torch.Tensor) -> tuple[float, float]:
    """``(accuracy %, mean confidence %)`` over all queries of ``[T, Q, N]`` probabilities (rows renormalised)."""
    rows = probabilities / probabilities.sum(dim=2, keepdim=True)
    accuracy = (rows.argmax(dim=2) == query_labels).double().mean()
    confidence = rows.amax(dim=2).double().mean()
    return 100 * float(accuracy), 100 * float(confidence)


def nearest_mean_labels(solver: PUTM, tasks: TaskBatch) -> torch.Tensor:
    """``[T, Q]`` labels of the nearest support mean in PUTM's preprocessed space (its first E-step's prototypes)."""
    import torch

    from lightning_putm.tasks import weighted_class_means

    rows = solver.preprocess(tasks)
    prototypes = weighted_class_means(rows[:, : tasks.num_support], tasks.one_hot_support())
    return torch.cdist(rows[:, tasks.num_support:], prototypes).argmin(dim=2)


def preset_options(name: str, overrides: list[str]) -> dict:
    """PUTM keyword arguments of a preset (its YAML file), then ``key=value`` overrides (numbers parsed)."""
    import yaml
    from omegaconf import OmegaConf

    if name == "reference":
        options: dict = {}
    else:
        folder = conf_dir() / PRESETS
        path = folder / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in folder.glob("*.yaml"))
            raise SystemExit(f"--preset {name!r}: no {path}; presets: {', '.join(known)}")
        options = dict(OmegaConf.to_container(OmegaConf.load(path)))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE (e.g. --set support_weight=20), got {item!r}")
        options[key] = yaml.safe_load(value)  # 20 -> int, 0.5 -> float, true -> bool
    return options


def load_feature_set(source: str) -> FeatureSet:
    from lightning_putm.data.digits import digits_feature_set
    from lightning_putm.features.files import load_features

    return digits_feature_set() if source == "demo" else load_features(source, setting="--features")


def measure(feature_set: FeatureSet, options: dict, shots: int, alpha: float | None, queries: int, tasks: int,
            seed: int = 0) -> tuple[float, float, float, float]:
    """PUTM's accuracy and confidence, the nearest mean's accuracy and its agreement with PUTM (all %), on
    ``tasks`` 5-way episodes drawn as ``evaluate.py`` draws them."""
    from lightning_putm.data.episodes import sample_episode_bank
    from lightning_putm.methods.putm import PUTM

    bank = sample_episode_bank(feature_set.labels, 5, shots, queries, alpha, tasks, seed=seed)
    gathered = bank.gather(feature_set.features)
    solver = PUTM(shots=shots, balanced=alpha is None, **options)
    probabilities = solver.predict(gathered.batch)
    accuracy, confidence = confidence_stats(probabilities, gathered.query_labels)
    nearest = nearest_mean_labels(solver, gathered.batch)
    nearest_accuracy = 100 * float((nearest == gathered.query_labels).double().mean())
    agreement = 100 * float((nearest == probabilities.argmax(dim=2)).double().mean())
    return accuracy, confidence, nearest_accuracy, agreement


def main(argv: list[str] | None = None, prog: str | None = None) -> list[tuple]:
    """Print one row per (shot, α) of ``argv``'s preset and features; returns the rows."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", default="demo", help="'demo' (digits pixels) or a feature file")
    parser.add_argument("--preset", default="reference", help="a PUTM preset: reference, fast, support_anchored, ...")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a PUTM option on top")
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--alphas", nargs="+", default=["0.5", "2", "balanced"])
    parser.add_argument("--queries", type=int, default=75)
    parser.add_argument("--tasks", type=int, default=200)
    args = parser.parse_args(argv)
    alphas = [parse_alpha(alpha, "--alphas") for alpha in args.alphas]  # before any file is read
    feature_set = load_feature_set(args.features)
    options = preset_options(args.preset, args.set)
    rows = []
    print(f"PUTM preset {args.preset} {options or ''} on {args.features}, {args.tasks} tasks per setting")
    print("| shots | α | PUTM accuracy (%) | mean confidence (%) | confidence − accuracy | nearest-mean accuracy (%) "
          "| agreement with nearest mean (%) |")
    print("|---|---|---|---|---|---|---|")
    for shots in args.shots:
        for alpha, value in zip(args.alphas, alphas):
            accuracy, confidence, nearest, agreement = measure(feature_set, options, shots, value, args.queries,
                                                               args.tasks)
            rows.append((shots, alpha, accuracy, confidence, nearest, agreement))
            print(f"| {shots} | {alpha} | {accuracy:.2f} | {confidence:.2f} | {confidence - accuracy:+.2f} | "
                  f"{nearest:.2f} | {agreement:.2f} |", flush=True)
    return rows

