#!/usr/bin/env python
"""Side-by-side check of our α-AM against its authors' code (github.com/MichalisLazarou/AM) on the same tasks.

    python benchmarks/fidelity_alpha_am.py --reference /path/to/AM [--tasks 100] \
        [--omniglot-root /path/to/omniglot | --omniglot FILE]

The reference's ``src/methods/AM.py`` (class ``ALPHA_AM``) is imported from the checkout with
``lightning_putm.studies.reference.import_from_checkout`` and run through its own ``run_task`` (its own PLC
preprocessing ``PT``/``scaleEachUnitaryDatas``/``centerData``, ``compute_lambda``, ``run_adaptation``) with the
settings of its ``config/dirichlet/methods_config/alpha_am.yaml`` (the balanced one is identical) and
``src/main.py``'s ``--phi mus+G+Wb`` and ``--plc`` (``default=True``). Thin shims only: ``Tensor.cuda`` is a
no-op (the code calls it unconditionally), the backbone is an identity (``model(x, feature=True) → (x, None)``)
because both sides get the same features, ``record_info`` also keeps the final query scores ``Z`` (the code only
records the accuracy), and ``tqdm``/``print`` output is silenced. All tasks of a setting run as one batch on both
sides (the reference's ``batch_size`` is 400).

Settings: 5-way, 1 and 5 shots, Dirichlet α = 2 and balanced, on
* digits: scikit-learn's raw 8×8 pixels (64-d), 75 queries;
* Omniglot: ``--omniglot FILE`` (our feature format) or ``--omniglot-root DIR`` (the real images of the Vinyals
  test split, rotation 0 only — 423 classes × 20 images —, 28×28 average-pooled to 14×14: raw 196-d pixels, no
  trained backbone), 15 queries (20 images per class).

Printed per setting: both accuracies (mean ± 95% CI), the share of identical per-query predictions, tasks per
second on this machine; with ``--reference-chunk N`` also the share of the reference's own predictions that stay
the same when it solves the tasks N at a time instead of all at once (its results depend on its batch size in the
last bits, which 1000 Adam steps can turn into other predictions). Target: ≥ 99% identical predictions.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.features import FeatureSet, load_features
from lightning_putm.methods import build_method
from lightning_putm.metrics import mean_and_ci95, task_accuracy
from lightning_putm.studies.reference import import_from_checkout


def load_reference(path: str) -> types.ModuleType:
    """The authors' ``src/methods/AM.py``; ``Tensor.cuda`` becomes a no-op (CPU machine)."""
    torch.Tensor.cuda = lambda self, *a, **k: self  # the code calls .cuda() unconditionally
    return import_from_checkout(path, "src.methods.AM")


class IdentityBackbone:
    """Stands in for the reference's backbone: the tasks already hold features."""

    def eval(self) -> None:
        return None

    def __call__(self, x: torch.Tensor, feature: bool = True) -> tuple[torch.Tensor, None]:
        return x, None


def reference_settings(ours) -> types.SimpleNamespace:
    """The reference's ``args``: its alpha_am.yaml and main.py defaults (those our settings claim to follow)."""
    return types.SimpleNamespace(
        phi=ours.phi, temp=ours.temperature, K=20, alpha=0.8, loss_weights=list(ours.loss_weights),
        iter=ours.iterations, lr_lp=ours.lr, PLC=ours.plc, entropies=["Shannon", "Alpha", "Alpha"],
        alpha_values=[1.0, 1.0, 1.0], use_tuned_alpha_values=True)


def run_reference(module: types.ModuleType, batch, shots: int, args, log_file: str) -> torch.Tensor:
    """Query predictions ``[T, Q]`` of the reference's ALPHA_AM on one batch of tasks."""
    method = module.ALPHA_AM(IdentityBackbone(), torch.device("cpu"), log_file, args)
    kept: list[torch.Tensor] = []
    record = method.record_info

    def record_and_keep(z: torch.Tensor, y_q: torch.Tensor) -> None:
        kept.append(z.detach().clone())
        record(z, y_q)

    method.record_info = record_and_keep
    task = {"x_s": batch.support.clone(), "x_q": batch.query.clone(),
            "y_s": batch.support_labels.unsqueeze(2), "y_q": torch.zeros(batch.num_tasks, batch.num_queries, 1),
            "train_mean": torch.zeros(batch.dim)}
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        method.run_task(task, shots)
    return kept[-1].argmax(2)


def omniglot_raw_pixels(root: str) -> FeatureSet:
    """Vinyals test split of the real Omniglot, rotation 0: 28×28 ink in [0, 1], 2×2 average-pooled (196-d)."""
    from lightning_putm.data.omniglot import read_omniglot

    split = read_omniglot(root, "test", rotations=(0,))
    pixels = F.avg_pool2d(split.images.float() / 255.0, 2).flatten(1)
    return FeatureSet(pixels, split.labels, list(split.class_names), {"source": "omniglot raw 14x14 pixels"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True,
                        help="local checkout of MichalisLazarou/AM (the folder holding src/)")
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shots", type=int, nargs="*", default=[1, 5])
    parser.add_argument("--ours", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of our α-AM only (the reference keeps its settings), e.g. entropy_alpha=2")
    parser.add_argument("--no-digits", action="store_true", help="skip the digits settings")
    parser.add_argument("--omniglot", default="", help="our-format Omniglot feature file (e.g. Conv-4 test split)")
    parser.add_argument("--omniglot-root", default="", help="folder holding omniglot-py/: raw pooled pixels instead")
    parser.add_argument("--omniglot-queries", type=int, default=15, help="queries per Omniglot task (in all)")
    parser.add_argument("--reference-chunk", type=int, default=0, metavar="N",
                        help="also run the reference in chunks of N tasks and print how many of its own predictions "
                             "that changes (its batch-size dependence: the floor for 'same pred'); 0 = off")
    args = parser.parse_args()
    overrides = {key: yaml.safe_load(value) for key, value in (kv.split("=", 1) for kv in args.ours)}
    module = load_reference(args.reference)
    logging.disable(logging.CRITICAL)

    datasets: list[tuple[str, FeatureSet, int]] = []
    if not args.no_digits:
        datasets.append(("digits raw 64-d Q=75", digits_feature_set(), 75))
    if args.omniglot and Path(args.omniglot).exists():
        datasets.append((f"omniglot features Q={args.omniglot_queries}", load_features(args.omniglot),
                         args.omniglot_queries))
    elif args.omniglot_root:
        datasets.append((f"omniglot raw 196-d Q={args.omniglot_queries}", omniglot_raw_pixels(args.omniglot_root),
                         args.omniglot_queries))
    log_file = str(Path(tempfile.mkdtemp(prefix="alpha_am_ref_")) / "reference.log")
    rows = []
    for data_name, feature_set, queries in datasets:
        for shots in args.shots:
            for sampling, alpha in (("dirichlet a=2", 2.0), ("balanced", None)):
                bank = sample_episode_bank(feature_set.labels, 5, shots, queries, alpha, args.tasks, args.seed)
                gathered = bank.gather(feature_set.features)
                method = build_method("alpha_am", overrides, shots=shots, balanced=alpha is None)
                start = time.perf_counter()
                ours = method.predict(gathered.batch).argmax(2)
                ours_s = time.perf_counter() - start
                start = time.perf_counter()
                defaults = build_method("alpha_am", {}, shots=shots, balanced=alpha is None).settings
                theirs = run_reference(module, gathered.batch, shots, reference_settings(defaults), log_file)
                theirs_s = time.perf_counter() - start
                our_acc = task_accuracy(F.one_hot(ours, 5).float(), gathered.query_labels)
                their_acc = task_accuracy(F.one_hot(theirs, 5).float(), gathered.query_labels)
                same = float((ours == theirs).double().mean())
                self_same = None
                if args.reference_chunk > 0:
                    step = args.reference_chunk
                    chunked = torch.cat([run_reference(module, gathered.batch.slice(i, i + step), shots,
                                                       reference_settings(defaults), log_file)
                                         for i in range(0, args.tasks, step)])
                    self_same = float((chunked == theirs).double().mean())
                rows.append((f"{data_name} {shots}-shot {sampling}", *mean_and_ci95(our_acc),
                             *mean_and_ci95(their_acc), same, args.tasks / ours_s, args.tasks / theirs_s, self_same))
                print(rows[-1], flush=True)

    print(f"\nα-AM: ours vs reference (MichalisLazarou/AM ALPHA_AM) on the same {args.tasks} tasks per setting, seed "
          f"{args.seed}, 5-way; accuracy in % (95% CI); speed on this machine, torch threads {torch.get_num_threads()}"
          + (f"; ours with {overrides}" if overrides else ""))
    chunk_column = f"ref/{args.reference_chunk} same" if args.reference_chunk > 0 else ""
    print(f"{'setting':46} {'ours':>14} {'reference':>14} {'same pred':>9} {'ours t/s':>8} {'ref t/s':>8}"
          + (f" {chunk_column:>13}" if chunk_column else ""))
    for setting, m, ci, rm, rci, same, speed, rspeed, self_same in rows:
        print(f"{setting:46} {100 * m:6.2f} ± {100 * ci:4.2f} {100 * rm:6.2f} ± {100 * rci:4.2f} "
              f"{100 * same:8.2f}% {speed:8.2f} {rspeed:8.2f}"
              + (f" {100 * self_same:12.2f}%" if self_same is not None else ""))


if __name__ == "__main__":
    main()
