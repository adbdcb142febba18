"""Data: feature sources and the few-shot episode bank (knows no model and no solver)."""

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.data.episodes import EpisodeBank, TaskTensors, dirichlet_query_counts, round_counts_to_total, sample_episode_bank

__all__ = [
    "EpisodeBank",
    "TaskTensors",
    "digits_feature_set",
    "dirichlet_query_counts",
    "round_counts_to_total",
    "sample_episode_bank",
]
