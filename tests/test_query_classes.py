"""PADDLE's protocol (``query_classes=K_eff``): N ways in the support, K_eff of them present in the query set.

The sampler (docs/protocol.md): exactly K_eff task positions drawn uniformly per task, the other classes get no
query, the queries go to the present classes by the bank's rule (Q/K_eff each, Dirichlet(α·1_K_eff), or uniform
over their pooled images), support and query disjoint, a pure function of the seed; without K_eff the banks are
the ones drawn before the option existed. Then its path through the run: settings, stored settings, CSV files,
table generator, figures and W&B keys.
"""

from __future__ import annotations

import csv
import hashlib
import math

import numpy as np
import pytest
import torch

from conftest import make_clustered_features
from lightning_putm.data.episodes import TooManyQueries, check_episodes_possible, sample_episode_bank
from lightning_putm.errors import ConfigError
from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
from lightning_putm.evaluation.store import SettingStore
from lightning_putm.validators import UNIFORM, protocol_flags

SAMPLINGS = [None, 2.0, UNIFORM]  # balanced, Dirichlet, PADDLE's uniform draw


def labels_with_sizes(sizes: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])


def bank_digest(bank) -> str:
    digest = hashlib.sha256()
    for tensor in (bank.class_ids, bank.support_indices, bank.query_indices, bank.query_labels, bank.query_counts,
                   bank.task_seeds):
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ the sampler
@pytest.mark.parametrize("alpha", SAMPLINGS)
def test_exactly_k_eff_classes_hold_the_queries_and_the_others_none(alpha):
    """20 tasks of 6 ways with K_eff = 3, for each query rule: 3 classes drawn present, absent ones get 0 queries,
    counts sum to Q and match the query labels; balanced gives Q/K_eff (not Q/N) to each present class.

    Kills: K_eff ignored (all N present); queries given to absent classes; counts that do not sum to Q or disagree
    with the labels; balanced splitting Q over N; the bank not recording K_eff or the present classes."""
    labels = labels_with_sizes([25] * 9)
    bank = sample_episode_bank(labels, ways=6, shots=2, queries=12, alpha=alpha, tasks=20, seed=4, query_classes=3)
    assert bank.query_classes == 3 and bank.present.shape == (20, 6) and bank.present.dtype == torch.bool
    assert (bank.present.sum(1) == 3).all()
    assert (bank.query_counts[~bank.present] == 0).all()
    assert (bank.query_counts.sum(1) == 12).all()
    counted = torch.stack([torch.bincount(q, minlength=6) for q in bank.query_labels])
    assert torch.equal(counted, bank.query_counts)
    if alpha is None:
        assert (bank.query_counts[bank.present] == 4).all()


@pytest.mark.parametrize("alpha", SAMPLINGS)
def test_support_holds_all_n_classes_and_never_meets_the_query(alpha):
    """Every task's support holds `shots` images of each of its N classes (absent ones too: PADDLE's
    "distraction" classes), support and query share no image, and every row carries its class's label.

    Kills: a support restricted to the present classes; a query image also drawn as support (PADDLE's own code
    allows it; ours must not); labels that do not map back to the task's class ids."""
    labels = labels_with_sizes([14] * 8)
    bank = sample_episode_bank(labels, ways=5, shots=3, queries=20, alpha=alpha, tasks=40, seed=1, query_classes=2)
    for t in range(len(bank)):
        support, query = set(bank.support_indices[t].tolist()), set(bank.query_indices[t].tolist())
        assert not support & query and len(support) == 15 and len(query) == 20
    assert torch.equal(labels[bank.support_indices], torch.gather(bank.class_ids, 1, bank.support_labels))
    assert torch.equal(labels[bank.query_indices], torch.gather(bank.class_ids, 1, bank.query_labels))
    assert (torch.stack([torch.bincount(s, minlength=5) for s in bank.support_labels]) == 3).all()


def test_present_classes_are_drawn_uniformly_among_the_task_positions():
    """Over 3000 tasks of 5 ways with K_eff = 2, each label position is present in 40% of the tasks (± 3 points).

    Kills: the first K_eff positions taken as the present ones (PADDLE takes the first K_eff of a random order but
    then relabels classes by dataset id; here labels follow the draw order, so a method could read presence off
    the label, and argmax ties would favour the present classes)."""
    bank = sample_episode_bank(labels_with_sizes([30] * 7), ways=5, shots=1, queries=10, alpha=UNIFORM, tasks=3000,
                               seed=0, query_classes=2)
    assert torch.allclose(bank.present.double().mean(0), torch.full((5,), 0.4, dtype=torch.double), atol=0.03)


def test_uniform_queries_follow_the_pooled_images_not_equal_shares():
    """Two classes of 11 and 41 images, 1 shot, 10 queries drawn uniformly from the 10 + 40 images left: the
    small class gets 10·10/50 = 2 queries on average (hypergeometric), not 5; sometimes none at all.

    Kills: `uniform` implemented as equal counts or as equal-probability multinomial (mean 5); support images
    counted in the pool (mean 10·11/52 = 2.12 is inside the band, so this case does not test that: the
    disjointness test does)."""
    bank = sample_episode_bank(labels_with_sizes([11, 41]), ways=2, shots=1, queries=10, alpha=UNIFORM, tasks=4000,
                               seed=3)
    small = torch.where(bank.class_ids[:, 0] == 0, bank.query_counts[:, 0], bank.query_counts[:, 1]).double()
    assert abs(small.mean().item() - 2.0) < 0.1
    assert (small == 0).any()  # a present class can get no query, as in PADDLE's sampler


def test_hand_computed_tasks():
    """Cases whose counts follow by hand.

    * uniform, pool exactly Q: sizes 4, 6, 8 with 1 shot leave 3 + 5 + 7 = 15 images, so Q = 15 takes them all;
    * K_eff = 1: the one present class gets all Q queries, whatever the rule;
    * K_eff = N balanced is the balanced protocol (the methods are told so); K_eff < N is not, nor is uniform.

    Kills: a uniform draw that is not without replacement or not from the images left after the support; a
    K_eff = 1 task spreading queries; the protocol flag saying "balanced" for tasks with absent classes."""
    bank = sample_episode_bank(labels_with_sizes([4, 6, 8]), ways=3, shots=1, queries=15, alpha=UNIFORM, tasks=5,
                               seed=0, query_classes=3)
    for t in range(5):
        assert dict(zip(bank.class_ids[t].tolist(), bank.query_counts[t].tolist())) == {0: 3, 1: 5, 2: 7}
    for alpha in SAMPLINGS:
        one = sample_episode_bank(labels_with_sizes([20] * 6), ways=4, shots=1, queries=8, alpha=alpha, tasks=10,
                                  seed=2, query_classes=1)
        assert (one.query_counts.max(1).values == 8).all() and (one.present.sum(1) == 1).all()
    labels = labels_with_sizes([20] * 6)
    assert sample_episode_bank(labels, 4, 1, 8, None, 3, 0, query_classes=4).balanced
    assert sample_episode_bank(labels, 4, 1, 8, None, 3, 0).balanced
    assert not sample_episode_bank(labels, 4, 1, 8, None, 3, 0, query_classes=2).balanced
    assert not sample_episode_bank(labels, 4, 1, 8, UNIFORM, 3, 0).balanced
    assert protocol_flags([None], [5], 20) == [False] and protocol_flags([None], [None, 20], 20) == [True]
    assert protocol_flags([2.0, None], [None, 5], 20) == [False, True]


def test_banks_are_a_pure_function_of_the_seed_and_k_eff():
    """Same arguments, same bank; another seed or another K_eff, another bank.

    Kills: K_eff left out of the bank's seed (K_eff = 2 and 3 would share their class draws); an unseeded draw."""
    labels = labels_with_sizes([20] * 10)
    args = {"ways": 5, "shots": 1, "queries": 15, "alpha": UNIFORM, "tasks": 30}
    first = sample_episode_bank(labels, seed=5, query_classes=3, **args)
    assert bank_digest(first) == bank_digest(sample_episode_bank(labels, seed=5, query_classes=3, **args))
    assert torch.equal(first.present, sample_episode_bank(labels, seed=5, query_classes=3, **args).present)
    assert bank_digest(first) != bank_digest(sample_episode_bank(labels, seed=6, query_classes=3, **args))
    other = sample_episode_bank(labels, seed=5, query_classes=2, **args)
    assert not torch.equal(first.class_ids, other.class_ids)


#: Digests of two banks drawn before ``query_classes`` existed (commit 254068f, 2026-11-28).
PINNED = {2.0: ("222d3fba7f68d7ecf24113dfc482cbd775284dce98fe470213989dc3b00a16da", [5, 2, 0, 1], [6, 6, 8, 5]),
          None: ("70d4925b09d45e3a4d36e42c49aacbcf76f7286e72ed0e9a1171f72cd739b91f", [1, 5, 3, 6], [7, 7, 7, 7])}


@pytest.mark.parametrize("alpha", [2.0, None])
def test_the_default_protocol_draws_the_banks_it_drew_before(alpha):
    """A Dirichlet and a balanced bank (unequal class sizes, 50 tasks) hash to the values pinned before the option
    was added, with ``query_classes`` left out or given as None.

    Kills: any change to the default protocol's random sequence (a present-class draw when K_eff is None, K_eff
    in the bank's seed when None, a reordered draw), which would change every published number of the project."""
    labels = labels_with_sizes([12, 15, 20, 9, 30, 25, 18, 11])
    queries = 25 if alpha else 28
    digest, classes, counts = PINNED[alpha]
    for extra in ({}, {"query_classes": None}):
        bank = sample_episode_bank(labels, ways=4, shots=2, queries=queries, alpha=alpha, tasks=50, seed=7, **extra)
        assert bank.class_ids[0].tolist() == classes and bank.query_counts[0].tolist() == counts
        assert bank_digest(bank) == digest and bank.present.all() and bank.query_classes is None


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("value", [0, 6, 2.5, True, "3"])
def test_sampler_refuses_k_eff_outside_one_to_ways(value):
    """Kills: K_eff = 0 or > N accepted (an empty query set, or more present classes than ways); a float, a bool or
    text taken as a count."""
    with pytest.raises(ConfigError, match=r"`query_classes` must be an integer from 1 to ways=5"):
        sample_episode_bank(labels_with_sizes([20] * 6), 5, 1, 10, UNIFORM, 2, 0, query_classes=value)


def test_balanced_needs_queries_divisible_by_k_eff_not_by_n():
    """Balanced with K_eff = 4 of 5 ways: 12 queries are fine (3 each) although 5 does not divide 12; 10 are
    refused with a proposal that divides.

    Kills: the balanced check against N kept for K_eff banks; PADDLE's silent truncation (Q // K_eff, fewer
    queries than asked)."""
    labels = labels_with_sizes([20] * 6)
    assert (sample_episode_bank(labels, 5, 1, 12, None, 3, 0, query_classes=4).query_counts.sum(1) == 12).all()
    with pytest.raises(ConfigError, match=r"query_classes=4 need queries divisible by query_classes; got queries=10 "
                                          r"\(use queries=8\)"):
        sample_episode_bank(labels, 5, 1, 10, None, 3, 0, query_classes=4)


def test_uniform_tasks_the_smallest_classes_cannot_hold_are_refused_with_queries_that_work():
    """Sizes 6, 6, 20, 20, 20 with 1 shot: two present classes may be the two of 6 images, which leave 10 query
    images, so uniform tasks of 12 queries are refused up front (not redrawn), and the check proposes 10.

    Kills: an impossible uniform bank found only when an unlucky task draws the small classes; a redraw of the
    classes (which would bias the bank towards large classes); a proposal that does not work."""
    labels = labels_with_sizes([6, 6, 20, 20, 20])
    with pytest.raises(TooManyQueries, match=r"the 2 smallest classes of the split leave only 10"):
        sample_episode_bank(labels, 4, 1, 12, UNIFORM, 5, 0, query_classes=2)
    with pytest.raises(TooManyQueries, match=r"queries=10 works with these shots, query_classes and alphas"):
        check_episodes_possible(labels, 4, [1], 12, [UNIFORM], 200, 0, query_classes=[2])
    check_episodes_possible(labels, 4, [1], 10, [UNIFORM], 200, 0, query_classes=[2])
    assert len(sample_episode_bank(labels, 4, 1, 10, UNIFORM, 200, 0, query_classes=2)) == 200


def test_proposed_queries_draw_every_k_eff_setting():
    """Omniglot-like classes (20 images), 6 ways, 5 shots, K_eff in {all, 3, 1}, α = 2 and balanced, 60 queries:
    a balanced K_eff = 1 task puts every query in one class, which holds 15, so the proposal is the largest
    multiple of 6 (balanced, all classes) and 3 (balanced, K_eff = 3) up to 15: 12, and it draws all 100 tasks of
    every setting.

    Kills: a proposal that ignores K_eff (the default protocol alone allows 90) or the divisibility of the K_eff
    settings."""
    labels = labels_with_sizes([20] * 25)
    settings = [None, 3, 1]
    with pytest.raises(TooManyQueries, match=r"queries=12 works with these shots, query_classes and alphas"):
        check_episodes_possible(labels, 6, [5], 60, [2.0, None], 100, 0, query_classes=settings)
    for keff in settings:
        for alpha in (2.0, None):
            assert len(sample_episode_bank(labels, 6, 5, 12, alpha, 100, 0, query_classes=keff)) == 100


@pytest.mark.parametrize("value,message", [
    ("query_classes=0", r"`query_classes` must be an integer from 1 to ways=5 .*got 0"),
    ("query_classes=6", r"`query_classes` must be an integer from 1 to ways=5 .*got 6"),
    ("query_classes=[2,2]", r"`query_classes` lists 2 twice"),
    ("query_classes=[null,all]", r"`query_classes` lists all twice"),
    ("query_classes=two", r"`query_classes` must be an integer"),
    ("alphas=[unifrom]", r"neither a positive number nor `balanced` or `uniform`"),
])
def test_evaluate_settings_refuse_bad_k_eff_in_one_line(value, message):
    """Kills: a bad K_eff reaching the sampler after a run folder exists; a repeated K_eff (two settings filed
    under one name); `null` and `all` counted as two protocols."""
    with pytest.raises(ConfigError, match=message) as error:
        settings_from_config(load_evaluate_config(["methods=[simpleshot]", value]))
    assert "\n" not in str(error.value)


def test_evaluate_settings_read_a_value_or_a_list():
    """Kills: a single value not taken as a one-element list; null/all not read as the default protocol."""
    assert settings_from_config(load_evaluate_config(["methods=[simpleshot]"])).query_classes == [None]
    assert settings_from_config(load_evaluate_config(["methods=[simpleshot]", "query_classes=3"])).query_classes == [3]
    listed = settings_from_config(load_evaluate_config(["methods=[simpleshot]", "query_classes=[all,1,5]",
                                                        "alphas=[uniform,2]"]))
    assert listed.query_classes == [None, 1, 5] and listed.alphas == [UNIFORM, 2.0]


# ------------------------------------------------------------------------------------------------ records and figures
def test_results_rows_read_back_k_eff_and_uniform():
    """``Summary.from_row`` (results.csv read back, e.g. by the figures) reads ``all``/empty/absent K_eff as the
    default protocol, a number as K_eff, ``uniform`` as PADDLE's sampling; a damaged K_eff is a one-line error.

    Kills: ``all`` read as a class count; ``uniform`` refused (a PADDLE run's own results.csv could not be
    plotted); garbage K_eff accepted."""
    from lightning_putm.evaluation.records import Summary

    row = {"method": "putm", "shots": "1", "alpha": "uniform", "accuracy": "70", "ci95": "1"}
    assert Summary.from_row(row).query_classes is None and Summary.from_row(row).alpha == UNIFORM
    assert Summary.from_row({**row, "query_classes": "all"}).query_classes is None
    assert Summary.from_row({**row, "query_classes": ""}).query_classes is None
    assert Summary.from_row({**row, "query_classes": "5"}).query_classes == 5
    with pytest.raises(ValueError, match=r"row 0: `query_classes` must be a positive integer or `all`, got '0'"):
        Summary.from_row({**row, "query_classes": "0"})
    assert Summary.from_row({**row, "query_classes": "5"}).csv_row()["query_classes"] == "5"
    assert "query_classes" not in Summary.from_row(row).csv_row()


def test_accuracy_vs_alpha_puts_uniform_after_balanced_and_names_k_eff():
    """Rows of a K_eff = 5 run (as results.csv gives them, strings): ticks 2, balanced, uniform, one uniform point per
    method to the right of the balanced ones, and the title says 5 of the 20 classes are in the query set.

    Kills: `uniform` treated as a number (a crash, or a point on the α grid); uniform drawn on top of balanced; a
    K_eff figure whose title does not say K_eff."""
    from lightning_putm.evaluation.plots import BALANCED_POINT_GID, UNIFORM_POINT_GID, _accuracy_vs_alpha_figure

    rows = [{"method": method, "shots": "1", "query_classes": "5", "alpha": alpha, "accuracy": str(60 + i),
             "ci95": "1.0", "tasks": "100"}
            for method in ("putm", "ptmap") for i, alpha in enumerate(("2", "balanced", "uniform"))]
    figure = _accuracy_vs_alpha_figure(rows, ways=20, queries=75, query_classes=5)
    ax = figure.axes[0]
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["2", "balanced", "uniform"]

    def points(prefix):
        return [line for line in ax.get_lines() if (line.get_gid() or "").startswith(prefix + ":")]

    assert len(points(UNIFORM_POINT_GID)) == 2 and len(points(BALANCED_POINT_GID)) == 2
    assert min(line.get_xdata()[0] for line in points(UNIFORM_POINT_GID)) > \
        max(line.get_xdata()[0] for line in points(BALANCED_POINT_GID))
    assert "20-way, 5 classes in the query set, 75 queries" in figure._suptitle.get_text()


def test_accuracy_vs_k_eff_orders_k_eff_puts_all_last_and_draws_each_methods_accuracies():
    """Rows of a run over K_eff ∈ {5, 1, 3, all} at one α (as results.csv gives them, strings, in run order): per
    shot panel one line per method whose points are the accuracies in K_eff order 1, 3, 5, all. Rows of two α in
    one figure and a duplicate row are refused.

    Kills: K_eff ordered as text or in run order (5 before 1), the default protocol's rows (K_eff empty) dropped or
    put first, a line of another shot's or method's accuracies, a figure that mixes α silently."""
    from lightning_putm.evaluation.keff_plot import KEFF_LINE_GID, _accuracy_vs_query_classes_figure

    accuracy = {("putm", 1): [81, 71, 91, 95], ("putm", 5): [82, 72, 92, 96], ("ptmap", 1): [41, 21, 31, 97],
                ("ptmap", 5): [42, 22, 32, 98]}  # in the rows' K_eff order 5, 1, 3, all
    rows = [{"method": method, "shots": str(shots), "query_classes": keff, "alpha": "uniform",
             "accuracy": str(accuracy[method, shots][i]), "ci95": "1.0", "tasks": "100"}
            for (method, shots) in accuracy for i, keff in enumerate(("5", "1", "3", ""))]
    figure = _accuracy_vs_query_classes_figure(rows, ways=20, queries=15)
    axes = figure.axes
    assert [ax.get_title() for ax in axes] == ["1-shot", "5-shot"]
    for ax, shots in zip(axes, (1, 5)):
        assert [tick.get_text() for tick in ax.get_xticklabels()] == ["1", "3", "5", "all"]
        lines = {line.get_label(): line for line in ax.get_lines()
                 if (line.get_gid() or "").startswith(KEFF_LINE_GID + ":")}
        assert sorted(lines) == ["PT-MAP", "PUTM"]
        for method, label in (("putm", "PUTM"), ("ptmap", "PT-MAP")):
            by_keff = accuracy[method, shots]
            assert list(lines[label].get_ydata()) == [by_keff[1], by_keff[2], by_keff[0], by_keff[3]]
            assert list(np.round(lines[label].get_xdata())) == [0, 1, 2, 3]
    assert "20-way, 15 queries" in figure._suptitle.get_text() and "uniform" in figure._suptitle.get_text()
    with pytest.raises(ValueError, match="one α per accuracy-vs-K_eff figure"):
        _accuracy_vs_query_classes_figure([*rows, {**rows[0], "alpha": "2"}])
    with pytest.raises(ValueError, match="row 16: duplicate result for method='putm', shots=1, K_eff=5"):
        _accuracy_vs_query_classes_figure([*rows, rows[0]])


# ------------------------------------------------------------------------------------------------ the run
def test_a_stored_setting_is_never_read_back_for_another_k_eff(tmp_path):
    """A result stored for K_eff = 5 has its own file and fingerprint: K_eff = 3 and the default protocol of the
    same method, shot and α find nothing; K_eff = 5 finds it.

    Kills: K_eff left out of the file name (K_eff = 3 would overwrite or read K_eff = 5's result) or out of the
    fingerprint."""
    store = SettingStore(tmp_path)
    inputs = {"method": "simpleshot", "tasks": 2, "query_classes": 5}
    path = store.save("simpleshot", 1, UNIFORM, inputs, torch.tensor([0.5, 1.0]), 1.0, "fp32", False, 5)
    assert path.name == "simpleshot-1shot-keff_5-alpha_uniform.pt"
    assert SettingStore(tmp_path).load("simpleshot", 1, UNIFORM, {**inputs, "query_classes": 3}, 3) is None
    assert SettingStore(tmp_path).load("simpleshot", 1, UNIFORM, {"method": "simpleshot", "tasks": 2}) is None
    moved = SettingStore(tmp_path)  # the same file under the wrong K_eff's inputs: the fingerprint refuses it
    assert moved.load("simpleshot", 1, UNIFORM, {**inputs, "query_classes": 3}, 5) is None
    assert moved.changed == {"simpleshot-1shot-keff_5-alpha_uniform": ["query_classes"]}
    assert SettingStore(tmp_path).load("simpleshot", 1, UNIFORM, inputs, 5) is not None


def _rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_run_files_record_k_eff_and_resume_each_k_eff_on_its_own(tmp_path):
    """``evaluate.py`` on 12 synthetic classes, 6 ways, ``query_classes=[null,2]``: results.csv and per_task.csv
    carry ``query_classes`` (``all`` for the default rows) and per_task.csv the present classes (2 of the task's
    class ids, the only ones with queries); the table generator reads the K_eff blocks and merges the run with one
    of ``query_classes=2`` alone (the same bank); one figure per K_eff. A second run into the same folder with
    ``query_classes=3`` solves again and keeps no K_eff = 2 result.

    Kills: per-task rows without K_eff or present classes; present classes that are not the ones holding the
    queries; results of two K_eff filed under one setting; the table refusing runs whose configs list K_eff
    differently although their banks agree; a stored K_eff = 2 setting read back for K_eff = 3."""
    from lightning_putm.features import save_features
    from lightning_putm.jobs.evaluate import run_evaluate
    from lightning_putm.studies import table_runs

    features = tmp_path / "features.pt"
    save_features(make_clustered_features(classes=12, per_class=20, dim=8, spread=0.5), features)
    common = ["logger=none", "progress=false", f"features={features}", "ways=6", "shots=[1]", "queries=12",
              "tasks=4", "methods=[simpleshot]", f"output_dir={tmp_path / 'run'}"]
    run_evaluate([*common, "query_classes=[null,2]", "alphas=[uniform,balanced]"], log=lambda _: None)
    results = _rows(tmp_path / "run" / "results.csv")
    assert [(r["query_classes"], r["alpha"]) for r in results] == [("all", "uniform"), ("all", "balanced"),
                                                                    ("2", "uniform"), ("2", "balanced")]
    per_task = _rows(tmp_path / "run" / "per_task.csv")
    assert len(per_task) == 16 and list(per_task[0])[:4] == ["method", "shots", "query_classes", "alpha"]
    for row in per_task:
        classes = row["class_ids"].split(";")
        counts = dict(zip(classes, map(int, row["query_counts"].split(";"))))
        present = row["present_classes"].split(";")
        if row["query_classes"] == "all":
            assert present == classes
        else:
            assert len(present) == 2 and set(present) <= set(classes)
            assert all(counts[c] == 0 for c in classes if c not in present) and sum(counts.values()) == 12
            if row["alpha"] == "balanced":
                assert all(counts[c] == 6 for c in present)
    run = table_runs.read_run(tmp_path / "run")
    assert sorted(result.setting.label for result in run.results) == [
        "K_eff = 2, balanced", "K_eff = 2, uniform", "balanced", "uniform"]
    plots = sorted(p.name for p in (tmp_path / "run" / "plots").glob("accuracy_vs_alpha*.png"))
    assert plots == ["accuracy_vs_alpha.png", "accuracy_vs_alpha_keff2.png"]
    by_keff = sorted(p.name for p in (tmp_path / "run" / "plots").glob("accuracy_vs_keff*.png"))
    assert by_keff == ["accuracy_vs_keff_alpha_balanced.png", "accuracy_vs_keff_alpha_uniform.png"]
    alone = [*common[:-1], f"output_dir={tmp_path / 'alone'}", "query_classes=2", "alphas=[uniform]", "plots=false"]
    run_evaluate(alone, log=lambda _: None)  # the K_eff = 2 bank of the list run, drawn alone: the same tasks
    merged = table_runs.make_table([tmp_path / "run", tmp_path / "alone"])
    assert [setting.label for setting in merged.settings] == ["balanced", "uniform", "K_eff = 2, balanced",
                                                              "K_eff = 2, uniform"]

    run_evaluate([*common, "query_classes=3", "alphas=[uniform]", "plots=false"], log=lambda _: None)
    again = _rows(tmp_path / "run" / "results.csv")
    assert [(r["query_classes"], r["alpha"]) for r in again] == [("3", "uniform")]
    stored = sorted(p.name for p in (tmp_path / "run" / "settings").iterdir())
    assert stored == ["simpleshot-1shot-keff_3-alpha_uniform.pt"]
    assert {row["query_classes"] for row in _rows(tmp_path / "run" / "per_task.csv")} == {"3"}


def _table_run(folder, keffs, seed=0):
    """A run folder as ``evaluate.py ways=5 queries=15 tasks=6 'alphas=[uniform]' seed=<seed>`` with one K_eff per
    value of ``keffs`` leaves it (SimpleShot's accuracies hand-made, the banks real)."""
    from lightning_putm.config import to_yaml
    from lightning_putm.evaluation.records import Provenance
    from lightning_putm.evaluation.report import write_report
    from lightning_putm.evaluation.runner import SettingResult

    labels = labels_with_sizes([30] * 10)
    results = [SettingResult("simpleshot", 1, UNIFORM, torch.linspace(0.5, 1.0, 6, dtype=torch.float64), 1.0,
                             sample_episode_bank(labels, 5, 1, 15, UNIFORM, 6, seed, query_classes=keff),
                             precision="fp32") for keff in keffs]
    config = load_evaluate_config(["features=feats/digits.pt", f"seed={seed}", "queries=15", "tasks=6", "ways=5",
                                   f"output_dir={folder}", "logger=none"])
    write_report(results, folder, to_yaml(config), Provenance("cpu (test CPU, 2 cores)", "2", "2", 1))
    return folder


def test_the_table_shows_each_k_eff_as_its_own_block_and_compares_present_classes(tmp_path):
    """Three runs of one source, shot and seed: the default protocol, K_eff = 2, K_eff = 3 (and the default with
    K_eff = 2 in one list run). Each K_eff is its own block, after the default one, none refused for differing
    from another; the K_eff = 2 cell of the list run and the single run is one bank. A run whose K_eff = 2 tasks
    name other present classes (same classes, same counts) is refused, naming the task and the present classes.

    Kills: K_eff left out of the cell (K_eff = 2 and 3 merged, or refused as different banks of one cell, or the
    list run refused against the single one for its config's ``query_classes``); present classes left out of the
    bank comparison."""
    from lightning_putm.errors import DataError
    from lightning_putm.studies import table_runs

    default = _table_run(tmp_path / "default", [None])
    listed = _table_run(tmp_path / "listed", [None, 2])
    two = _table_run(tmp_path / "two", [2])
    three = _table_run(tmp_path / "three", [3])
    merged = table_runs.make_table([default, listed, two, three])
    assert [setting.label for setting in merged.settings] == ["uniform", "K_eff = 2, uniform", "K_eff = 3, uniform"]
    assert len(merged.columns) == 1
    path = two / "per_task.csv"
    rows = _rows(path)
    classes = rows[0]["class_ids"].split(";")
    counts = rows[0]["query_counts"].split(";")
    empty = [c for c, n in zip(classes, counts) if n == "0" and c not in rows[0]["present_classes"].split(";")]
    present = rows[0]["present_classes"].split(";")
    rows[0]["present_classes"] = ";".join(sorted([*present[:-1], empty[0]], key=classes.index))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(DataError, match=r"1-shot query_classes=2;alpha=uniform .* different episode banks: task 0 "
                                        r"has present classes"):
        table_runs.make_table([listed, two])


def test_a_default_run_writes_the_columns_it_wrote_before(tmp_path):
    """Without ``query_classes`` neither file gets its columns, and the console table has no K_eff column.

    Kills: a default run's per_task.csv or results.csv changed by the option (table generators and notebooks of
    users read them by column)."""
    from lightning_putm.evaluation import evaluate_features, format_table, write_report
    from lightning_putm.features.files import FeatureSet  # noqa: F401 (the type of the features below)

    settings = settings_from_config(load_evaluate_config(["methods=[simpleshot]", "tasks=3", "shots=[1]",
                                                          "alphas=[2]", "progress=false"]))
    results = evaluate_features(make_clustered_features(), settings, log=lambda _: None)
    write_report(results, tmp_path)
    assert list(_rows(tmp_path / "per_task.csv")[0]) == [
        "method", "shots", "alpha", "task", "accuracy", "oracle_prior", "query_counts", "class_ids", "max_min_ratio",
        "normalised_entropy"]
    assert list(_rows(tmp_path / "results.csv")[0]) == [
        "method", "shots", "alpha", "accuracy", "ci95", "tasks", "seconds", "oracle_prior"]
    assert "K_eff" not in format_table([r.summary() for r in results])


ALL_METHODS = ["putm", "protonet", "simpleshot", "ptmap", "tim", "alpha_tim", "bdcspn", "laplacianshot", "ilpc",
               "bavardage", "alpha_am", "unem"]


#: Fewer steps for the iterative methods: the test is about shapes and finiteness, and stays a few seconds long.
SHORT = {"putm": {"em_steps": 2, "inner_steps": 3}, "tim": {"iterations": 50}, "alpha_tim": {"iterations": 50},
         "alpha_am": {"iterations": 50}}


def test_every_method_runs_with_absent_classes():
    """All twelve methods on 3 tasks of 8 ways with K_eff = 2 (uniform): finite probabilities, rows summing to 1,
    one column per way (iterative methods with fewer steps than their defaults; `evaluate.py` with the defaults is
    run in docs/protocol.md).

    Kills: a method that breaks (NaN, a shape error, a division by a zero class count) when most of its N classes
    have no query."""
    from lightning_putm.methods import build_method

    features = make_clustered_features(classes=10, per_class=20, dim=16, spread=0.5)
    bank = sample_episode_bank(features.labels, 8, 1, 12, UNIFORM, 3, 0, query_classes=2)
    batch = bank.gather(features.features).batch
    for name in ALL_METHODS:
        probabilities = build_method(name, SHORT.get(name, {}), shots=1, balanced=bank.balanced).predict(batch)
        assert probabilities.shape == (3, 12, 8), name
        assert torch.isfinite(probabilities).all(), name
        assert torch.allclose(probabilities.sum(-1), torch.ones(3, 12, dtype=probabilities.dtype), atol=1e-4), name


def test_query_classes_sit_in_w_and_b_keys_and_the_callback_plan(tmp_path):
    """The callback's metric names put K_eff between the shot and α (``fewshot/simpleshot/1shot/keff_2/alpha_
    uniform/acc``), the default protocol's keys stay as they were, and the plan line names the K_eff values.

    Kills: two K_eff settings logged under one metric (the second overwrites the first); the default keys changed
    (W&B dashboards and sweeps select on them)."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_putm.evaluation.callback import FewShotEvaluationCallback

    features = make_clustered_features(classes=8, per_class=15, dim=8, spread=0.5)

    class Rows(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def test_step(self, batch, batch_idx):
            return {"features": batch[0] * self.scale, "labels": batch[1], "indices": batch[2]}

    rows = TensorDataset(features.features, features.labels, torch.arange(len(features.labels)))
    lines: list[str] = []
    callback = FewShotEvaluationCallback(methods=["simpleshot"], ways=4, shots=[1], queries=8, tasks=3,
                                         alphas=["uniform"], query_classes=[None, 2], plots=False, progress=False,
                                         output_dir=str(tmp_path / "out"), log=lines.append)
    assert "x query_classes [all, 2] x alphas" in callback.plan_line()
    trainer = pl.Trainer(logger=CSVLogger(str(tmp_path), name="run"), callbacks=[callback], accelerator="cpu",
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.test(Rows(), DataLoader(rows, batch_size=40), verbose=False)
    header = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "fewshot/simpleshot/1shot/alpha_uniform/acc" in header
    assert "fewshot/simpleshot/1shot/keff_2/alpha_uniform/acc" in header
    assert not math.isnan(callback.results[1].summary().accuracy)
    assert np.isclose(callback.results[1].bank.present.sum(1).double().mean().item(), 2.0)
