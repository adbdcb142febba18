#!/usr/bin/env python
"""Side-by-side check of our UNEM (Gaussian) against the authors' code on the same tasks and raw features.

The reference (a local checkout of github.com/ZhouLong0/UNEM-Transductive; ``--reference`` is its root or its
``UNEM_Gaussian`` folder) is imported with ``lightning_putm.studies.reference.import_from_checkout``: its
``src.methods.U_Paddle_embt.U_Paddle_EMBT`` (the ``U_PADDLE_EMBT_L`` model, ``diff_gamma_layers=True``) and, for
the training comparison, ``src.unroll_trainer.training``. Thin shims only: the model creates its parameters with
``device='cuda'``, so ``torch.tensor`` maps that to the CPU while the model is built; its ``Logger`` writes to a
temporary file; the trainer's per-iteration prints go to a null stream; the optimiser and scheduler are built
as ``U_Trainer.run_training`` builds them (Adam lr 0.1, StepLR(50, 0.5)).

Inference: the SAME learned parameters go to both sides (ours through ``params=``, theirs through
``load_state_dict``): the shipped default (``--params preset``: the authors' mini-ImageNet ResNet-18 values;
``--learned`` another), or
values fitted by our unrolled training on validation-class tasks (``--params fit``). Per setting: per-query
prediction agreement and both accuracies on the same tasks.

Training (``--compare-training``): our ``fit_params`` and the reference's ``training`` on the same validation
tasks, each from the reference's initialisation; the two parameter sets are then scored on the same test tasks
(by our inference; it equals theirs, see the first table).

    python benchmarks/fidelity_unem.py --reference /path/to/UNEM-Transductive
    python benchmarks/fidelity_unem.py --reference /path/to/UNEM-Transductive --params fit --compare-training \
        --omniglot-root /path/to/omniglot      # folder holding omniglot-py/

Digits: raw 64-d pixels; validation classes 0-4, test classes 5-9 (the fit must not see the test classes).
Omniglot: ``--omniglot-root``: raw 14×14 pooled pixels (196-d) of the real images, rotation 0, validation = ProtoNets'
172 held-out characters, test = the Vinyals test characters; or ``--omniglot DIR``: feature files
``omniglot_val.pt``/``omniglot_test.pt`` (e.g. Conv-4). 15 queries per task (20 images per character).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.features import FeatureSet, load_features
from lightning_putm.methods.unem import PRESETS, UNEM, UNEMParams, preset_params
from lightning_putm.methods.unem import unem_forward
from lightning_putm.methods.unem_fit import FitSettings, fit_params, unrolling_loss
from lightning_putm.metrics import mean_and_ci95, task_accuracy
from lightning_putm.studies.reference import import_from_checkout


# ------------------------------------------------------------------------------------------------ shims
def reference_root(path: str) -> Path:
    root = Path(path).expanduser()
    return root / "UNEM_Gaussian" if (root / "UNEM_Gaussian" / "src").is_dir() else root


@contextlib.contextmanager
def cuda_tensors_on_cpu():
    """The reference builds ``nn.Parameter(torch.tensor(v, device='cuda'))``: build them on the CPU instead."""
    original = torch.tensor

    def tensor(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return original(*args, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = original


def load_reference(path: str) -> types.SimpleNamespace:
    root = reference_root(path)
    embt = import_from_checkout(root, "src.methods.U_Paddle_embt")
    log = tempfile.NamedTemporaryFile(suffix=".log", delete=False).name
    return types.SimpleNamespace(root=root, embt=embt, log=log)


def reference_model(ref: types.SimpleNamespace, params: UNEMParams | None, layers: int = 10):
    with cuda_tensors_on_cpu():
        model = ref.embt.U_Paddle_EMBT(n_layers=layers, device="cpu", log_file=ref.log, diff_gamma_layers=True)
    if params is not None:
        state = {"t1": params.t1.clone()}
        state.update({f"gamma.{i}": g.clone() for i, g in enumerate(params.gamma)})
        state.update({f"t2.{i}": t.clone() for i, t in enumerate(params.t2)})
        model.load_state_dict(state)
    return model


def reference_task_dic(gathered) -> dict:
    """The reference's task dictionary: labels as ``[T, n, 1]`` (its ``squeeze(2)``), a dummy train mean."""
    batch = gathered.batch
    return {"x_s": batch.support.float(), "y_s": batch.support_labels.unsqueeze(2),
            "x_q": batch.query.float(), "y_q": gathered.query_labels.unsqueeze(2),
            "train_mean": torch.zeros(batch.dim)}


def run_reference(ref, gathered, params: UNEMParams) -> torch.Tensor:
    """Reference soft assignments ``[T, Q, N]`` (its ``run_task`` takes the argmax of exactly these)."""
    model = reference_model(ref, params)
    dic = reference_task_dic(gathered)
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # its tqdm bar
        return model.forward(dic["x_s"], dic["y_s"].squeeze(2), dic["x_q"], "cpu")


def train_reference(ref, gathered, iterations: int, lr: float) -> tuple[UNEMParams, list[float]]:
    """``src.unroll_trainer.training`` from the reference's initialisation, as ``U_Trainer.run_training`` calls it;
    the learned parameters and its loss per iteration."""
    trainer = import_from_checkout(ref.root, "src.unroll_trainer")
    model = reference_model(ref, None)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimiser, step_size=50, gamma=0.5)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        model, losses, _ = trainer.training(model, reference_task_dic(gathered), torch.nn.CrossEntropyLoss(),
                                            optimiser, scheduler, iterations, "cpu")
    state = model.state_dict()
    layers = len(model.gamma)
    return UNEMParams.from_values(float(state["t1"]), [float(state[f"gamma.{i}"]) for i in range(layers)],
                                  [float(state[f"t2.{i}"]) for i in range(layers)]), list(losses)


def normalised(gathered, normalise: str):
    """The gathered tasks with L2-normalised rows (``normalise == "l2"``), for the reference, which has no such step."""
    if normalise == "none":
        return gathered
    batch = gathered.batch
    return types.SimpleNamespace(
        batch=type(batch)(torch.nn.functional.normalize(batch.support, dim=2), batch.support_labels,
                          torch.nn.functional.normalize(batch.query, dim=2), batch.ways, batch.task_seeds),
        query_labels=gathered.query_labels)


def initial_gradients(ref, gathered, normalise: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of the unrolling loss at the reference's initialisation, ours and theirs, as flat
    ``[t1, gamma..., t2...]`` vectors: the first step of both trainings, before Adam amplifies anything."""
    ours = UNEMParams(*(p.clone().requires_grad_(True) for p in (UNEMParams.initial().t1, UNEMParams.initial().gamma,
                                                                 UNEMParams.initial().t2)))
    support, query = normalised(gathered, normalise).batch.support, normalised(gathered, normalise).batch.query
    loss = unrolling_loss(unem_forward(support, gathered.batch.one_hot_support(), query, ours), gathered.query_labels)
    loss.backward()
    mine = torch.cat([ours.t1.grad.view(1), ours.gamma.grad, ours.t2.grad])
    model = reference_model(ref, None)
    dic = reference_task_dic(normalised(gathered, normalise))
    with contextlib.redirect_stderr(io.StringIO()):
        out = model.forward(dic["x_s"], dic["y_s"].squeeze(2), dic["x_q"], "cpu")
    torch.nn.CrossEntropyLoss()(out.view(-1, out.size(-1)), dic["y_q"].squeeze(2).reshape(-1)).backward()
    theirs = torch.cat([model.t1.grad.view(1), torch.stack([g.grad for g in model.gamma]),
                        torch.stack([t.grad for t in model.t2])])
    return mine, theirs


# ------------------------------------------------------------------------------------------------ main
def datasets(args) -> list[tuple[str, FeatureSet, FeatureSet, int]]:
    found = []
    if "digits" in args.datasets:
        found.append(("digits raw 64-d", digits_feature_set([0, 1, 2, 3, 4]), digits_feature_set([5, 6, 7, 8, 9]), 75))
    if "omniglot" in args.datasets and args.omniglot:
        folder = Path(args.omniglot)
        val, test = folder / "omniglot_val.pt", folder / "omniglot_test.pt"
        if val.exists() and test.exists():
            found.append(("omniglot features", load_features(val), load_features(test), 15))
        else:
            print(f"skip omniglot: no {val} and {test}")
    elif "omniglot" in args.datasets and args.omniglot_root:
        found.append(("omniglot raw 196-d", omniglot_pixels(args.omniglot_root, "val", "vinyals_protonets"),
                      omniglot_pixels(args.omniglot_root, "test", "vinyals"), 15))
    return found


def omniglot_pixels(root: str, split: str, scheme: str) -> FeatureSet:
    """Real Omniglot, rotation 0, 28×28 ink in [0, 1] average-pooled 2×2 (196-d raw pixels, no backbone)."""
    from lightning_putm.data.omniglot import read_omniglot

    data = read_omniglot(root, split, scheme=scheme, rotations=(0,))
    pixels = torch.nn.functional.avg_pool2d(data.images.float() / 255.0, 2).flatten(1)
    return FeatureSet(pixels, data.labels, list(data.class_names), {"source": f"omniglot {split} raw 14x14 pixels"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="local checkout of ZhouLong0/UNEM-Transductive")
    parser.add_argument("--tasks", type=int, default=200, help="test tasks per setting")
    parser.add_argument("--fit-tasks", type=int, default=1000, help="validation tasks of a fit (reference: 1000)")
    parser.add_argument("--fit-iterations", type=int, default=100, help="Adam iterations of a fit (reference: 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shots", type=int, nargs="*", default=[1, 5])
    parser.add_argument("--params", choices=["preset", "fit"], default="preset",
                        help="preset = our default (authors' mini-ImageNet ResNet-18 values); fit = fitted by ours "
                             "on validation tasks (Dirichlet a=2), one fit per dataset and shot")
    parser.add_argument("--learned", default="mini_resnet18", choices=list(PRESETS),
                        help="with --params preset: which published values (method.unem.learned)")
    parser.add_argument("--compare-training", action="store_true",
                        help="also train with the reference's trainer and compare the accuracy of both fits")
    parser.add_argument("--normalise", choices=["none", "l2"], default="none",
                        help="our method.unem.normalise (and our fit's); the reference gets rows normalised the same")
    parser.add_argument("--loss", choices=["reference", "nll"], default="reference",
                        help="our fit's loss (--compare-training needs reference: the reference has only that one)")
    parser.add_argument("--gradients", action="store_true",
                        help="only compare the loss gradient at the initialisation (ours vs the reference's autograd) "
                             "on the fit tasks, then stop")
    parser.add_argument("--datasets", nargs="*", default=["digits", "omniglot"])
    parser.add_argument("--omniglot", default="", help="folder with omniglot_val.pt and omniglot_test.pt (features)")
    parser.add_argument("--omniglot-root", default="",
                        help="folder holding omniglot-py/: raw pooled pixels, validation = ProtoNets' 172 characters "
                             "(vinyals_protonets), test = the Vinyals test characters; used without --omniglot")
    args = parser.parse_args()
    if args.compare_training and args.loss != "reference":
        parser.error("--compare-training compares like with like: use --loss reference")
    ref = load_reference(args.reference)
    fit_settings = FitSettings(iterations=args.fit_iterations, loss=args.loss, normalise=args.normalise)
    rows, training_rows = [], []
    for name, val, test, queries in datasets(args):
        for shots in args.shots:
            if args.gradients:
                bank = sample_episode_bank(val.labels, 5, shots, queries, 2.0, args.fit_tasks, args.seed + 1)
                mine, theirs = initial_gradients(ref, bank.gather(val.features), args.normalise)
                rel = float((mine - theirs).abs().max() / theirs.abs().max())
                print(f"{name} {shots}-shot: gradient at the initialisation, {args.fit_tasks} fit tasks: max |ours - "
                      f"theirs| / max |theirs| = {rel:.1e}; |grad| ours {float(mine.abs().max()):.2e}, theirs "
                      f"{float(theirs.abs().max()):.2e}; sign agreement "
                      f"{float((mine.sign() == theirs.sign()).double().mean()):.2f}", flush=True)
                continue
            fitted = trained = None
            if args.params == "fit" or args.compare_training:
                fit_bank = sample_episode_bank(val.labels, 5, shots, queries, 2.0, args.fit_tasks, args.seed + 1)
                fit_tasks = fit_bank.gather(val.features)
                start = time.perf_counter()
                fitted, history = fit_params(fit_tasks.batch, fit_tasks.query_labels, fit_settings)
                fit_s = time.perf_counter() - start
                print(f"{name} {shots}-shot: our fit {fit_s:.0f} s, loss {history[0]:.4f} -> {history[-1]:.4f}",
                      flush=True)
                if args.compare_training:
                    start = time.perf_counter()
                    trained, their_history = train_reference(ref, normalised(fit_tasks, args.normalise),
                                                             args.fit_iterations, fit_settings.lr)
                    print(f"{name} {shots}-shot: reference training {time.perf_counter() - start:.0f} s", flush=True)
            params = fitted if args.params == "fit" else preset_params(args.learned, shots)
            for sampling, alpha in (("dirichlet a=2", 2.0), ("balanced", None)):
                try:
                    bank = sample_episode_bank(test.labels, 5, shots, queries, alpha, args.tasks, args.seed)
                except ValueError as exc:
                    print(f"skip {name} {shots}-shot {sampling}: {exc}")
                    continue
                gathered = bank.gather(test.features)
                ours = UNEM(shots=shots, params=params, normalise=args.normalise).predict(gathered.batch)
                theirs = run_reference(ref, normalised(gathered, args.normalise), params)
                our_acc = task_accuracy(ours, gathered.query_labels)
                their_acc = task_accuracy(theirs, gathered.query_labels)
                same = float((ours.argmax(2) == theirs.argmax(2)).double().mean())
                gap = float((ours - theirs).abs().max())
                rows.append((f"{name} {shots}-shot {sampling}", *mean_and_ci95(our_acc), *mean_and_ci95(their_acc),
                             same, gap))
                print(rows[-1], flush=True)
                if trained is not None:
                    a = task_accuracy(UNEM(shots=shots, params=fitted, normalise=args.normalise).predict(
                        gathered.batch), gathered.query_labels)
                    b = task_accuracy(UNEM(shots=shots, params=trained, normalise=args.normalise).predict(
                        gathered.batch), gathered.query_labels)
                    # gamma_0 multiplies the constant v = 1 of the first layer: no effect, zero gradient up to
                    # rounding, which Adam turns into steps of ~lr; it is left out of the parameter difference.
                    diff = torch.cat([(fitted.t1 - trained.t1).view(1), fitted.gamma[1:] - trained.gamma[1:],
                                      fitted.t2 - trained.t2]).abs().max()
                    training_rows.append((f"{name} {shots}-shot {sampling}", *mean_and_ci95(a), *mean_and_ci95(b),
                                          float(diff), history[-1], their_history[-1]))
                    print(training_rows[-1], flush=True)

    print(f"\nUNEM inference: ours vs reference (ZhouLong0/UNEM-Transductive U_PADDLE_EMBT_L) with the same parameters "
          f"({args.learned if args.params == 'preset' else f'fit, loss {args.loss}'}), normalise {args.normalise}, "
          f"same {args.tasks} tasks per setting, seed {args.seed}, 5-way; accuracy % (95% CI)")
    print(f"{'setting':40} {'ours':>14} {'reference':>14} {'same pred':>9} {'max |dp|':>9}")
    for setting, m, ci, rm, rci, same, gap in rows:
        print(f"{setting:40} {100 * m:6.2f} ± {100 * ci:4.2f} {100 * rm:6.2f} ± {100 * rci:4.2f} "
              f"{100 * same:8.2f}% {gap:9.1e}")
    if training_rows:
        print(f"\nUNEM training: our fit_params vs the reference's training on the same {args.fit_tasks} validation "
              f"tasks (Dirichlet a=2, seed {args.seed + 1}), {args.fit_iterations} iterations; accuracy of each fit on "
              "the test tasks above")
        print(f"{'setting':40} {'our fit':>14} {'their fit':>14} {'in CI':>6} {'max |dparam|':>12} "
              f"{'last loss ours/theirs':>22}")
        for setting, m, ci, rm, rci, diff, last, their_last in training_rows:
            inside = abs(m - rm) <= ci + rci
            print(f"{setting:40} {100 * m:6.2f} ± {100 * ci:4.2f} {100 * rm:6.2f} ± {100 * rci:4.2f} "
                  f"{'yes' if inside else 'NO':>6} {diff:12.2e} {last:10.4f} / {their_last:.4f}")


if __name__ == "__main__":
    sys.exit(main())
