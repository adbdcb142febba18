#!/usr/bin/env python
"""Side-by-side check of our iLPC against the iLPC reference code on the same episode bank.

The reference (a local checkout of github.com/MichalisLazarou/iLPC) is imported from ``--reference`` with
``lightning_putm.studies.reference.import_from_checkout``; only thin shims live here: an exact numpy inner-product kNN in place of faiss (not installed),
``Tensor.cuda`` as a no-op, scipy's ``cg(tol=)`` spelled ``rtol=`` for scipy >= 1.14, ``np.in1d`` as
``np.isin`` (numpy >= 2.4), an ``opt`` namespace with the settings, and the reference's preprocessing steps
(signed power transform from ``transductive_wrn.py``'s ``__main__``, then its own ``scaleEachUnitaryDatas`` /
``centerDatas``). Each reference task runs after
``torch.manual_seed(task_seed)``: its ``nn.Linear`` then draws the same random bias as ours.

Reference variants per row (ours in brackets):
* ``uniform`` — the reference as published: Sinkhorn to the remaining ``Q/N`` per class [balance=uniform;
  our default on balanced tasks];
* ``none`` — the reference with its ``compute_optimal_transport`` call removed, which is exactly the iLPC PUTM
  ran (RashLog/PUTM ``iterative_graph_functions.py`` has that call commented out) [balance=none; our default
  on Dirichlet tasks];
* ``oracle`` (``--variants`` only) — the reference's ``unbalanced`` mode, Sinkhorn to the TRUE remaining
  counts [oracle_prior]: a leak of the test labels' class counts, shown only to check the code path.

    python benchmarks/fidelity_ilpc.py --reference /path/to/iLPC
    python benchmarks/fidelity_ilpc.py --reference /path/to/iLPC --variants --no-digits \
        --omniglot /path/to/omniglot_test.pt

With fewer than ``k + 1`` rows (Omniglot 1-shot, 15 queries) the reference cannot build its graph (faiss pads
with index -1); it then runs with ``K = n - 1``, which is what our ``k`` cap does by itself. There its cubed
negative similarities give negative degrees (NaN): our default ``positive_affinity=true`` (the paper's
``[s]_+^γ``) departs from it on such tasks only; ``--ours positive_affinity=false`` follows the code.

Done when, per setting, our mean is within the combined 95% CI of the reference's on the same tasks.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import yaml

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.features.files import load_features
from lightning_putm.methods import build_method
from lightning_putm.metrics import mean_and_ci95, task_accuracy
from lightning_putm.studies.reference import import_from_checkout


# ------------------------------------------------------------------------------------------------ shims
def _faiss_shim() -> types.ModuleType:
    """Exact inner-product kNN with faiss's interface (the reference uses IndexFlatIP, an exact search)."""

    class IndexFlatIP:
        def __init__(self, d: int, *_: object) -> None:
            self.rows = np.zeros((0, d), dtype=np.float32)

        def add(self, x: np.ndarray) -> None:
            self.rows = np.asarray(x, dtype=np.float32).copy()

        @property
        def ntotal(self) -> int:
            return len(self.rows)

        def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
            sims = np.asarray(x, dtype=np.float32) @ self.rows.T
            index = np.argsort(-sims, axis=1, kind="stable")[:, :k]
            return np.take_along_axis(sims, index, axis=1), index

    def normalize_l2(x: np.ndarray) -> None:
        x /= np.linalg.norm(x, axis=1, keepdims=True)

    module = types.ModuleType("faiss")
    module.IndexFlatIP = IndexFlatIP
    module.GpuIndexFlatIP = lambda res, d, config=None: IndexFlatIP(d)
    module.StandardGpuResources = lambda: None
    module.GpuIndexFlatConfig = lambda: types.SimpleNamespace(device=0)
    module.normalize_L2 = normalize_l2
    return module


def load_reference(path: str) -> types.ModuleType:
    sys.modules.setdefault("faiss", _faiss_shim())
    import matplotlib

    matplotlib.use("Agg")
    igf = import_from_checkout(path, "iterative_graph_functions")  # the reference's own module
    import scipy.sparse.linalg as spla

    cg = spla.cg

    def cg_tol(a, b, tol=None, **kwargs):  # scipy >= 1.14 only knows rtol
        if tol is not None:
            kwargs.setdefault("rtol", tol)
        return cg(a, b, **kwargs)

    spla.cg = cg_tol
    torch.Tensor.cuda = lambda self, *a, **k: self  # the reference moves Sinkhorn to the GPU
    if not hasattr(np, "in1d"):  # removed in numpy 2.4; np.isin is its documented replacement
        np.in1d = np.isin
    igf._published_ot = igf.compute_optimal_transport
    return igf


def reference_preprocess(igf: types.ModuleType, rows: torch.Tensor) -> torch.Tensor:
    """transductive_wrn.py: signed power 0.5 (flip negatives, (x + 1e-6)^0.5, flip back), then its helpers."""
    x = rows.clone()
    negative = x < 0
    x[negative] *= -1
    x = torch.pow(x + 1e-6, 0.5)
    x[negative] *= -1
    return igf.centerDatas(igf.scaleEachUnitaryDatas(x))


def run_reference(igf, gathered, variant: str, ways: int, settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions ``[T, Q]`` (original query order) and accuracies ``[T]`` of the reference."""
    batch = gathered.batch
    rows = reference_preprocess(igf, torch.cat([batch.support, batch.query], 1).float())
    s, q = batch.num_support, batch.num_queries
    counts = torch.nn.functional.one_hot(gathered.query_labels, ways).sum(1).numpy()
    if variant == "none":
        igf.compute_optimal_transport = lambda opt, m: (m.numpy(), np.argmax(m.numpy(), 1), None)
    else:
        igf.compute_optimal_transport = igf._published_ot
    predictions = torch.empty(batch.num_tasks, q, dtype=torch.long)
    for i in range(batch.num_tasks):
        # K capped at n - 1 as ours (faiss would pad with index -1, which the reference cannot use)
        opt = types.SimpleNamespace(K=min(settings["k"], s + q - 1), alpha=settings["alpha"], T=settings["power"],
                                    sinkhorn_iter=settings["sinkhorn_passes"],
                                    denoising_iterations=settings["denoising_iterations"],
                                    best_samples=settings["best_samples"], n_ways=ways,
                                    unbalanced=variant == "oracle",
                                    no_samples=counts[i].astype(float) if variant == "oracle"
                                    else np.repeat(float(q / ways), ways))
        torch.manual_seed(int(batch.task_seeds[i]))
        try:
            order, pred = igf.iter_balanced_trans(
                opt, rows[i, :s].numpy(), batch.support_labels[i].numpy(), rows[i, s:].numpy(), np.arange(q), s)
        except Exception:
            print(f"reference failed on task {i} (seed {int(batch.task_seeds[i])}, variant {variant})", flush=True)
            raise
        predictions[i, torch.as_tensor(np.asarray(order, dtype=np.int64))] = torch.as_tensor(
            np.asarray(pred, dtype=np.int64))
    return predictions, (predictions == gathered.query_labels).double().mean(1)


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="local checkout of MichalisLazarou/iLPC")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shots", type=int, nargs="*", default=[1, 5])
    parser.add_argument("--variants", action="store_true",
                        help="also the non-default variants: uniform on Dirichlet tasks, none on balanced, oracle")
    parser.add_argument("--ours", nargs="*", default=[], metavar="KEY=VALUE",
                        help="overrides of our iLPC, e.g. positive_affinity=false")
    parser.add_argument("--no-digits", action="store_true", help="skip the digits settings")
    parser.add_argument("--omniglot", default="",
                        help="our-format feature file (Conv-4 Omniglot test split); skipped if not given or missing")
    parser.add_argument("--omniglot-queries", type=int, nargs="*", default=[15, 75],
                        help="queries per Omniglot task (in all, not per class; 20 images per class)")
    args = parser.parse_args()
    overrides = {key: yaml.safe_load(value) for key, value in (kv.split("=", 1) for kv in args.ours)}
    igf = load_reference(args.reference)
    from lightning_putm.methods.ilpc import ILPC

    ours = ILPC()
    ours = getattr(ours, "settings", ours)  # our defaults (a settings object, or the method's attributes)
    settings = {k: getattr(ours, k) for k in (
        "k", "alpha", "power", "sinkhorn_passes", "denoising_iterations", "best_samples")}
    settings.update({k: v for k, v in overrides.items() if k in settings})

    datasets = [] if args.no_digits else [("digits raw 64-d", digits_feature_set(), 75)]
    if args.omniglot and Path(args.omniglot).exists():
        omniglot = load_features(args.omniglot)
        datasets += [(f"omniglot conv4 64-d Q={q}", omniglot, q) for q in args.omniglot_queries]
    rows = []
    for data_name, feature_set, queries in datasets:
        for shots in args.shots:
            for sampling, alpha in (("dirichlet a=2", 2.0), ("balanced", None)):
                try:
                    bank = sample_episode_bank(feature_set.labels, 5, shots, queries, alpha, args.tasks, args.seed)
                except ValueError as exc:
                    print(f"skip {data_name} {shots}-shot {sampling}: {exc}")
                    continue
                gathered = bank.gather(feature_set.features)
                default = "uniform" if alpha is None else "none"
                variants = [default]
                if args.variants:
                    variants += ["none" if alpha is None else "uniform", "oracle"]
                for variant in variants:
                    params = dict(overrides) if variant == "oracle" else {**overrides, "balance": variant}
                    method = build_method("ilpc", params, shots=shots, balanced=alpha is None,
                                          query_counts=bank.query_counts if variant == "oracle" else None)
                    start = time.perf_counter()
                    ours = method.predict(gathered.batch)
                    ours_s = time.perf_counter() - start
                    start = time.perf_counter()
                    theirs, their_acc = run_reference(igf, gathered, variant, 5, settings)
                    theirs_s = time.perf_counter() - start
                    our_acc = task_accuracy(ours, gathered.query_labels)
                    same = float((ours.argmax(2) == theirs).double().mean())
                    label = variant + (" (default)" if variant == default else "")
                    rows.append((f"{data_name} {shots}-shot {sampling}", label,
                                 *mean_and_ci95(our_acc), *mean_and_ci95(their_acc), same,
                                 args.tasks / ours_s, args.tasks / theirs_s))
                    print(rows[-1], flush=True)

    print(f"\niLPC: ours vs reference (MichalisLazarou/iLPC) on the same {args.tasks} tasks per setting, seed "
          f"{args.seed}, 5-way; accuracy in % (95% CI); speed on this machine, torch threads {torch.get_num_threads()}"
          + (f"; ours with {overrides}" if overrides else ""))
    print(f"{'setting':44} {'balance':18} {'ours':>14} {'reference':>14} {'same pred':>9} {'in CI':>6} "
          f"{'ours t/s':>8} {'ref t/s':>8}")
    for setting, variant, m, ci, rm, rci, same, speed, rspeed in rows:
        inside = abs(m - rm) <= ci + rci
        print(f"{setting:44} {variant:18} {100 * m:6.2f} ± {100 * ci:4.2f} {100 * rm:6.2f} ± {100 * rci:4.2f} "
              f"{100 * same:8.1f}% {'yes' if inside else 'NO':>6} {speed:8.2f} {rspeed:8.2f}")


if __name__ == "__main__":
    main()
