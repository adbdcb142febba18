"""The episode bank: seeded balanced and Dirichlet-imbalanced few-shot tasks, all N classes or K_eff of them in the
query set.

Follows the realistic-imbalance protocol of Veilleux et al. (NeurIPS 2021) used by PUTM (Tian et al.,
ICCV 2023): N classes drawn uniformly, K support images per class, Q queries in total whose per-class
counts are either Q/N (balanced) or Dirichlet(α·1_N) proportions rounded to integers summing to Q.

``query_classes=K_eff`` is the task of PADDLE (Martin et al., NeurIPS 2022, "Towards Practical Few-shot Query
Sets"): the support still holds all N classes, but only K_eff of them, drawn uniformly, are present in the query
set; the Q queries go to those K_eff classes by the same rules (Q/K_eff each, Dirichlet(α·1_K_eff)), or, with
``uniform`` (PADDLE's own sampling), uniformly at random from the pooled images of the K_eff classes. The other
classes get no query. docs/protocol.md sets both protocols side by side.

The bank is a pure function of (labels of the split, N, K, Q, sampling mode, α, K_eff, number of tasks, seed):
the same arguments give identical tasks on any machine, so every method is judged on the same tasks. Without
K_eff (``query_classes=None``) no random number is drawn that the bank drew before the option existed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightning_putm.errors import ConfigError, DataError
from lightning_putm.tasks import TaskBatch
from lightning_putm.validators import UNIFORM, alpha_label, is_balanced

MAX_REDRAWS = 1000


class TooManyQueries(DataError):
    """Tasks that cannot be drawn with this many queries, but could with fewer (the class sizes allow it):
    :func:`check_episodes_possible` completes the message with a ``queries`` value that works."""


def round_counts_to_total(expected: np.ndarray, total: int) -> np.ndarray:
    """Round expected counts ``p·Q`` to integers summing exactly to ``total``.

    Round each entry; while the sum differs from ``total``, take the entry whose fractional part is
    closest to 0.5 (first one on ties) and floor it (sum too large) or ceil it (sum too small). An entry
    changed this way has fractional part 0 and is not picked again. Rounding is NumPy's round-half-to-even,
    as in the realistic-imbalance benchmark's sampler.
    """
    values = np.asarray(expected, dtype=np.float64).copy()
    for _ in range(2 * len(values) + 1):
        current = int(np.round(values).sum())
        if current == total:
            return np.round(values).astype(np.int64)
        fractional = values - np.floor(values)
        index = int(np.argmin(np.abs(fractional - 0.5)))
        values[index] = np.floor(values[index]) if current > total else np.ceil(values[index])
    raise ValueError(f"cannot round {expected} to total {total}")  # unreachable when sum(expected) == total


def dirichlet_query_counts(rng: np.random.Generator, alpha: float, ways: int, total: int) -> np.ndarray:
    """Per-class query counts: proportions ``p ~ Dir(α·1_N)`` times ``total``, rounded to sum to ``total``."""
    proportions = rng.dirichlet(np.full(ways, float(alpha)))
    if not np.all(np.isfinite(proportions)) or abs(float(proportions.sum()) - 1.0) > 1e-6:
        raise ConfigError(f"Dirichlet alpha={alpha:g} is too large to sample proportions from (they overflow); "
                          "use `balanced` for equal class proportions (the limit of a large alpha)")
    return round_counts_to_total(proportions * total, total)


@dataclass
class TaskTensors:
    """A gathered bank: what methods see (``batch``) and what only the scorer sees (``query_labels``)."""

    batch: TaskBatch
    query_labels: torch.Tensor  # [T, Q] in 0..N-1


@dataclass
class EpisodeBank:
    """Indices of ``T`` tasks into a feature set; per-task class ids, image indices and query counts."""

    ways: int
    shots: int
    queries: int
    alpha: float | str | None  # None: balanced; UNIFORM: uniform over the pooled images of the present classes
    seed: int
    class_ids: torch.Tensor  # [T, N] dataset class indices
    support_indices: torch.Tensor  # [T, N*K] rows of the feature set, class-major
    support_labels: torch.Tensor  # [T, N*K] in 0..N-1
    query_indices: torch.Tensor  # [T, Q] rows of the feature set, shuffled within a task
    query_labels: torch.Tensor  # [T, Q] in 0..N-1
    query_counts: torch.Tensor  # [T, N]
    task_seeds: torch.Tensor  # [T] for stochastic methods
    query_classes: int | None = None  # K_eff classes present in each query set; None: all N (the default protocol)
    present: torch.Tensor | None = None  # [T, N] bool: the classes drawn present (None: all of them)

    def __post_init__(self) -> None:
        if self.present is None:
            self.present = torch.ones(tuple(self.query_counts.shape), dtype=torch.bool)

    @property
    def sampling(self) -> str:
        return "balanced" if self.alpha is None else UNIFORM if self.alpha == UNIFORM else "dirichlet"

    @property
    def alpha_label(self) -> str:
        return alpha_label(self.alpha)

    @property
    def balanced(self) -> bool:
        """Every one of the N classes gets Q/N queries: what methods are told as their protocol flag."""
        return is_balanced(self.alpha, self.query_classes, self.ways)

    def __len__(self) -> int:
        return int(self.class_ids.shape[0])

    def gather(self, features: torch.Tensor, device: torch.device | str | None = None) -> TaskTensors:
        """Index ``features [n, d]`` into support ``[T, N*K, d]`` and query ``[T, Q, d]`` tensors."""
        device = features.device if device is None else torch.device(device)
        feats = features.to(device)
        batch = TaskBatch(
            support=feats[self.support_indices.to(device)],
            support_labels=self.support_labels.to(device),
            query=feats[self.query_indices.to(device)],
            ways=self.ways,
            task_seeds=self.task_seeds.clone(),
        )
        return TaskTensors(batch, self.query_labels.to(device))

    def imbalance(self) -> dict[str, torch.Tensor]:
        """Per-task imbalance: max/min count ratio (inf when a class gets 0) and normalised entropy."""
        counts = self.query_counts.double()
        p = counts / counts.sum(1, keepdim=True)
        entropy = -(p * p.clamp_min(1e-300).log()).sum(1) / math.log(self.ways)
        ratio = counts.max(1).values / counts.min(1).values  # inf where a class has no query
        return {"max_min_ratio": ratio, "normalised_entropy": entropy}


def bank_seed(seed: int, **parameters: object) -> int:
    """A stable 64-bit seed from the user seed and the bank parameters (not Python's salted ``hash``)."""
    text = json.dumps({"seed": int(seed), **parameters}, sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def sample_episode_bank(
    labels: torch.Tensor,
    ways: int,
    shots: int,
    queries: int,
    alpha: float | None,
    tasks: int,
    seed: int,
    max_redraws: int = MAX_REDRAWS,
    class_names: list[str] | None = None,
    query_classes: int | None = None,
) -> EpisodeBank:
    """Draw ``tasks`` episodes from the rows labelled ``labels``; ``alpha=None`` is balanced, ``alpha="uniform"``
    draws the queries uniformly from the pooled images of the present classes; ``query_classes=K_eff`` puts
    queries in K_eff of the N classes of each task (``None``: all N)."""
    labels_np = torch.as_tensor(labels).cpu().numpy().astype(np.int64)
    _check_parameters(labels_np, ways, shots, queries, alpha, tasks, query_classes)
    in_query = ways if query_classes is None else int(query_classes)  # classes that receive queries
    num_classes = int(labels_np.max()) + 1
    rows_of_class = [np.flatnonzero(labels_np == c) for c in range(num_classes)]
    present = np.array([c for c in range(num_classes) if len(rows_of_class[c]) > 0])
    sizes = np.array([len(r) for r in rows_of_class])
    if len(present) < ways:
        raise DataError(
            f"ways={ways} but the split has only {len(present)} classes with images; lower `ways` or use a larger split"
        )
    name = (lambda c: class_names[c]) if class_names else (lambda c: f"class {c}")
    too_small = [c for c in present if sizes[c] < shots + (0 if alpha is not None else queries // in_query)]
    if alpha is None and too_small:
        c = too_small[0]
        per_class = "queries/ways" if query_classes is None else "queries/query_classes"
        raise (TooManyQueries if sizes[c] > shots else DataError)(
            f"{name(c)} has {sizes[c]} images but balanced tasks need shots + {per_class} = "
            f"{shots} + {queries // in_query} = {shots + queries // in_query}; lower `shots` or `queries`"
        )
    if too_small:  # Dirichlet: a task that draws this class fails whatever its proportions (no redraw helps)
        c = too_small[0]
        raise DataError(f"{name(c)} has {sizes[c]} images but every task that draws it needs shots = {shots} support "
                        "images of it; lower `shots`, or leave such classes out of the split")
    if alpha == UNIFORM:  # a task whose present classes are the smallest must still hold the queries: no redraw
        room = int(np.sort(sizes[present] - shots)[:in_query].sum())
        if room < queries:
            raise TooManyQueries(
                f"uniform tasks draw queries={queries} from the images their present classes ({in_query}) leave after "
                f"{shots} support images each, but the {in_query} smallest classes of the split leave only {room}; "
                "lower `queries` or `shots`" + ("" if query_classes is None else ", or raise `query_classes`"))

    # K_eff joins the seed's parameters only when given, so the default protocol's banks stay as they were
    keff = {} if query_classes is None else {"query_classes": int(query_classes)}
    rng = np.random.default_rng(
        bank_seed(seed, ways=ways, shots=shots, queries=queries, alpha=alpha, tasks=tasks, classes=int(len(present)),
                  **keff)
    )
    available = int(sizes[present].sum())
    if ways * shots + queries > available:  # no task can exist: fail now, before allocating [tasks, queries] arrays
        _draw_task_counts(rng, rng.choice(present, size=ways, replace=False), sizes, ways, shots, queries, alpha,
                          query_classes, max_redraws, name)  # raises the usual error naming a class
        raise TooManyQueries(f"a task needs ways*shots + queries = {ways * shots + queries} distinct images but the split "
                        f"has only {available}; lower `shots` or `queries`")
    class_ids, support, query, query_labels, counts_all = _bank_arrays(tasks, ways, shots, queries)
    present_all = np.ones((tasks, ways), dtype=bool)
    for t in range(tasks):
        chosen = rng.choice(present, size=ways, replace=False)
        counts, present_all[t] = _draw_task_counts(rng, chosen, sizes, ways, shots, queries, alpha, query_classes,
                                                   max_redraws, name)
        q_rows, q_labels = [], []
        for k, c in enumerate(chosen):
            perm = rng.permutation(rows_of_class[c])
            support[t, k * shots : (k + 1) * shots] = perm[:shots]
            q_rows.append(perm[shots : shots + counts[k]])
            q_labels.append(np.full(counts[k], k))
        order = rng.permutation(queries)
        query[t] = np.concatenate(q_rows)[order]
        query_labels[t] = np.concatenate(q_labels)[order]
        class_ids[t] = chosen
        counts_all[t] = counts
    support_labels = np.repeat(np.arange(ways), shots)[None].repeat(tasks, 0)
    task_seeds = rng.integers(0, 2**62, size=tasks)
    return EpisodeBank(
        ways=ways,
        shots=shots,
        queries=queries,
        alpha=alpha if alpha is None or alpha == UNIFORM else float(alpha),
        seed=int(seed),
        class_ids=torch.from_numpy(class_ids),
        support_indices=torch.from_numpy(support),
        support_labels=torch.from_numpy(support_labels),
        query_indices=torch.from_numpy(query),
        query_labels=torch.from_numpy(query_labels),
        query_counts=torch.from_numpy(counts_all),
        task_seeds=torch.from_numpy(task_seeds),
        query_classes=None if query_classes is None else int(query_classes),
        present=torch.from_numpy(present_all),
    )


def check_episodes_possible(labels: torch.Tensor, ways: int, shots: Iterable[int], queries: int,
                            alphas: Iterable[float | str | None], tasks: int, seed: int,
                            class_names: list[str] | None = None, key: str = "queries",
                            query_classes: Iterable[int | None] = (None,)) -> None:
    """Raise the :class:`DataError` (or :class:`ConfigError`) that :func:`sample_episode_bank` would raise for any
    (shots, K_eff, α) setting, before a job creates its run folder: a split with too few classes or images, or more
    tasks than memory holds, is a user's mistake, found at once instead of after the first settings ran. One task
    per setting is drawn (a later task can still need more redraws than allowed, as rarely as that happens at all).
    When fewer queries would do, the error proposes the largest that does (:func:`workable_queries`), as
    ``<key>=<value>``."""
    shots, alphas, query_classes = list(shots), list(alphas), list(query_classes)
    for shot in shots:
        for keff in query_classes:
            for alpha in alphas:
                try:
                    sample_episode_bank(labels, ways, shot, queries, alpha, 1, seed, class_names=class_names,
                                        query_classes=keff)
                except TooManyQueries as exc:
                    fewer = workable_queries(labels, ways, shots, queries, alphas, tasks, seed,
                                             query_classes=query_classes)
                    if fewer is None:
                        raise
                    settings = "shots and alphas" if query_classes == [None] else "shots, query_classes and alphas"
                    raise TooManyQueries(f"{exc}; {key}={fewer} works with these {settings}") from None
        _bank_arrays(tasks, ways, shot, queries)


def workable_queries(labels: torch.Tensor, ways: int, shots: list[int], queries: int,
                     alphas: list[float | str | None], tasks: int, seed: int, draws: int = 2000,
                     query_classes: Sequence[int | None] = (None,)) -> int | None:
    """The largest query count below ``queries`` with which all ``tasks`` tasks of every (shot, K_eff, α) setting
    can be drawn, or ``None`` when no count helps (a class smaller than the shots).

    A Dirichlet task redraws its proportions until the chosen classes hold them (at most :data:`MAX_REDRAWS`
    times), so ``q`` queries work when a draw fits often enough that no task of the bank runs out of redraws:
    a fit rate ``p`` with ``tasks · (1 - p)^MAX_REDRAWS`` below 1/1000, taken twice for safety. The rate is
    estimated from ``draws`` proportion vectors and class choices per setting (drawn once, seeded): a draw fits
    every ``q`` up to ``min_k (size_k - shots) / p_k`` (counts rounded up, so the estimate errs low), which makes
    the answer a quantile, with no bank drawn. Balanced settings need a multiple of the classes that receive
    queries (``ways``, or K_eff) that every class holds; uniform ones at most what the K_eff (or N) smallest classes
    hold. ``min(class size) - max(shots)`` always works (no class can be asked for more queries than the task
    has). The value is then checked the way :func:`check_episodes_possible` checks (one task per setting).
    """
    sizes = np.bincount(torch.as_tensor(labels).cpu().numpy().astype(np.int64))
    sizes = sizes[sizes > 0]
    settings = [(ways if keff is None else int(keff), keff, alpha) for keff in query_classes for alpha in alphas]
    step = math.lcm(*(count for count, _, alpha in settings if alpha is None))  # 1 without balanced settings
    safe = (int(sizes.min()) - max(shots)) // step * step  # always draws
    if safe < max(step, 1) or len(sizes) < ways:
        return None
    rate = 2 * (1 - (1e-3 / max(1, tasks)) ** (1 / MAX_REDRAWS))  # the fit rate asked for
    rng = np.random.default_rng(seed)
    best = queries - 1
    for shot in shots:
        for count, _, alpha in settings:
            room = sizes - shot  # query images each class can give
            if alpha is None:
                best = min(best, count * int(room.min()))
                continue
            if alpha == UNIFORM:
                best = min(best, int(np.sort(room)[:count].sum()))
                continue
            chosen = np.argpartition(rng.random((draws, len(sizes))), count - 1, axis=1)[:, :count]
            proportions = rng.dirichlet(np.full(count, float(alpha)), size=draws)
            with np.errstate(divide="ignore"):
                fitting = np.min(np.where(proportions > 0, room[chosen] / proportions, np.inf), axis=1)
            best = min(best, int(np.floor(np.quantile(fitting, 1 - rate))))
    found = max(safe, best // step * step)
    while found > safe:
        try:
            for shot in shots:
                for _, keff, alpha in settings:
                    sample_episode_bank(labels, ways, shot, found, alpha, 1, seed, query_classes=keff)
            break
        except (DataError, ConfigError):
            found -= step
    return found if found < queries else None


def _bank_arrays(tasks: int, ways: int, shots: int, queries: int) -> tuple[np.ndarray, ...]:
    """The bank's empty index arrays: class ids, support, query, query labels, query counts."""
    try:
        return (np.empty((tasks, ways), dtype=np.int64), np.empty((tasks, ways * shots), dtype=np.int64),
                np.empty((tasks, queries), dtype=np.int64), np.empty((tasks, queries), dtype=np.int64),
                np.empty((tasks, ways), dtype=np.int64))
    except (MemoryError, ValueError) as exc:  # e.g. tasks=10**15: no array that large
        raise ConfigError(f"tasks={tasks} of {ways * shots} support + {queries} query images do not fit in memory "
                          f"({exc}); lower `tasks`") from exc


def _draw_task_counts(rng, chosen, sizes, ways, shots, queries, alpha, query_classes, max_redraws,
                      name) -> tuple[np.ndarray, np.ndarray]:
    """A task's query counts over its N chosen classes and which of them are present in its query set.

    With ``query_classes=K_eff`` the present classes are K_eff task positions drawn uniformly (not the first K_eff:
    the labels 0..N-1 follow the draw order, and a method must not find the present classes by their label); the
    others get 0. Without it every class is present and no number is drawn for it."""
    if query_classes is None:
        positions = np.arange(ways)
    else:
        positions = np.sort(rng.choice(ways, size=int(query_classes), replace=False))
    counts = np.zeros(ways, dtype=np.int64)
    counts[positions] = _draw_counts(rng, chosen[positions], sizes, len(positions), shots, queries, alpha,
                                     max_redraws, name)
    present = np.zeros(ways, dtype=bool)
    present[positions] = True
    return counts, present


def _draw_counts(rng, chosen, sizes, ways, shots, queries, alpha, max_redraws, name) -> np.ndarray:
    """Query counts for the ``ways`` classes ``chosen`` to receive queries: equal (balanced), uniform over their
    pooled images (a multivariate hypergeometric draw of the images left after the support: every such image is
    equally likely to be a query), or Dirichlet proportions redrawn while a class is too small."""
    if alpha is None:
        return np.full(ways, queries // ways, dtype=np.int64)
    if alpha == UNIFORM:  # sample_episode_bank checked that the smallest classes hold the queries
        return rng.multivariate_hypergeometric(sizes[chosen] - shots, queries).astype(np.int64)
    for _ in range(max_redraws):
        counts = dirichlet_query_counts(rng, alpha, ways, queries)
        if np.all(sizes[chosen] >= shots + counts):
            return counts
    short = int(np.argmax(shots + counts - sizes[chosen]))
    c = chosen[short]
    raise TooManyQueries(
        f"after {max_redraws} Dirichlet redraws, {name(c)} has {sizes[c]} images but the task asks for "
        f"shots + queries = {shots} + {counts[short]} = {shots + counts[short]}. "
        f"Lower `queries` (now {queries}) or `shots`, raise alpha, or use a split with more images per class"
    )


def _check_parameters(labels: np.ndarray, ways: int, shots: int, queries: int, alpha: float | str | None, tasks: int,
                      query_classes: int | None = None) -> None:
    if labels.ndim != 1 or labels.size == 0:
        raise DataError("the split has no labelled images; check the data root and split")
    if labels.min() < 0:
        raise DataError("labels must be non-negative class indices")
    for key, value, low in (("ways", ways, 2), ("shots", shots, 1), ("queries", queries, 1), ("tasks", tasks, 1)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise ConfigError(f"`{key}` must be an integer >= {low}, got {value!r}")
    keff = query_classes
    if keff is not None and (isinstance(keff, bool) or not isinstance(keff, (int, np.integer)) or not 1 <= keff <= ways):
        raise ConfigError(f"`query_classes` must be an integer from 1 to ways={ways} (or null: all {ways} classes), "
                          f"got {query_classes!r}")
    if alpha is not None and alpha != UNIFORM:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise ConfigError(f"Dirichlet alpha must be a positive number (or `balanced`, `uniform`), got {alpha!r}")
    elif alpha is None and query_classes is not None and queries % query_classes:
        raise ConfigError(
            f"balanced tasks with query_classes={query_classes} need queries divisible by query_classes; got "
            f"queries={queries} (use queries={query_classes * max(1, round(queries / query_classes))})"
        )
    elif alpha is None and query_classes is None and queries % ways:
        raise ConfigError(
            f"balanced tasks need queries divisible by ways; got queries={queries}, ways={ways} "
            f"(use queries={ways * max(1, round(queries / ways))})"
        )
