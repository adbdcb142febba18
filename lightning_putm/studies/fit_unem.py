"""Fit UNEM's parameters on the validation classes of a feature file, once, and cache the result
(Zhou et al., CVPR 2025: the hyper-parameters of every unrolled EM step are learned on validation tasks).

    python -m lightning_putm fit-unem --features val.pt --shots 1 5 --out 'unem_{shots}shot.json'
    python evaluate.py features=test.pt 'methods=[unem]' 'method.unem.params_file=unem_{shots}shot.json'

:func:`fit_unem_cached` draws the seeded validation episodes (the evaluation's own episode bank), runs
:func:`lightning_putm.methods.unem_fit.fit_params` and writes the JSON. The cache key is the SHA-256 of the
features and labels plus every setting of the fit, so a second call with the same inputs reads the file instead of
fitting again. Give it validation features only: fitting on the test classes would leak their labels.

``--queries auto`` (the default) takes the reference's 75 queries per task where the validation classes hold
them, else the largest count they do (per shot count, printed); a ``--queries N`` they do not hold is an error
that names one that works. (``evaluate.py checkpoint=...`` fits on the checkpoint's validation classes by itself:
:mod:`lightning_putm.evaluation.unem_default`.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from lightning_putm.methods.peer_settings import FitSettings
from lightning_putm.validators import parse_alpha

if TYPE_CHECKING:  # the fit imports torch and the data itself: --help needs neither
    from lightning_putm.features import FeatureSet
    from lightning_putm.methods.unem import UNEMParams

DEFAULT_CACHE = Path("outputs") / "unem_params"
#: The reference's queries per task (``--queries auto`` takes fewer where the validation classes are too small).
REFERENCE_QUERIES = 75


def fit_key(feature_set: FeatureSet, episodes: dict, settings: FitSettings) -> str:
    """SHA-256 (16 hex digits) of the features, labels, episode settings and fit settings."""
    digest = hashlib.sha256()
    digest.update(feature_set.features.detach().cpu().float().contiguous().numpy().tobytes())
    digest.update(feature_set.labels.detach().cpu().long().contiguous().numpy().tobytes())
    digest.update(json.dumps({"episodes": episodes, "fit": asdict(settings)}, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def fit_unem_cached(feature_set: FeatureSet, shots: int, *, ways: int = 5, queries: int = 75,
                    alpha: float | None = 2.0, tasks: int = 1000, seed: int = 0,
                    settings: FitSettings = FitSettings(), out: str | Path | None = None,
                    cache_dir: str | Path = DEFAULT_CACHE, log=print) -> tuple[Path, UNEMParams]:
    """Fit on ``tasks`` seeded ``ways``-way ``shots``-shot episodes of ``feature_set`` (validation classes; Dirichlet
    ``alpha``, ``None`` = balanced) and write the JSON to ``out`` (default ``cache_dir/unem_<key>.json``). An existing
    file with the same key is read instead of fitting again."""
    from lightning_putm.data.episodes import sample_episode_bank
    from lightning_putm.methods.unem import load_params
    from lightning_putm.methods.unem_fit import fit_params, save_params

    episodes = {"ways": ways, "shots": shots, "queries": queries, "alpha": alpha, "tasks": tasks, "seed": seed}
    key = fit_key(feature_set, episodes, settings)
    path = Path(out) if out is not None else Path(cache_dir) / f"unem_{key}.json"
    if path.is_file():
        try:
            cached_key = json.loads(path.read_text()).get("meta", {}).get("key")
        except (OSError, ValueError):
            cached_key = None
        if cached_key == key:
            log(f"unem fit: cached parameters {path} (key {key})")
            return path, load_params(path)
    bank = sample_episode_bank(feature_set.labels, ways, shots, queries, alpha, tasks, seed)
    gathered = bank.gather(feature_set.features.float())
    params, history = fit_params(gathered.batch, gathered.query_labels, settings)
    meta = {"key": key, "episodes": episodes, "fit": asdict(settings), "loss_first": history[0] if history else None,
            "loss_last": history[-1] if history else None, "source": feature_set.metadata.get("source", "")}
    save_params(path, params, meta)
    log(f"unem fit: {tasks} tasks, loss {meta['loss_first']} -> {meta['loss_last']}; wrote {path}")
    return path, params


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``python -m lightning_putm fit-unem``: one fit per ``--shots``, each printed as the option that uses it."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", required=True, help="feature file of the VALIDATION classes (our format)")
    parser.add_argument("--shots", type=int, nargs="+", required=True, help="one fit per shot count")
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--queries", default="auto", help=f"queries per task; auto = {REFERENCE_QUERIES} (the "
                                                           "reference's) or the largest the classes hold")
    parser.add_argument("--alpha", default="2", help="Dirichlet alpha of the fit's tasks, or 'balanced'")
    parser.add_argument("--tasks", type=int, default=1000, help="validation tasks (the reference uses 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=FitSettings.iterations)
    parser.add_argument("--loss", choices=["reference", "nll"], default=FitSettings.loss)
    parser.add_argument("--normalise", choices=["none", "l2"], default=FitSettings.normalise,
                        help="must match method.unem.normalise at evaluation")
    parser.add_argument("--out", default=None, help=f"JSON to write, {{shots}} = the shot count (default "
                                                    f"{DEFAULT_CACHE}/unem_<key>.json)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args(argv)
    import torch

    from lightning_putm.features import load_features

    if args.threads:
        torch.set_num_threads(args.threads)
    alpha = parse_alpha(args.alpha, "--alpha")
    queries = None if args.queries == "auto" else query_count(args.queries)
    settings = FitSettings(iterations=args.iterations, loss=args.loss, normalise=args.normalise)
    if args.out is not None and len(args.shots) > 1 and "{shots}" not in args.out:
        raise SystemExit("--out: with several --shots, put {shots} in the file name")
    features = load_features(args.features, setting="--features")
    counts = {shots: task_queries(features, args.ways, shots, queries, alpha, args.tasks, args.seed, args.features)
              for shots in args.shots}  # every shot count's tasks can be drawn: checked before the first fit
    for shots in args.shots:
        out = None if args.out is None else args.out.replace("{shots}", str(shots))
        path, _ = fit_unem_cached(features, shots, ways=args.ways, queries=counts[shots], alpha=alpha,
                                  tasks=args.tasks, seed=args.seed, settings=settings, out=out)
        print(f"{shots}-shot: method.unem.params_file={path}")
    return 0


def query_count(text: str) -> int:
    """``--queries N``: an integer >= 1 (``auto`` is handled by the caller)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise SystemExit(f"--queries must be auto or an integer >= 1, got {text!r}")
    return value


def task_queries(features: FeatureSet, ways: int, shots: int, queries: int | None, alpha: float | None, tasks: int,
                 seed: int, name: str = "the feature file", log=print) -> int:
    """The queries per task of the fit at ``shots`` shots: ``queries`` when given (a
    :class:`~lightning_putm.errors.DataError` naming a ``--queries`` that works when the classes do not hold
    them), else (``auto``) :data:`REFERENCE_QUERIES` or the largest count the classes hold, said in one line."""
    from lightning_putm.data.episodes import check_episodes_possible
    from lightning_putm.evaluation.unem_default import fit_queries

    if queries is not None:
        check_episodes_possible(features.labels, ways, [shots], queries, [alpha], tasks, seed, key="--queries")
        return queries
    chosen = fit_queries(features.labels, ways, shots, REFERENCE_QUERIES, [alpha], tasks, seed)
    if chosen == REFERENCE_QUERIES:
        log(f"{shots}-shot: {chosen} queries per task (the reference's)")
    else:
        log(f"{shots}-shot: {REFERENCE_QUERIES} queries per task cannot be drawn from the classes of {name}; using "
            f"{chosen}, the largest that can (--queries N sets it)")
    return chosen


if __name__ == "__main__":
    raise SystemExit(main())
