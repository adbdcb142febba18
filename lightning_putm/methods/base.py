"""One small interface for every few-shot method (inductive or transductive).

A method receives a :class:`~lightning_putm.tasks.TaskBatch` of ``T`` tasks and returns class
probabilities ``[T, Q, N]`` for every query. Methods know only tensors: no dataset, model, logger or
Lightning import. Work stays on the device of the input tensors.

Large batches are split into chunks so that the method's working memory stays under
``memory_budget_mb``; every task is solved independently, so chunking never changes a result (α-AM's
long Adam runs amplify the last bit of batched reductions: a few of its predictions can move). On CUDA the
budget is also capped by the device's free memory (``memory_budget_mb: auto``: by that alone), and a chunk
that still runs out of device memory is halved and retried (:meth:`FewShotMethod.predict`), so nothing is lost.

Oracle prior: a method that needs the class marginal (``uses_class_prior = True``, e.g. PT-MAP)
uses the uniform one. Only when the user sets the explicit, default-off ``oracle_prior`` switch does the
evaluation pass the true per-task query counts ``[T, N]`` as ``query_counts``; :meth:`predict` then hands
each chunk its rows as ``solve(chunk, class_counts=...)`` and :attr:`oracle_prior` is true, so every such
result can be labelled. No other method ever receives counts.

Called on plain tensors (:meth:`FewShotMethod.__call__`, docs/python_api.md), a method checks them
(:mod:`~lightning_putm.methods.tensor_input`), checks that the support has the ``shots`` it was built for, and runs
the same :meth:`~FewShotMethod.predict` as the evaluation, so the same tasks and seeds give the same numbers.
"""

from __future__ import annotations

import math
import numbers
import sys
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Sequence

import torch
from tqdm.auto import tqdm

from lightning_putm.errors import ConfigError, DataError, FeatureError
from lightning_putm.job_options import checked_memory_budget
from lightning_putm.methods.options import MethodOptions
from lightning_putm.methods.tensor_input import support_shots, tasks_from_tensors
from lightning_putm.tasks import TaskBatch

#: ``memory_budget_mb: auto`` where the free memory cannot be asked (CPU): the fixed default budget.
AUTO_BUDGET_MB = 2048.0
#: Share of a CUDA device's free memory a chunk may plan to use: ``bytes_per_task`` is an estimate, and the
#: allocator's fragmentation, kernel workspaces and other processes need the rest.
FREE_MEMORY_FRACTION = 0.8
#: What a device raises when an allocation fails (``torch.cuda.OutOfMemoryError`` is the same class).
OUT_OF_MEMORY: type[BaseException] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a new chunk can still use on ``device``: CUDA's free memory plus what PyTorch's caching allocator
    holds unused; ``None`` where free memory is not known (CPU and other devices)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's unused blocks back after an out-of-memory error (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class FewShotMethod(ABC):
    """Base class: subclasses implement :meth:`solve` for one chunk of tasks."""

    #: The config name, set by ``@register_method("<name>")`` (:mod:`~lightning_putm.methods.registry`).
    name: ClassVar[str] = "method"
    #: Its place in every figure's colours and markers (:func:`~lightning_putm.methods.registry.method_order`); a
    #: method without one takes a free slot after the built-ins.
    plot_slot: ClassVar[float] = math.inf
    #: How figures and docs print the method (e.g. ``α-TIM`` for ``alpha_tim``); empty = use ``name``.
    display_name: ClassVar[str] = ""
    #: True when the method needs the class marginal and may receive true counts under ``oracle_prior``.
    uses_class_prior: ClassVar[bool] = False
    #: True when the method normalises with a base-class feature mean (CL2N) and falls back to L2N without one.
    uses_base_mean: ClassVar[bool] = False
    #: True when the method whitens with the base classes' within-class scatter (BAVARDAGE) when one is given.
    uses_base_covariance: ClassVar[bool] = False
    #: The method's options (:mod:`~lightning_putm.methods.options`): one frozen dataclass, the single source of
    #: their names, defaults, bounds and help; ``None`` for a method without options.
    Settings: ClassVar[type[MethodOptions] | None] = None

    def __init__(self, settings: MethodOptions | None = None, *, shots: int | None = None, balanced: bool = False,
                 memory_budget_mb: float | str = 2048.0, show_progress: bool = False,
                 query_counts: torch.Tensor | None = None, **options: Any) -> None:
        """``settings`` (a :attr:`Settings`) or keyword ``options`` (checked and converted by building one),
        resolved for ``shots`` and the protocol; its fields read as attributes (``self.lr``).

        ``shots``: support examples per class, which chooses some methods' defaults (PUTM's inertia, α-TIM's α...);
        ``None`` is refused by such a method unless those options are given, and a call on tensors
        (:meth:`__call__`) refuses a support with another number per class. ``balanced``: ``False`` (default) =
        Dirichlet-imbalanced query sets, ``True`` = balanced ones; it chooses the defaults of PUTM, TIM,
        LaplacianShot, iLPC and BAVARDAGE (docs/python_api.md lists which)."""
        if shots is not None and (isinstance(shots, bool) or not isinstance(shots, numbers.Integral) or shots < 1):
            raise ConfigError(f"{self.name}: shots must be a positive integer (support examples per class) or None, "
                              f"got {shots!r}")
        shots = None if shots is None else int(shots)
        if not isinstance(balanced, bool):
            raise ConfigError(f"{self.name}: balanced must be True (balanced query sets) or False (Dirichlet-"
                              f"imbalanced, the default), got {balanced!r}")
        #: Support examples per class this instance was built for (``None``: not given, any support is accepted).
        self.shots: int | None = shots
        #: Whether the defaults were chosen for balanced query sets (``False``: Dirichlet-imbalanced).
        self.balanced: bool = balanced
        if self.Settings is None:
            if settings is not None or options:
                raise ConfigError(f"{self.name} takes no options, got {', '.join(sorted(options)) or 'settings'}")
        else:
            #: The checked, resolved options (None = by setting chosen for this evaluation setting).
            self.settings = self.Settings.build(settings, options, shots=shots, balanced=balanced)
        memory_budget_mb = checked_memory_budget(memory_budget_mb)  # the rule evaluate.py and predict check
        if query_counts is not None and not self.uses_class_prior:
            raise ValueError(f"{self.name} does not use a class prior; it must not receive query counts")
        #: Cap on a chunk's working memory in MB, or ``"auto"`` (free device memory; 2048 MB on CPU).
        self.memory_budget_mb: float | str = memory_budget_mb
        #: The chunk size the last :meth:`predict` ended with (smaller than planned after an out-of-memory retry).
        self.last_chunk_size: int | None = None
        self.show_progress = show_progress
        #: True per-task query counts ``[T, N]`` (oracle prior only); ``None`` in every fair evaluation.
        self.oracle_counts = None if query_counts is None else torch.as_tensor(query_counts)

    def __getattr__(self, name: str) -> Any:
        """An option of :attr:`settings` read as an attribute (``self.iterations``); only called when normal
        lookup fails, so methods and instance attributes come first."""
        settings = self.__dict__.get("settings")
        if settings is not None and name in getattr(settings, "__dataclass_fields__", {}):
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def oracle_prior(self) -> bool:
        """Whether results of this instance used the true query counts (must be labelled as such)."""
        return self.oracle_counts is not None

    @property
    def resolved_precision(self) -> str:
        """The precision the last :meth:`predict` computed in, for provenance: ``last_precision`` where a method
        chooses it at run time (PUTM's ``precision=auto``), else float32 (``fp32``)."""
        return getattr(self, "last_precision", None) or "fp32"

    @abstractmethod
    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        """Class probabilities ``[T, Q, N]`` for one chunk of tasks."""

    def bytes_per_task(self, tasks: TaskBatch) -> int:
        """Rough peak working memory of one task, used to size chunks (override for heavy methods)."""
        n = tasks.num_support + tasks.num_queries
        return 4 * (n * tasks.dim * 4 + tasks.num_queries * tasks.ways * 8)

    def memory_budget_bytes(self, device: torch.device) -> float:
        """Working memory a chunk may use on ``device``: ``memory_budget_mb``, on CUDA at most
        :data:`FREE_MEMORY_FRACTION` of the free memory; ``auto`` = that share alone (CPU: 2048 MB)."""
        cap = None if self.memory_budget_mb == "auto" else float(self.memory_budget_mb) * 2**20
        free = free_device_memory(device)
        if free is None:
            return AUTO_BUDGET_MB * 2**20 if cap is None else cap
        available = FREE_MEMORY_FRACTION * free
        return available if cap is None else min(cap, available)

    def chunk_size(self, tasks: TaskBatch) -> int:
        budget = self.memory_budget_bytes(tasks.support.device)
        fit = budget / max(1, self.bytes_per_task(tasks))  # may be inf for an absurd budget: then all tasks fit
        return max(1, tasks.num_tasks if fit >= tasks.num_tasks else int(fit))

    def learned_inputs(self) -> dict[str, Any]:
        """Values the method read from a file (learned parameters), as JSON data: they decide its results as its
        options do, so a stored result or a cached temperature is reused only while they are the same. None here."""
        return {}

    def check_features(self, features: torch.Tensor) -> None:
        """Refuse (:class:`FeatureError`) a feature set ``[n, d]`` the method cannot use whatever the tasks, e.g.
        negative features for a power transform; the evaluation asks once, before its run folder exists."""

    @torch.no_grad()
    def check_input(self, tasks: TaskBatch) -> None:
        if not torch.isfinite(tasks.support).all() or not torch.isfinite(tasks.query).all():
            raise FeatureError(
                f"{self.name}: the task features contain NaN or Inf; clean or re-extract the feature file"
            )
        if tasks.support_labels.min() < 0 or tasks.support_labels.max() >= tasks.ways:
            raise ValueError(f"support labels must lie in 0..{tasks.ways - 1}")

    def __call__(self, support: torch.Tensor, support_labels: torch.Tensor, query: torch.Tensor, *,
                 task_seeds: int | Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Query probabilities of one task or a batch of tasks given as plain tensors (docs/python_api.md).

        One task: ``support [S, d]`` float32, ``support_labels [S]`` integers ``0..N-1`` (every class present),
        ``query [Q, d]`` → ``[Q, N]``. A batch: ``[T, S, d]``, ``[T, S]``, ``[T, Q, d]`` → ``[T, Q, N]``. Column ``k``
        is label ``k``; the work runs on the inputs' device. ``task_seeds``: one integer per task (an int for one
        task) for PUTM's navigator draws; default the task's index in the call (``0..T-1``). With an episode bank's
        ``task_seeds`` the result is evaluate.py's on the same tasks: this is the same :meth:`predict`.

        A method built with ``shots=K`` refuses a support without exactly ``K`` rows of every class. Every mistake is
        a one-line :class:`~lightning_putm.errors.LightningPutmError` (a ``ValueError``) before any work."""
        tasks, single = tasks_from_tensors(support, support_labels, query, task_seeds)
        self.check_shots(tasks)
        probabilities = self.predict(tasks)
        return probabilities[0] if single else probabilities

    def check_shots(self, tasks: TaskBatch) -> None:
        """Refuse (:class:`DataError`) a support that does not have the ``shots`` this instance was built for."""
        if self.shots is None:
            return
        fewest, most = support_shots(tasks)
        if fewest != self.shots or most != self.shots:
            found = f"{fewest} row{'s' * (most != 1)}" if fewest == most else f"{fewest} to {most} rows"
            raise DataError(f"{self.name} was built with shots={self.shots} but the support has {found} per "
                            f"class; build it with shots={most if fewest == most else 'None'} for this support"
                            + ("" if fewest == most else " (an uneven support: set the options chosen by shots "
                                                         "yourself)"))

    def predict(self, tasks: TaskBatch, on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """Probabilities ``[T, Q, N]`` for all tasks, solved in memory-bounded chunks.

        A chunk that runs out of device memory is halved and solved again, and later chunks keep the smaller
        size (one notice per halving on stderr); tasks are independent, so the result is the same. A single
        task that does not fit raises a :class:`RuntimeError`.
        """
        if tasks.num_tasks == 0:  # e.g. a rank of a distributed run with more ranks than tasks
            return tasks.query.new_zeros((0, tasks.num_queries, tasks.ways))
        self.check_input(tasks)
        counts = self.oracle_counts
        if counts is not None and tuple(counts.shape) != (tasks.num_tasks, tasks.ways):
            raise ValueError(
                f"{self.name}: oracle query counts have shape {tuple(counts.shape)}, expected "
                f"[T={tasks.num_tasks}, N={tasks.ways}] (one row per task of the bank)"
            )
        size = self.chunk_size(tasks)
        outputs = []
        start = 0
        while start < tasks.num_tasks:
            stop = min(start + size, tasks.num_tasks)
            chunk = tasks.slice(start, stop)
            out_of_memory = False
            try:
                if counts is None:
                    outputs.append(self.solve(chunk))
                else:
                    outputs.append(self.solve(chunk, class_counts=counts[start:stop].to(chunk.device)))  # type: ignore[call-arg]
            except OUT_OF_MEMORY as error:
                if stop - start == 1:
                    raise RuntimeError(
                        f"{self.name}: out of memory on {chunk.device} while solving a single task "
                        f"({str(error).splitlines()[0] if str(error) else 'no details'}); free device memory (other "
                        "processes on it), use smaller tasks (fewer queries or ways), or run on the CPU (device=cpu)"
                    ) from error
                out_of_memory = True  # handled outside `except`, so the failed chunk's tensors can be freed
            if out_of_memory:
                size = (stop - start) // 2
                release_cached_memory(chunk.device)
                tqdm.write(f"{self.name}: out of memory on {chunk.device} with {stop - start} tasks per chunk; "
                           f"retrying with {size} tasks per chunk", file=sys.stderr)
                continue
            if on_chunk is not None:
                on_chunk(chunk.num_tasks)
            start = stop
        self.last_chunk_size = size
        return torch.cat(outputs)

    def num_chunks(self, tasks: TaskBatch) -> int:
        return math.ceil(tasks.num_tasks / self.chunk_size(tasks))


def nearest_mean_probabilities(query: torch.Tensor, prototypes: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Softmax over classes of ``-temperature·‖x_j − μ_k‖²``: ``[T, Q, d] × [T, N, d] → [T, Q, N]``."""
    return torch.softmax(-temperature * torch.cdist(query, prototypes).pow(2), dim=2)
