#!/usr/bin/env python
"""Draw one task of each episode protocol side by side: docs/img/protocols.png (docs/protocol.md).

Both tasks come from the project's own sampler (:func:`lightning_putm.data.episodes.sample_episode_bank`) on the
labels of a split shaped like mini-ImageNet's test split (20 classes of 600 images; only the labels matter, no
image is read):

* left, the realistic-imbalance protocol of Veilleux et al. (PUTM's Table 1): 5 ways, 75 queries, Dirichlet
  α = 2 (``alphas=[2]``);
* right, PADDLE's protocol (Martin et al., NeurIPS 2022): 20 ways, K_eff = 5 classes present in the query set,
  75 queries drawn uniformly from their pooled images (``ways=20 query_classes=5 alphas=[uniform]``).

Each bar is one class of the task (its label in the task), its height the class's query count; a class of the
support with no query is marked on the axis. The counts are printed too.

Usage (from the repository root): ``python benchmarks/protocol_figure.py [--task 0] [--seed 0]
[--output docs/img/protocols.png]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from lightning_putm.data.episodes import EpisodeBank, sample_episode_bank
from lightning_putm.evaluation.plot_style import figure_paths, new_figure, paper_style, save_figure

CLASSES, IMAGES = 20, 600  # mini-ImageNet's test split: 20 classes of 600 images


def draw_tasks(task: int, seed: int) -> list[tuple[str, EpisodeBank]]:
    """The two banks (``task + 1`` tasks each), with the title of their panel."""
    labels = torch.arange(CLASSES).repeat_interleave(IMAGES)
    tasks = task + 1
    return [
        ("Dirichlet (Veilleux et al.; PUTM)\n5-way 1-shot, 75 queries, α = 2",
         sample_episode_bank(labels, 5, 1, 75, 2.0, tasks, seed)),
        ("PADDLE (Martin et al.)\n20-way 1-shot, $K_\\mathrm{eff}$ = 5, 75 queries, uniform",
         sample_episode_bank(labels, 20, 1, 75, "uniform", tasks, seed, query_classes=5)),
    ]


def plot(banks: list[tuple[str, EpisodeBank]], task: int, output: Path) -> Path:
    with paper_style():
        figure = new_figure(7.0, 2.3)
        axes = figure.subplots(1, 2, width_ratios=[1, 2.6], sharey=True)
        for ax, (title, bank) in zip(axes, banks):
            counts = bank.query_counts[task].numpy()
            present = bank.present[task].numpy()
            x = np.arange(bank.ways)
            ax.bar(x, counts, 0.7, color=np.where(present, "#0072B2", "#BBBBBB"), gid="query-counts")
            absent = x[counts == 0]
            ax.plot(absent, np.zeros(len(absent)), "x", color="#D55E00", markersize=4, clip_on=False,
                    label="class in the support, no query")
            for k, count in zip(x, counts):
                if count:
                    ax.annotate(str(count), (k, count), ha="center", va="bottom", fontsize=6,
                                xytext=(0, 1), textcoords="offset points")
            ax.set_xticks(x, [str(k) for k in x], fontsize=6)
            ax.set_xlabel("class of the task (label)")
            ax.set_title(title)
            ax.grid(True, axis="y")
            ax.set_axisbelow(True)
        axes[0].set_ylabel("queries")
        axes[1].legend(loc="upper left", frameon=False)
    return save_figure(figure, figure_paths(output, ["png"]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", type=int, default=0, help="which task of each bank to draw")
    parser.add_argument("--seed", type=int, default=0, help="the banks' seed (evaluate.py's seed=)")
    parser.add_argument("--output", type=Path, default=Path("docs/img/protocols.png"))
    args = parser.parse_args(argv)
    banks = draw_tasks(args.task, args.seed)
    for title, bank in banks:
        counts, present = bank.query_counts[args.task].tolist(), int(bank.present[args.task].sum())
        print(f"{title.replace(chr(10), ': ')}: query counts {counts}, classes present {present} of {bank.ways}")
    print(f"wrote {plot(banks, args.task, args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
