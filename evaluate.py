#!/usr/bin/env python
"""Evaluate few-shot methods on balanced and Dirichlet-imbalanced episodes.

Usage: python evaluate.py [key=value ...]   (defaults: conf/evaluate.yaml, conf/method/<name>.yaml)
  python evaluate.py                                     # built-in digits demo
  python evaluate.py features=novel.pt shots=[1,5] alphas=[1,2,4,balanced] tasks=1000
  python evaluate.py features=novel.plk allow_pickle=true method.putm.rho=0.7
  python evaluate.py methods=[putm,simpleshot,ptmap,tim,alpha_tim,bdcspn,laplacianshot]   # all peers, one bank
  python evaluate.py features=novel.pt base_features=base.pt method.tim.iterations=500   # CL2N base mean
  python evaluate.py methods=[ptmap] oracle_prior=true    # true query counts as PT-MAP's marginal (marked, unfair)
  python evaluate.py predict checkpoint=best.ckpt support=my/support query=my/query output=predictions.csv
                                                          # label your own images (see docs/predict.md)
"""

import sys

from lightning_putm.cli import run_cli
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.predict import run_predict
from lightning_putm.prediction.settings import predict_help

PREDICT = "predict"


def main(argv: list[str]) -> None:
    """Evaluate few-shot methods (PUTM and its peers) on balanced and Dirichlet-imbalanced episodes, from a
    backbone checkpoint, a feature file or the built-in demo data; every run gets its own folder."""
    if list(argv[:1]) == [PREDICT]:
        run_predict(list(argv[1:]))
        return
    run_evaluate(argv)


def predict(argv: list[str]) -> None:
    """Predict the class of your own query images from labelled support folders (one sub-folder per class) with a
    backbone checkpoint and any few-shot method; writes one CSV row per query and the estimated count per class."""
    run_predict(argv)


def cli(argv: list[str] | None = None) -> int:
    """``evaluate.py [key=value ...]`` evaluates; ``evaluate.py predict [key=value ...]`` predicts (own help)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [PREDICT]:
        return run_cli(predict, args[1:], help_text=predict_help)
    return run_cli(main, args, job="evaluate")


if __name__ == "__main__":
    sys.exit(cli())
