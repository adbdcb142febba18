#!/usr/bin/env python
"""Evaluate few-shot methods on balanced and Dirichlet-imbalanced episodes.

Usage: python evaluate.py [key=value ...]   (defaults: conf/evaluate.yaml, conf/method/<name>.yaml)
  python evaluate.py                                     # built-in digits demo
  python evaluate.py features=novel.pt shots=[1,5] alphas=[1,2,4,balanced] tasks=1000
  python evaluate.py features=novel.plk allow_pickle=true method.putm.rho=0.7
  python evaluate.py methods=[putm,simpleshot,ptmap,tim,alpha_tim,bdcspn,laplacianshot]   # all peers, one bank
  python evaluate.py features=novel.pt base_features=base.pt method.tim.iterations=500   # CL2N base mean
  python evaluate.py methods=[ptmap] oracle_prior=true    # true query counts as PT-MAP's marginal (marked, unfair)
"""

import sys

from lightning_putm.cli import run_cli
from lightning_putm.jobs.evaluate import run_evaluate


def main(argv: list[str]) -> None:
    """Evaluate few-shot methods (PUTM and its peers) on balanced and Dirichlet-imbalanced episodes, from a
    backbone checkpoint, a feature file or the built-in demo data; every run gets its own folder."""
    run_evaluate(argv)


if __name__ == "__main__":
    sys.exit(run_cli(main, job="evaluate"))
