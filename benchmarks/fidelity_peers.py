#!/usr/bin/env python
"""Side-by-side fidelity check of our peer methods against the realistic-imbalance benchmark's code.

The peer numbers of PUTM's Table 1 come from the code of Veilleux et al. (NeurIPS 2021,
github.com/oveilleux/Realistic_Transductive_Few_Shot). This script runs ITS SimpleShot, PT-MAP, TIM-GD, α-TIM,
BD-CSPN and LaplacianShot (imported from a local checkout given by ``--benchmark``, driven through thin shims
defined here: a pass-through feature "model", a fake args object, quiet logging, captured predictions) and OURS
(``build_method`` with our defaults) on the same episode bank, and prints per method and setting both
accuracies (mean ± 95% CI over tasks) and the share of identical per-query predictions.

Settings: 2 feature sets × {1, 5} shots × {Dirichlet α = 2, balanced}, 5-way:

* ``digits``: scikit-learn's digits, raw 64-d pixels, 75 queries; no base split, so L2N (the benchmark's
  ``norm_type: L2N``) for the CL2N methods;
* ``omniglot``: Conv-4 64-d features (``--omniglot-test``, our feature format), 15 queries, CL2N with the mean
  of the base split's features (``--omniglot-base``) as ``train_mean``.

The benchmark's hyper-parameters are those of its ``config/<dirichlet|balanced>/methods_config/*.yaml`` (tuned
λ / α tables read with ``--arch``/``--dataset``, default WRN-28-10 miniImageNet, the row our defaults use).
``--variants`` also runs our non-default options (BD-CSPN ``variant=paper``, LaplacianShot ``affinity=symmetric``,
``energy=half``, ``proto_rect`` flipped) and prints their accuracy and paired difference to our default.

    python benchmarks/fidelity_peers.py --benchmark /path/to/Realistic_Transductive_Few_Shot
    python benchmarks/fidelity_peers.py --benchmark PATH --methods bdcspn,laplacianshot --features digits --variants

The benchmark's code is only imported from PATH at run time; nothing of it is part of this repository.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.methods import build_method
from lightning_putm.metrics import mean_and_ci95, task_accuracy
from lightning_putm.studies.reference import import_from_checkout

METHODS = ["simpleshot", "ptmap", "tim", "alpha_tim", "bdcspn", "laplacianshot"]
WAYS = 5
#: our non-default options whose effect --variants measures: (method, label, params)
VARIANTS = [
    ("bdcspn", "variant=paper", {"variant": "paper"}),
    ("laplacianshot", "affinity=symmetric", {"affinity": "symmetric"}),
    ("laplacianshot", "energy=half", {"energy": "half"}),
    ("laplacianshot", "proto_rect flipped", None),  # None: the opposite of the per-protocol default
]


# ----------------------------------------------------------------------------------------- shims for their code
class _PassThroughModel:
    """Their methods call ``model(x, feature=True)`` on images; ours hands them features: return them as they are."""

    def __call__(self, x: torch.Tensor, feature: bool = True):
        return x, None

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self


class _QuietLogger:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def info(self, *args, **kwargs) -> None:
        pass

    def del_logger(self) -> None:
        pass


def _no_tqdm(iterable=None, *args, **kwargs):
    return iterable


def load_benchmark(path: str) -> dict[str, types.ModuleType]:
    """Import the benchmark's method modules from a local checkout (its ``src`` package)."""
    root = Path(path).resolve()
    if not (root / "src" / "methods" / "laplacianshot.py").is_file():
        raise SystemExit(f"{root} is not a checkout of oveilleux/Realistic_Transductive_Few_Shot (no src/methods)")
    if not hasattr(np, "float"):  # their LaplacianShot builds its sparse affinity with dtype=np.float (numpy < 1.24)
        np.float = float  # type: ignore[attr-defined]
    modules = {name: import_from_checkout(root, f"src.methods.{name}", flag="--benchmark")
               for name in ("simpleshot", "pt_map", "tim", "bdcspn", "laplacianshot")}
    for module in modules.values():
        module.Logger = _QuietLogger
        module.tqdm = _no_tqdm
    return modules


def _args(**values) -> types.SimpleNamespace:
    return types.SimpleNamespace(**values)


def _task_dict(support: torch.Tensor, support_labels: torch.Tensor, query: torch.Tensor, query_labels: torch.Tensor,
               shots: int, train_mean: torch.Tensor) -> dict:
    """Their task layout: support rows cycle through the classes (row r*N + k is shot r of class k)."""
    order = torch.tensor([k * shots + r for r in range(shots) for k in range(WAYS)])
    y_s = support_labels[:, order]
    if not bool((y_s == torch.arange(WAYS).repeat(shots)).all()):
        raise RuntimeError("expected class-major support rows from the episode bank")
    return {"x_s": support[:, order].clone(), "y_s": y_s.unsqueeze(2), "x_q": query.clone(),
            "y_q": query_labels.unsqueeze(2), "train_mean": train_mean}


def run_theirs(modules: dict, method: str, tasks: dict, shots: int, balanced: bool, norm_type: str,
               arch: str, dataset: str, log_file: str) -> torch.Tensor:
    """Per-query predictions ``[T, Q]`` of their implementation with their config for this protocol."""
    t, q = tasks["x_q"].shape[:2]
    common = dict(n_ways=WAYS, batch_size=t, n_query=q // WAYS)
    model, captured = _PassThroughModel(), {}
    if method in ("simpleshot", "bdcspn"):
        cls = modules[method].SimpleShot if method == "simpleshot" else modules[method].BDCSPN
        runner = cls(model, "cpu", log_file, _args(norm_type=norm_type, num_NN=1, **common))

        def record(y_q, pred_q, new_time=None):
            captured["pred"] = torch.as_tensor(np.asarray(pred_q)).reshape(t, q)

        runner.record_info = record
        runner.get_logs = lambda: {}
    elif method == "ptmap":
        runner = modules["pt_map"].PT_MAP(model, "cpu", log_file,
                                          _args(beta=0.5, lam=10, alpha=0.2, n_epochs=20, **common))
        # torch.qr (their call) is gone from recent PyTorch; torch.linalg.qr(mode="reduced") is its replacement
        runner.QRreduction = lambda data: torch.linalg.qr(data.permute(0, 2, 1), mode="reduced").R.permute(0, 2, 1)

        def record(y_q, pred_q, new_time=None):
            captured["pred"] = pred_q.argmax(2)

        runner.record_info = record
        runner.get_logs = lambda: {}
    elif method in ("tim", "alpha_tim"):
        if method == "tim":
            weights = [1.0, 10, 1.0] if balanced else [1.0, 1.0, 1.0]
            runner = modules["tim"].TIM_GD(model, "cpu", log_file, _args(temp=15, loss_weights=weights, lr_tim=1e-4,
                                                                         iter=1000, alpha=1.0, **common))
        else:
            runner = modules["tim"].ALPHA_TIM(model, "cpu", log_file, _args(
                temp=15, loss_weights=[1.0, 1.0, 1.0], lr_alpha_tim=1e-4, iter=1000, entropies=["Shannon", "Alpha", "Alpha"],
                alpha_values=[5.0, 5.0, 5.0], use_tuned_alpha_values=True, **common))

        def record(new_time, support, query, y_s, y_q):
            captured["query"] = query

        runner.record_info = record
        runner.get_logs = lambda: {}
    elif method == "laplacianshot":
        runner = modules["laplacianshot"].LaplacianShot(model, "cpu", log_file, _args(
            knn=3, arch=arch, balanced="balanced" if balanced else "dirichlet", dataset=dataset,
            proto_rect=balanced, norm_type=norm_type, iter=20, shots=[1, 5, 10, 20], use_tuned_lmd=True, lmd=None,
            **common))
        original = runner.bound_update
        predictions = []

        def bound_update(*args, **kwargs):
            out = original(*args, **kwargs)
            predictions.append(out[0][-1])
            return out

        runner.bound_update = bound_update
        runner.record_info = lambda *a, **k: None
        runner.get_logs = lambda: {}
    else:
        raise ValueError(method)
    with contextlib.redirect_stdout(io.StringIO()):
        runner.run_task(task_dic=tasks, shot=shots)
    if method in ("tim", "alpha_tim"):
        with torch.no_grad():
            return runner.get_preds(captured["query"]).cpu()
    if method == "laplacianshot":
        return torch.stack(predictions).long()
    return captured["pred"].long()


# ----------------------------------------------------------------------------------------- settings
def feature_sets(which: list[str], args) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None, int]]:
    """(name, features, labels, base mean or None, queries)."""
    sets = []
    if "digits" in which:
        digits = digits_feature_set()
        sets.append(("digits", digits.features, digits.labels, None, 75))
    if "omniglot" in which:
        from lightning_putm.features.files import load_features

        if not args.omniglot_test or not Path(args.omniglot_test).is_file():
            print(f"skipping omniglot: no feature file ({args.omniglot_test or 'pass --omniglot-test FILE'})")
        else:
            test = load_features(args.omniglot_test)
            has_base = bool(args.omniglot_base) and Path(args.omniglot_base).is_file()
            base = load_features(args.omniglot_base).features.mean(0) if has_base else None
            if base is None:
                print(f"notice: {args.omniglot_base} not found; omniglot uses L2N")
            sets.append(("omniglot", test.features, test.labels, base, args.omniglot_queries))
    return sets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", help="local checkout of oveilleux/Realistic_Transductive_Few_Shot")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--features", default="digits,omniglot", help="comma-separated subset of digits,omniglot")
    parser.add_argument("--shots", default="1,5")
    parser.add_argument("--omniglot-test", default=None,
                        help="Omniglot test-split features in our .pt format; without it the omniglot settings are skipped")
    parser.add_argument("--omniglot-base", default=None,
                        help="Omniglot train-split features (.pt) whose mean CL2N subtracts; without it: L2N")
    parser.add_argument("--omniglot-queries", type=int, default=15)
    parser.add_argument("--arch", default="wideres", help="row of their tuned lambda table (wideres, resnet18)")
    parser.add_argument("--dataset", default="mini", help="row of their tuned lambda table (mini, tiered, cub)")
    parser.add_argument("--variants", action="store_true", help="also measure our non-default options")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    modules = load_benchmark(args.benchmark) if args.benchmark else None
    log_file = os.path.join(tempfile.mkdtemp(prefix="fidelity_peers_"), "log.txt")

    header = (f"{'features':9} {'shot':>4} {'sampling':9} {'method':14} {'ours (%)':>13} {'benchmark (%)':>13} "
              f"{'identical':>9} {'s ours':>7} {'s theirs':>8}")
    rows, variant_rows, notes = [], [], []
    for set_name, features, labels, base_mean, queries in feature_sets(args.features.split(","), args):
        norm_type = "L2N" if base_mean is None else "CL2N"
        train_mean = torch.zeros(features.shape[1]) if base_mean is None else base_mean
        for shots in (int(s) for s in args.shots.split(",")):
            for sampling, alpha in (("dirichlet", 2.0), ("balanced", None)):
                bank = sample_episode_bank(labels, WAYS, shots, queries, alpha, args.tasks, args.seed)
                gathered = bank.gather(features)
                batch, query_labels = gathered.batch, gathered.query_labels
                balanced = alpha is None
                context = dict(shots=shots, balanced=balanced, base_mean=base_mean)
                for method in methods:
                    ours = build_method(method, {}, **context)
                    start = time.perf_counter()
                    probs = ours.predict(batch)
                    ours_s = time.perf_counter() - start
                    ours_pred = probs.argmax(2)
                    ours_acc = task_accuracy(probs, query_labels)
                    if method == "bdcspn":
                        empty = int((ours.last_state["rows_per_class"] == 0).sum())
                        notes.append(f"{set_name} {shots}-shot {sampling}: BD-CSPN classes with no pseudo-labelled "
                                     f"row: {empty} of {args.tasks * WAYS}")
                    line = [set_name, shots, sampling, method, *mean_and_ci95(ours_acc), ours_s]
                    if modules is not None:
                        tasks = _task_dict(batch.support, batch.support_labels, batch.query, query_labels, shots,
                                           train_mean)
                        start = time.perf_counter()
                        theirs = run_theirs(modules, method, tasks, shots, balanced, norm_type, args.arch,
                                            args.dataset, log_file)
                        theirs_s = time.perf_counter() - start
                        theirs_acc = (theirs == query_labels).double().mean(1)
                        same = float((theirs == ours_pred).double().mean())
                        line += [*mean_and_ci95(theirs_acc), same, theirs_s]
                    rows.append(line)
                    print(_format(line), flush=True)
                    if args.variants:
                        for v_method, label, params in VARIANTS:
                            if v_method != method:
                                continue
                            if params is None:
                                params = {"proto_rect": not balanced}
                                label = f"proto_rect={str(not balanced).lower()}"
                            other = build_method(method, params, **context).predict(batch)
                            diff = task_accuracy(other, query_labels) - ours_acc
                            variant_rows.append((set_name, shots, sampling, method, label,
                                                 *mean_and_ci95(task_accuracy(other, query_labels)),
                                                 *mean_and_ci95(diff),
                                                 float((other.argmax(2) == ours_pred).double().mean())))
                            print("   ", _format_variant(variant_rows[-1]), flush=True)

    print(f"\n5-way, {args.tasks} tasks per setting, seed {args.seed}; digits: raw pixels, 75 queries, L2N; omniglot: "
          f"Conv-4 features, {args.omniglot_queries} queries, CL2N with the base-split mean. Dirichlet alpha = 2.")
    print(header)
    for line in rows:
        print(_format(line))
    if variant_rows:
        print("\nour non-default options (accuracy, paired difference to our default, share of identical predictions)")
        for row in variant_rows:
            print(_format_variant(row))
    for note in notes:
        print(note)


def _format(line: list) -> str:
    set_name, shots, sampling, method, mean, ci, ours_s = line[:7]
    text = f"{set_name:9} {shots:>4} {sampling:9} {method:14} {100 * mean:6.2f} ± {100 * ci:4.2f}"
    if len(line) > 7:
        t_mean, t_ci, same, theirs_s = line[7:]
        text += f" {100 * t_mean:6.2f} ± {100 * t_ci:4.2f} {100 * same:8.2f}% {ours_s:7.1f} {theirs_s:8.1f}"
    else:
        text += f" {'-':>13} {'-':>9} {ours_s:7.1f}"
    return text


def _format_variant(row: tuple) -> str:
    set_name, shots, sampling, method, label, mean, ci, diff, diff_ci, same = row
    return (f"{set_name:9} {shots:>4} {sampling:9} {method:14} {label:22} {100 * mean:6.2f} ± {100 * ci:4.2f}  "
            f"diff {100 * diff:+6.2f} ± {100 * diff_ci:4.2f}  identical {100 * same:6.2f}%")


if __name__ == "__main__":
    main()
