"""How PUTM's chunks are run, apart from the method itself: memory sizing, chunk caps, CPU worker threads,
the arithmetic precision and the canonical query order. None of it is part of the paper (speed options and
determinism); :class:`ChunkedSolver` hands each prepared chunk to :meth:`ChunkedSolver.solve_tasks`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Callable

import torch

from lightning_putm.errors import ConfigError
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.putm.precision import matmul_precision, resolve_precision
from lightning_putm.methods.putm.query_order import canonical_query_order, sort_queries, unsort_rows
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.methods.putm.solvers import engine_class, resolve_solver
from lightning_putm.methods.putm.workers import (CPU_MAX_CHUNK_TASKS, solve_in_threads, split_among_workers,
                                                 worker_count)
from lightning_putm.tasks import TaskBatch

if TYPE_CHECKING:
    from lightning_putm.methods.putm.engines import Engine


class ChunkedSolver(FewShotMethod):
    """Chunks sized by memory (and capped on CPU), shared among CPU worker threads, solved in the configured
    precision with the queries in a canonical order."""

    settings: PUTMSettings
    last_state: dict[str, torch.Tensor]
    #: The precision the last chunk actually ran in (``auto`` resolved for its device).
    last_precision: str | None
    #: The E-step engine class in place of ``settings.solver``'s (``PUTM(engine=...)``); ``None``: the solver's.
    engine: type[Engine] | None = None

    @abstractmethod
    def solve_tasks(self, tasks: TaskBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Probabilities ``[T, Q, N]`` of one chunk (queries already in their solving order) and its state."""

    # ----------------------------------------------------------------------------------------------- sizes
    def engine_type(self, device: torch.device) -> type[Engine]:
        """The class of the E-step engine that will run on ``device``: :attr:`engine` where one was given, else the
        solver's (``auto`` resolved; a solver that cannot run there raises :class:`ConfigError`)."""
        if self.engine is not None:
            return self.engine
        solver = resolve_solver(self.settings.solver, device, self.settings.precision)
        return engine_class(solver)

    def bytes_per_task(self, tasks: TaskBatch) -> int:
        """One task's rows through the preprocessing (features, basis, coordinates) and its E-step engine's working
        memory (:meth:`.engines.Engine.bytes_per_task` of the engine that will run)."""
        n = tasks.num_support + tasks.num_queries
        m = min(tasks.dim, n)
        engine = self.engine_type(tasks.support.device).bytes_per_task(tasks.num_queries * tasks.ways, m,
                                                                       self.settings)
        return 4 * n * (tasks.dim + 2 * m) + engine

    def check_input(self, tasks: TaskBatch) -> None:
        """Besides the base checks, tasks the engine cannot take (``solver=hopper``'s shapes,
        :meth:`.engines.Engine.unsupported`) are a :class:`ConfigError` before any work."""
        super().check_input(tasks)
        m = min(tasks.dim, tasks.num_support + tasks.num_queries)
        reason = self.engine_type(tasks.support.device).unsupported(tasks.num_queries, tasks.ways, m, self.settings)
        if reason is not None:
            raise ConfigError(reason)

    def chunk_size(self, tasks: TaskBatch) -> int:
        """Tasks per chunk: the memory budget's, capped at ``max_chunk_tasks`` (default on CPU:
        :data:`CPU_MAX_CHUNK_TASKS` per worker). On CPU a chunk is shared out among the workers."""
        size = super().chunk_size(tasks)
        cap = self.settings.max_chunk_tasks
        device = tasks.support.device
        if cap is None and device.type == "cpu":
            cap = CPU_MAX_CHUNK_TASKS * self.cpu_workers(device)
        return size if cap is None else max(1, min(size, cap))

    def cpu_workers(self, device: torch.device) -> int:
        """Concurrent chunk solvers: ``cpu_workers`` (default: torch's thread count) on CPU, else 1."""
        return worker_count(self.settings.cpu_workers, device)

    # --------------------------------------------------------------------------------------------- predict
    def predict(self, tasks: TaskBatch, on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """Probabilities ``[T, Q, N]``; on CPU with several workers each chunk is split among worker threads
        (:mod:`.workers`), whose parts together stay within the chunk's memory budget. With one worker this
        is the base class's sequential loop."""
        device = tasks.support.device
        workers = self.cpu_workers(device)
        if workers <= 1 or tasks.num_tasks == 0:
            return super().predict(tasks, on_chunk)
        self.check_input(tasks)
        parts, chunk_ends = self.split_among_workers(tasks, workers)
        self.last_precision = resolve_precision(self.settings.precision, device)
        with matmul_precision(self.last_precision, device):
            probabilities, state = solve_in_threads(self.solve_chunk, parts, chunk_ends, workers, on_chunk)
        self.last_state = state
        return probabilities

    def split_among_workers(self, tasks: TaskBatch, workers: int) -> tuple[list[TaskBatch], dict[int, int]]:
        """Chunks split into ``workers`` near-equal parts; ``{parts so far: tasks of the chunk}`` at chunk ends."""
        return split_among_workers(tasks, self.chunk_size(tasks), workers)

    def solve(self, tasks: TaskBatch) -> torch.Tensor:
        self.last_precision = resolve_precision(self.settings.precision, tasks.support.device)
        with matmul_precision(self.last_precision, tasks.support.device):
            forward, self.last_state = self.solve_chunk(tasks)
        return forward

    @torch.no_grad()
    def solve_chunk(self, tasks: TaskBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Probabilities of one chunk and its inspection state; writes nothing to ``self`` (thread-safe).

        With ``canonical_query_order`` the queries are solved in a canonical order (:mod:`.query_order`) and
        the probabilities put back in the input order; ``state["query_order"][t, i]`` is then the input index
        of state row ``i``.
        """
        order = canonical_query_order(tasks.query) if self.settings.canonical_query_order else None
        if order is not None:
            tasks = sort_queries(tasks, order)
        forward, state = self.solve_tasks(tasks)
        if order is not None:
            forward = unsort_rows(forward, order)
            state["query_order"] = order
        return forward, state
