#!/usr/bin/env python
"""Fidelity check of our PUTM against the recorded figures of the reference code (and, optionally, the reference code itself).

Protocol: scikit-learn's digits, raw 64-d pixels of all 10 classes as features, zero-padded to
640-d (the reference needs d >= n), 5-way 1-shot, 75 queries, 200 tasks, Dirichlet alpha = 2 and balanced.
Our PUTM must land within the combined 95% confidence intervals of the reference.

    python benchmarks/fidelity_digits.py                       # ours vs the recorded figures of the reference code
    python benchmarks/fidelity_digits.py --reference ../PUTM   # also run a local reference checkout on the same tasks

Takes about 10 minutes for ours on 2 CPU cores (twice that with --reference).
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.methods import build_method
from lightning_putm.metrics import mean_and_ci95, task_accuracy

# The reference implementation (github.com/RashLog/PUTM) on the 2-core CPU machine, 200 tasks (mean, 95% CI, in %).
RECORDED = {
    "dirichlet": {"ncm": (72.9, 1.7), "putm": (75.6, 2.0)},
    "balanced": {"ncm": (73.9, 1.2), "putm": (85.9, 1.7)},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pad", type=int, default=640, help="zero-pad features to this width (0: keep 64)")
    parser.add_argument("--reference", help="local checkout of RashLog/PUTM to run on the same tasks")
    parser.add_argument("--putm", nargs="*", default=[], metavar="KEY=VALUE", help="PUTM overrides, e.g. init_tasks=200")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    digits = digits_feature_set()
    features = digits.features
    if args.pad and args.pad > features.shape[1]:
        features = torch.nn.functional.pad(features, (0, args.pad - features.shape[1]))
    overrides = {k: _number(v) for k, v in (kv.split("=", 1) for kv in args.putm)}
    reference = None
    if args.reference:
        from reference_putm import load_reference_module

        reference = load_reference_module(args.reference)

    rows = []
    for sampling, alpha in (("dirichlet", 2.0), ("balanced", None)):
        bank = sample_episode_bank(digits.labels, 5, 1, 75, alpha, args.tasks, args.seed)
        gathered = bank.gather(features)
        for name in ("ncm", "putm"):
            method = build_method("simpleshot" if name == "ncm" else "putm", overrides if name == "putm" else {},
                                  shots=1, balanced=alpha is None)
            start = time.perf_counter()
            accuracy = task_accuracy(method.predict(gathered.batch), gathered.query_labels)
            seconds = time.perf_counter() - start
            rows.append((sampling, f"{name} (ours)", *mean_and_ci95(accuracy), args.tasks / seconds, *RECORDED[sampling][name]))
        if reference is not None:
            from reference_putm import reference_accuracy

            start = time.perf_counter()
            accuracy = reference_accuracy(reference, gathered.batch, gathered.query_labels, balanced=alpha is None)
            seconds = time.perf_counter() - start
            rows.append((sampling, "putm (reference code, same tasks)", *mean_and_ci95(accuracy), args.tasks / seconds,
                         *RECORDED[sampling]["putm"]))

    print(f"\ndigits, raw pixels padded to {features.shape[1]}-d, 5-way 1-shot, 75 queries, {args.tasks} tasks, seed {args.seed}")
    print(f"{'sampling':10} {'method':36} {'accuracy (%)':>14} {'tasks/s':>8} {'recorded':>12}  within CI")
    for sampling, name, mean, ci, speed, ref_mean, ref_ci in rows:
        inside = abs(100 * mean - ref_mean) <= 100 * ci + ref_ci
        print(f"{sampling:10} {name:36} {100 * mean:7.1f} ± {100 * ci:4.1f} {speed:8.2f} {ref_mean:6.1f} ± {ref_ci:3.1f}  "
              f"{'yes' if inside else 'NO'}")


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


if __name__ == "__main__":
    main()
