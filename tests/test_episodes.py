"""The episode bank follows docs/protocol.md exactly: counts, rounding, disjointness, seeding, errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from lightning_putm.data.episodes import (TooManyQueries, check_episodes_possible, dirichlet_query_counts,
                                         round_counts_to_total, sample_episode_bank)
from lightning_putm.errors import ConfigError, DataError


def labels_with_sizes(sizes: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])


@pytest.mark.parametrize(
    "expected,total,result",
    [
        ([2.6, 2.6, 4.8], 10, [2, 3, 5]),  # sum 11 > 10: floor the fraction closest to .5 (first of a tie)
        ([1.4, 1.4, 7.2], 10, [2, 1, 7]),  # sum 9 < 10: ceil the fraction closest to .5 (first of a tie)
        ([0.3, 0.3, 9.4], 10, [0, 0, 10]),  # a class may receive 0 queries
        ([3.0, 3.0, 4.0], 10, [3, 3, 4]),  # already integral
        # round -> [0, 1, 3, 10] (10.5 rounds half to even) = 14 < 15; fractions .45 .45 .6 .5 are
        # .05 .05 .1 0 from .5, so entry 3 is ceiled to 11
        ([0.45, 1.45, 2.6, 10.5], 15, [0, 1, 3, 11]),
    ],
)
def test_rounding_rule_on_hand_computed_cases(expected, total, result):
    counts = round_counts_to_total(np.array(expected), total)
    assert counts.tolist() == result
    assert counts.sum() == total


@pytest.mark.parametrize("alpha,ways,total", [(0.5, 5, 75), (2.0, 5, 75), (1.0, 3, 7), (10.0, 10, 150)])
def test_dirichlet_counts_sum_to_total(alpha, ways, total):
    rng = np.random.default_rng(0)
    for _ in range(500):
        counts = dirichlet_query_counts(rng, alpha, ways, total)
        assert counts.sum() == total and (counts >= 0).all() and len(counts) == ways


def test_mean_dirichlet_proportions_are_uniform():
    labels = labels_with_sizes([100] * 8)
    bank = sample_episode_bank(labels, ways=5, shots=1, queries=75, alpha=2.0, tasks=3000, seed=1)
    proportions = bank.query_counts.double() / 75
    assert torch.allclose(proportions.mean(0), torch.full((5,), 0.2, dtype=torch.double), atol=0.015)
    assert (bank.query_counts.sum(1) == 75).all()
    # imbalance is real: many tasks are far from uniform
    assert (bank.query_counts.max(1).values >= 30).float().mean() > 0.1


def test_balanced_counts_and_any_shape():
    labels = labels_with_sizes([30] * 6)
    bank = sample_episode_bank(labels, ways=3, shots=2, queries=12, alpha=None, tasks=20, seed=0)
    assert (bank.query_counts == 4).all()
    assert bank.support_indices.shape == (20, 6) and bank.query_indices.shape == (20, 12)
    dirichlet = sample_episode_bank(labels, ways=4, shots=3, queries=7, alpha=1.0, tasks=20, seed=0)
    assert (dirichlet.query_counts.sum(1) == 7).all()


def test_support_and_query_are_disjoint_and_correctly_labelled():
    labels = labels_with_sizes([25] * 10)
    bank = sample_episode_bank(labels, ways=5, shots=5, queries=50, alpha=1.0, tasks=200, seed=3)
    for t in range(len(bank)):
        support, query = set(bank.support_indices[t].tolist()), set(bank.query_indices[t].tolist())
        assert not support & query
        assert len(support) == 25 and len(query) == 50  # no image drawn twice
        assert len(set(bank.class_ids[t].tolist())) == 5
    # labels of drawn rows match the task's class ids
    assert torch.equal(labels[bank.support_indices], torch.gather(bank.class_ids, 1, bank.support_labels))
    assert torch.equal(labels[bank.query_indices], torch.gather(bank.class_ids, 1, bank.query_labels))
    # per-class query counts match the labels
    counted = torch.stack([torch.bincount(q, minlength=5) for q in bank.query_labels])
    assert torch.equal(counted, bank.query_counts)


def test_same_seed_same_bank_other_seed_other_bank():
    labels = labels_with_sizes([40] * 12)
    args = dict(ways=5, shots=1, queries=75, alpha=2.0, tasks=50)
    a, b = sample_episode_bank(labels, seed=7, **args), sample_episode_bank(labels, seed=7, **args)
    c = sample_episode_bank(labels, seed=8, **args)
    for field in ("class_ids", "support_indices", "query_indices", "query_counts", "task_seeds"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert not torch.equal(a.query_indices, c.query_indices)
    # the bank depends on every parameter: a different alpha gives different tasks for the same seed
    d = sample_episode_bank(labels, seed=7, **{**args, "alpha": 3.0})
    assert not torch.equal(a.query_counts, d.query_counts)


def test_gather_builds_batched_tensors():
    labels = labels_with_sizes([20] * 6)
    features = torch.arange(len(labels), dtype=torch.float32)[:, None].repeat(1, 3)
    bank = sample_episode_bank(labels, ways=4, shots=2, queries=8, alpha=2.0, tasks=5, seed=0)
    gathered = bank.gather(features)
    assert gathered.batch.support.shape == (5, 8, 3) and gathered.batch.query.shape == (5, 8, 3)
    assert torch.equal(gathered.batch.query[..., 0].long(), bank.query_indices)
    assert gathered.batch.ways == 4 and gathered.query_labels.shape == (5, 8)


def test_balanced_error_names_the_small_class():
    labels = labels_with_sizes([30, 30, 30, 30, 10, 30])
    with pytest.raises(DataError, match=r"class 4 has 10 images.*1 \+ 15 = 16"):
        sample_episode_bank(labels, ways=5, shots=1, queries=75, alpha=None, tasks=5, seed=0)


def test_dirichlet_redraws_are_bounded_then_fail_clearly():
    labels = labels_with_sizes([6] * 5)  # 5-way, 75 queries can never fit in 6-image classes
    with pytest.raises(DataError, match=r"after 50 Dirichlet redraws.*has 6 images"):
        sample_episode_bank(labels, ways=5, shots=1, queries=75, alpha=2.0, tasks=1, seed=0, max_redraws=50)


@pytest.mark.parametrize("seed", range(5))
def test_dirichlet_banks_refuse_a_class_smaller_than_shots_up_front(seed):
    """Kills: the check made for balanced banks only. A Dirichlet task that draws a class with fewer images than
    `shots` fails whatever its proportions; the bank then failed at that task (after 1000 useless redraws, advising
    to raise α), or passed when no task happened to draw it: a 1-task pre-check passed and the run failed later."""
    labels = labels_with_sizes([40] * 9 + [8])
    with pytest.raises(DataError, match=r"class 9 has 8 images but every task that draws it needs shots = 10"):
        sample_episode_bank(labels, ways=5, shots=10, queries=75, alpha=2.0, tasks=1, seed=seed)
    assert len(sample_episode_bank(labels, ways=5, shots=5, queries=75, alpha=2.0, tasks=20, seed=seed)) == 20


def test_dirichlet_redraw_succeeds_when_possible():
    labels = labels_with_sizes([20] * 10)  # Omniglot-like: 20 images per class
    bank = sample_episode_bank(labels, ways=5, shots=1, queries=30, alpha=2.0, tasks=100, seed=0)
    assert (bank.query_counts.max(1).values <= 19).all()


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(alpha=0.0), ConfigError),
        (dict(alpha=-1.0), ConfigError),
        (dict(alpha=float("nan")), ConfigError),
        (dict(ways=7), DataError),
        (dict(queries=74, alpha=None), ConfigError),
        (dict(shots=0), ConfigError),
    ],
)
def test_bad_parameters_raise_clear_errors(kwargs, error):
    labels = labels_with_sizes([30] * 6)
    args = dict(ways=5, shots=1, queries=75, alpha=2.0, tasks=2, seed=0) | kwargs
    with pytest.raises(error):
        sample_episode_bank(labels, **args)


def test_imbalance_statistics():
    labels = labels_with_sizes([40] * 8)
    balanced = sample_episode_bank(labels, ways=5, shots=1, queries=75, alpha=None, tasks=5, seed=0)
    stats = balanced.imbalance()
    assert torch.allclose(stats["max_min_ratio"], torch.ones(5, dtype=torch.double))
    assert torch.allclose(stats["normalised_entropy"], torch.ones(5, dtype=torch.double))
    skewed = sample_episode_bank(labels, ways=5, shots=1, queries=75, alpha=0.5, tasks=50, seed=0).imbalance()
    assert (skewed["normalised_entropy"] < 1).all()


@pytest.mark.parametrize("alphas", [[0.5, 2.0], [0.5, 2.0, None]])
def test_too_many_queries_error_proposes_a_count_every_task_of_the_run_draws_with(alphas):
    """20 classes of 20 images, 5-shot, 75 queries: Dirichlet tasks cannot be drawn; the error proposes a
    ``queries`` value, and with it every one of the run's 300 tasks of each (shot, α) draws (a multiple of the
    ways when balanced tasks are asked for too). Kills: a count that only the one-task check draws (the run fails
    a few tasks later), a count balanced tasks refuse, a proposal no larger than the trivial
    ``min(size) - shots`` (15: the answer must use the redraws' room), no proposal at all."""
    labels = labels_with_sizes([20] * 20)
    with pytest.raises(TooManyQueries, match=r"Lower `queries` \(now 75\)") as caught:
        check_episodes_possible(labels, 5, [1, 5], 75, alphas, 300, 0)
    proposed = int(re.search(r"; queries=(\d+) works with these shots and alphas$", str(caught.value)).group(1))
    assert 15 < proposed < 75
    if None in alphas:
        assert proposed % 5 == 0
    for shots in (1, 5):
        for alpha in alphas:
            assert len(sample_episode_bank(labels, 5, shots, proposed, alpha, 300, 0)) == 300
    check_episodes_possible(labels, 5, [1, 5], proposed, alphas, 300, 0)  # and the check passes


def test_no_queries_are_proposed_where_fewer_queries_cannot_help_and_the_key_is_named():
    """A class smaller than the shots: no ``queries`` value helps, so none is proposed; a training setting names
    its own key. Kills: proposing a count that cannot work; the generic key where the user must set
    ``val_episodes.queries``."""
    labels = labels_with_sizes([20] * 19 + [4])
    with pytest.raises(DataError) as caught:
        check_episodes_possible(labels, 5, [5], 75, [2.0], 10, 0)
    assert "works with" not in str(caught.value)
    with pytest.raises(TooManyQueries, match=r"; val_episodes\.queries=\d+ works with these shots and alphas$"):
        check_episodes_possible(labels_with_sizes([20] * 20), 5, [5], 75, [2.0], 10, 0, key="val_episodes.queries")
