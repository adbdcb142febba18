#!/usr/bin/env python
"""Where each method puts the queries of PADDLE's tasks: how many it predicts as classes absent from the query set.

With ``query_classes=K_eff`` (docs/protocol.md) a task's support holds N classes but its queries come from K_eff of
them, and no method is told which. This script solves the banks ``evaluate.py`` would solve with the same
arguments (the same sampler, seed, method options and base-class statistics, so the accuracies equal its
``results.csv``) and prints, per method and bank, a table of:

* accuracy (%): as ``evaluate.py`` computes it (argmax over the N classes);
* to absent (%): the share of all queries whose argmax is a class with no query in that task (every such query is
  wrong);
* absent used: the mean, over tasks, of the number of absent classes that receive at least one query;
* mass absent (%): the mean probability the method gives the absent classes, per query.

Usage (from the repository root; any ``evaluate.py`` key, ``features=`` a feature file):

    python benchmarks/absent_predictions.py features=test.pt base_features=train.pt ways=20 query_classes=5 \\
        'alphas=[uniform]' 'shots=[1]' queries=75 tasks=10 'methods=[putm,simpleshot,ptmap]'
"""

from __future__ import annotations

import sys
import time

import torch

from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
from lightning_putm.evaluation.sources import load_base_statistics
from lightning_putm.features.files import load_features
from lightning_putm.methods import build_method, method_uses_class_prior
from lightning_putm.metrics import task_accuracy
from lightning_putm.validators import alpha_label, query_classes_label

COLUMNS = ["method", "shots", "K_eff", "alpha", "accuracy (%)", "to absent (%)", "absent used", "mass absent (%)",
           "time (s)"]


def main(overrides: list[str]) -> int:
    settings = settings_from_config(load_evaluate_config(overrides))
    if settings.features in ("demo", "auto"):
        raise SystemExit("give features=<feature file> (and base_features=<file> as evaluate.py had)")
    feature_set = load_features(settings.features, settings.allow_pickle)
    base = load_base_statistics(settings, feature_set.dim)
    rows = []
    for shots in settings.shots:
        for keff in settings.query_classes:
            for alpha in settings.alphas:
                bank = sample_episode_bank(feature_set.labels, settings.ways, shots, settings.queries, alpha,
                                           settings.tasks, settings.seed, class_names=feature_set.class_names,
                                           query_classes=keff)
                gathered = bank.gather(feature_set.features, settings.device)
                absent = ~bank.present.to(settings.device)  # [T, N]: classes drawn absent from the query set
                for name in settings.methods:
                    oracle = settings.oracle_prior and method_uses_class_prior(name)
                    method = build_method(name, settings.method_params.get(name, {}), shots=shots,
                                          balanced=bank.balanced, memory_budget_mb=settings.memory_budget_mb,
                                          base_mean=base.mean, base_covariance=base.covariance,
                                          query_counts=bank.query_counts if oracle else None)
                    start = time.perf_counter()
                    probabilities = method.predict(gathered.batch)  # [T, Q, N]
                    seconds = time.perf_counter() - start
                    predicted = probabilities.argmax(-1)
                    to_absent = torch.gather(absent, 1, predicted)  # [T, Q]
                    used = torch.zeros_like(absent).scatter_(1, predicted, True) & absent
                    mass = (probabilities * absent[:, None, :]).sum(-1)
                    accuracy = task_accuracy(probabilities, gathered.query_labels).double().mean()
                    rows.append([name, str(shots), query_classes_label(keff), alpha_label(alpha),
                                 f"{100 * float(accuracy):.2f}", f"{100 * to_absent.double().mean().item():.2f}",
                                 f"{used.sum(1).double().mean().item():.2f}",
                                 f"{100 * mass.double().mean().item():.2f}", f"{seconds:.1f}"])
                    print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
