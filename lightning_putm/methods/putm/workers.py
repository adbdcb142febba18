"""CPU parallelism: a chunk of tasks shared out among Python threads with single-threaded kernels.

Tasks are independent, so each worker solves its part of a chunk with ``torch.set_num_threads(1)``: no
OpenMP barrier per kernel (on a busy 2-core machine these made the solver 2–4x slower), and a task's result
does not depend on the number of cores or workers. Not part of the paper: a speed option (``cpu_workers``).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

from lightning_putm.signals import clear_stop, request_stop, stop_requested
from lightning_putm.tasks import TaskBatch

#: Largest chunk on CPU. Measured (fused fp32 engine, 5-way 1-shot, d = 640, one thread, CPU time per Adam
#: step and task on a 2-core AMD EPYC Zen 4): 0.60 ms at 8 tasks per chunk, 0.62 at 16, 0.64 at 32, 0.69 at
#: 64 and 128: beyond ~32 tasks the activations (~0.7 MB per task) no longer stay in cache; below ~8 the
#: Python work per step starts to show. GPUs are limited by the memory budget only.
CPU_MAX_CHUNK_TASKS = 16

State = TypeVar("State")


def worker_count(cpu_workers: int | None, device: torch.device) -> int:
    """Concurrent chunk solvers: ``cpu_workers`` (default: torch's thread count) on CPU, else 1."""
    if device.type != "cpu":
        return 1
    return cpu_workers or torch.get_num_threads()


def split_among_workers(tasks: TaskBatch, chunk_size: int, workers: int) -> tuple[list[TaskBatch], dict[int, int]]:
    """Chunks split into ``workers`` near-equal parts; ``{parts so far: tasks of the chunk}`` at chunk ends."""
    parts: list[TaskBatch] = []
    chunk_ends: dict[int, int] = {}
    for start in range(0, tasks.num_tasks, chunk_size):
        stop = min(start + chunk_size, tasks.num_tasks)
        share = math.ceil((stop - start) / workers)
        parts += [tasks.slice(first, min(first + share, stop)) for first in range(start, stop, share)]
        chunk_ends[len(parts)] = stop - start
    return parts, chunk_ends


def solve_in_threads(solve: Callable[[TaskBatch], tuple[torch.Tensor, State]], parts: list[TaskBatch],
                     chunk_ends: dict[int, int], workers: int,
                     on_chunk: Callable[[int], None] | None = None) -> tuple[torch.Tensor, State | None]:
    """``solve`` on every part in ``workers`` threads with one kernel thread each (restored after); returns the
    outputs in order and the state of the last part. ``on_chunk`` hears the size of each finished chunk.

    When the main thread leaves early (Ctrl-C, a stop raised by ``on_chunk``, a part that failed), the parts not
    started are cancelled and the running ones stop at their next :func:`~lightning_putm.signals.check_stop` (a stop
    this function requests for them alone is cleared once they have ended), instead of running to their end."""
    threads = torch.get_num_threads()
    outputs: list[torch.Tensor] = []
    last_state = None
    stopped_here = False
    try:
        torch.set_num_threads(1)
        with ThreadPoolExecutor(workers) as pool:
            try:
                for index, (output, state) in enumerate(pool.map(solve, parts)):
                    outputs.append(output)
                    last_state = state
                    if on_chunk is not None and index + 1 in chunk_ends:
                        on_chunk(chunk_ends[index + 1])
            except BaseException:
                if not stop_requested():
                    request_stop(None)
                    stopped_here = True
                raise
    finally:
        if stopped_here:
            clear_stop()
        torch.set_num_threads(threads)
    return torch.cat(outputs), last_state
