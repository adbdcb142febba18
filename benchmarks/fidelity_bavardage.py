#!/usr/bin/env python
"""Side-by-side check of our BAVARDAGE against the paper's code (github.com/yhu01/BAVARDAGE) on the same tasks.

    python benchmarks/fidelity_bavardage.py --reference /path/to/BAVARDAGE [--tasks 200] [--omniglot DIR]

Settings: 5-way, 1 and 5 shots, Dirichlet alpha=2 and balanced, on
* digits: scikit-learn's raw 8x8 pixels (64-d). The base classes (for the base mean and the within-class
  scatter that BAVARDAGE whitens with) are digits 0, 1, 2; the tasks are drawn from digits 3..9 only, so no
  statistic comes from a class of the bank (as ``base_features=`` does in our evaluation). 75 queries.
* Omniglot Conv-4 64-d features (our feature format) ``DIR/omniglot_test.pt`` with base split
  ``DIR/omniglot_train.pt``, 15 queries, when the files exist.

Both methods get the same preprocessing inputs, the same hyper-parameters and the same Dirichlet prior: the
reference's alpha0 is set through its ``VB_SymDirMM(alpha0=...)`` argument. Rows per setting: the paper's prior
alpha0=2 (= the protocol's alpha; our ``oracle_dirichlet_alpha=2``), our fair default alpha0=1 (the reference
given alpha0=1), and ours without base statistics (no reference counterpart: the code's no-whitening path
crashes). Printed: mean ± 95% CI, the share of identical query predictions, tasks per second, and whether our
mean lies within the combined CI of the reference's.

The reference is run through its own functions (getRunSet's preprocessing, SimpleWMask.soft_km and
vb_equi_iso's VB_EM) with thin shims only: its file loaders return our bank, and its module-level ``ds``
global (read by soft_km) is set. Support rows are reordered shot-major as the code expects.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import time
from pathlib import Path

import torch

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.features.files import FeatureSet, load_features
from lightning_putm.methods.bavardage import BAVARDAGE, base_within_class_scatter
from lightning_putm.metrics import mean_and_ci95, task_accuracy
from lightning_putm.studies.reference import import_from_checkout


def load_reference(path: str):
    """Their ``bavardage.py`` and ``vb_equi_iso.py`` from the --reference checkout."""
    return import_from_checkout(path, "bavardage"), import_from_checkout(path, "vb_equi_iso")


def reference_predictions(ref, lib, batch, base: FeatureSet, shots: int, queries: int, balanced: bool,
                          prior: float, params: dict) -> torch.Tensor:
    """Query predictions ``[T, Q]`` of the paper's code (its own functions, thin shims)."""
    t, ways = batch.num_tasks, batch.ways
    order = torch.arange(ways * shots).view(ways, shots).T.reshape(-1)  # class-major -> shot-major
    assert torch.equal(batch.support_labels[:, order], torch.arange(ways).repeat(shots).expand(t, -1))
    dtype = getattr(torch, params.get("reference_dtype", "float64"))
    data = torch.cat([batch.support[:, order], batch.query], dim=1).to(dtype)
    labels = torch.cat([batch.support_labels[:, order], torch.zeros(t, batch.num_queries, dtype=torch.long)], 1)
    order_base = torch.argsort(base.labels, stable=True)
    base_data = base.features[order_base].to(dtype)
    num_cls = torch.bincount(base.labels).tolist()
    num_cls = [c for c in num_cls if c > 0]
    # shims: its loaders return our bank and base split
    ref.FSLTask.loadDataSet = lambda name: None
    ref.FSLTask.GenerateRunSet = lambda cfg: (data.clone(), labels.clone())
    ref.load_trainset = lambda path: (base_data.clone(), num_cls)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # its torch.eye / torch.Tensor(...) follow the data's precision
    with contextlib.redirect_stdout(io.StringIO()):
        ds = ref.getRunSet(n_shots=shots, n_ways=ways, n_queries=queries // ways, n_runs=t, balanced=balanced,
                           preprocess="MESV")
        ref.ds = ds  # soft_km reads the module-level ds
        probas_init = ref.SimpleWMask(ds).soft_km(ds.data, T=params["km_temperature"],
                                                  nIter=params["km_iterations"])
        scaling = ds.e_Swb_Udata.pow(-0.5).clamp(max=params["clip"])
        cluster = lib.VB_IsoGM(ds, scaling, 1.0 / params["vb_temperature"])
        mixture = lib.VB_SymDirMM(ds, alpha0=prior, fixedModel=balanced)
        model = lib.VB_EM(ds, mixtureModel=mixture, clusterModel=cluster)
        probas = model.loop(ds.rdata_b, probas_init, nIter=params["vb_iterations"])
    torch.set_default_dtype(default_dtype)
    return probas[:, ways * shots:].argmax(2)


def run_setting(name, features: FeatureSet, base: FeatureSet, shots, queries, alpha, args, ref, lib, rows):
    bank = sample_episode_bank(features.labels, 5, shots, queries, alpha, args.tasks, args.seed)
    gathered = bank.gather(features.features)
    batch, truth = gathered.batch, gathered.query_labels
    base_mean = base.features.double().mean(0)
    scatter = base_within_class_scatter(base.features, base.labels, base_mean)
    params = {"vb_temperature": args.vb_temperature, "clip": args.clip, "km_temperature": 10.0, "km_iterations": 5,
              "vb_iterations": 5}
    ref_params = {**params, "reference_dtype": args.reference_dtype}
    balanced = alpha is None
    label = f"{name} {shots}-shot {'balanced' if balanced else f'alpha={alpha:g}'}"
    variants = [("alpha0=2 (paper; ours: oracle_dirichlet_alpha=2)", 2.0, {"oracle_dirichlet_alpha": 2.0})]
    if not balanced:
        variants.append(("alpha0=1 (our fair default)", 1.0, {}))
    for prior_name, prior, extra in variants:
        ours = BAVARDAGE(balanced=balanced, shots=shots, base_mean=base_mean.float(), base_covariance=scatter,
                         **params, **extra)
        start = time.perf_counter()
        ours_pred = ours.predict(batch).argmax(2)
        ours_s = time.perf_counter() - start
        ours_acc = mean_and_ci95(task_accuracy(torch.nn.functional.one_hot(ours_pred, 5), truth))
        ref_acc, same, ref_s = (float("nan"), float("nan")), float("nan"), float("nan")
        if ref is not None:
            start = time.perf_counter()
            ref_pred = reference_predictions(ref, lib, batch, base, shots, queries, balanced, prior, ref_params)
            ref_s = time.perf_counter() - start
            ref_acc = mean_and_ci95(task_accuracy(torch.nn.functional.one_hot(ref_pred, 5), truth))
            same = (ref_pred == ours_pred).double().mean().item()
        rows.append((label, prior_name, ours_acc, ref_acc, same, args.tasks / ours_s, args.tasks / ref_s))
    fallback = BAVARDAGE(balanced=balanced, shots=shots, base_mean=base_mean.float(), **params)
    start = time.perf_counter()
    acc = mean_and_ci95(task_accuracy(fallback.predict(batch), truth))
    rows.append((label, "alpha0=1, no base scatter (ours only)", acc, (float("nan"),) * 2, float("nan"),
                 args.tasks / (time.perf_counter() - start), float("nan")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", help="local checkout of yhu01/BAVARDAGE")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vb-temperature", type=float, default=40.0, help="T_vb (PUTM's mini-ImageNet value)")
    parser.add_argument("--clip", type=float, default=1.0, help="clp (PUTM's mini-ImageNet value)")
    parser.add_argument("--omniglot", default=None,
                        help="folder with omniglot_{test,train}.pt (our feature format); without it: digits only")
    parser.add_argument("--reference-dtype", default="float64", choices=["float64", "float32"],
                        help="precision of the reference run (its published float32 fails on rank-deficient "
                             "features such as digits' always-zero pixels: negative eigenvalues -> NaN scaling)")
    parser.add_argument("--datasets", nargs="*", default=["digits", "omniglot"])
    args = parser.parse_args()
    ref, lib = load_reference(args.reference) if args.reference else (None, None)

    rows: list = []
    datasets = []
    if "digits" in args.datasets:
        datasets.append(("digits", digits_feature_set(list(range(3, 10))), digits_feature_set([0, 1, 2]), 75))
    folder = Path(args.omniglot) if args.omniglot else None
    test, train = (folder / "omniglot_test.pt", folder / "omniglot_train.pt") if folder else (None, None)
    if "omniglot" in args.datasets and folder is not None and test.exists() and train.exists():
        datasets.append(("omniglot", load_features(test), load_features(train), 15))
    for name, features, base, queries in datasets:
        for shots in (1, 5):
            for alpha in (2.0, None):
                run_setting(name, features, base, shots, queries, alpha, args, ref, lib, rows)

    print(f"\nBAVARDAGE, 5-way, {args.tasks} tasks, seed {args.seed}, T_vb={args.vb_temperature:g}, clp={args.clip:g}, "
          f"{torch.get_num_threads()} CPU threads, reference in {args.reference_dtype}")
    print(f"{'setting':32} {'prior':50} {'ours (%)':>13} {'reference (%)':>13} {'same pred':>9} "
          f"{'ours t/s':>8} {'ref t/s':>8}  within CI")
    for label, prior, (m, ci), (rm, rci), same, speed, rspeed in rows:
        inside = "" if math.isnan(rm) else ("yes" if abs(m - rm) <= ci + rci else "NO")
        print(f"{label:32} {prior:50} {100 * m:6.2f} ± {100 * ci:4.2f} {100 * rm:6.2f} ± {100 * rci:4.2f} "
              f"{100 * same:8.1f}% {speed:8.1f} {rspeed:8.1f}  {inside}")


if __name__ == "__main__":
    main()
