"""The CT-EM loop of PUTM's Algorithm 1, over an E-step :class:`~.engines.Engine` (paper §3).

Every EM step: optionally re-draw the navigator (``reinit_navigator``), the E-step (``inner_steps`` Adam steps
of the navigator on the CT loss → π_f, π_b), the M-step (prototypes from the support rows and the queries
weighted by π_f, moved with inertia); then a final E-step, whose π_f is the prediction. With
``early_stop_tol`` a task whose prototypes moved by at most the tolerance (max abs change) gets its final
E-step at the next E-step and stops; how it leaves is the engine's choice (:attr:`.engines.Engine.fixed_batch`):
the batch shrinks (it is solved apart, then dropped) or stays whole (its rows are computed and ignored). Either
way a task's result is the one it gets alone. An engine that can run the whole loop without the host between
E-steps (:meth:`.engines.Engine.whole_em_loop`: ``solver=triton``, :mod:`.triton_em`) does so when no hook
listens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from lightning_putm.methods.putm.engines import Engine
from lightning_putm.methods.putm.m_step import m_step, query_weights, settled
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.signals import check_stop


@dataclass
class EMStep:
    """What one E-step (and the M-step after it) saw, for ``PUTM.em_step_hook`` (inspection and tests only).

    ``step`` counts from 0, ``None`` for a final E-step; ``tasks`` are the chunk rows the engine holds.
    ``navigator_before``/``navigator_after`` are copies of the flat navigator buffer at the start of the E-step
    (after any re-draw) and after it; ``weights`` and ``updated`` (M-step query weights and new prototypes) are
    ``None`` for a final E-step.
    """

    step: int | None
    tasks: torch.Tensor
    trainer: Engine
    navigator_before: torch.Tensor
    navigator_after: torch.Tensor
    prototypes: torch.Tensor
    forward: torch.Tensor
    backward: torch.Tensor
    weights: torch.Tensor | None = None
    updated: torch.Tensor | None = None


@dataclass
class Part:
    """Tasks one engine solves together: chunk rows ``tasks`` with their rows, support one-hots, prototypes and
    generators. ``live`` rows still wait for their result; ``final`` rows (``None``: none) get it from the next
    E-step."""

    engine: Engine
    tasks: torch.Tensor
    rows: torch.Tensor
    one_hot: torch.Tensor
    prototypes: torch.Tensor
    generators: list[torch.Generator]
    live: torch.Tensor
    final: torch.Tensor | None

    def subset(self, index: torch.Tensor, final: bool) -> Part:
        """The tasks ``index`` alone, with an engine of their own (the batch shrinks)."""
        flags = torch.ones(len(index), dtype=torch.bool, device=index.device)
        generators = [self.generators[i] for i in index.tolist()]
        return Part(self.engine.select(index), self.tasks[index], self.rows[index], self.one_hot[index],
                    self.prototypes[index], generators, flags, flags if final else None)

    def let_go(self, done: torch.Tensor) -> list[Part]:
        """The parts after tasks ``done`` settled: their next E-step is their final one."""
        if self.engine.fixed_batch:  # the batch stays whole: after that E-step their rows are ignored
            self.final = done
            return [self]
        if not bool(done.any()):
            return [self]
        finished, keep = done.nonzero().squeeze(1), (~done).nonzero().squeeze(1)
        return [self.subset(finished, final=True)] + ([self.subset(keep, final=False)] if len(keep) else [])


def em_loop(engine: Engine, rows: torch.Tensor, one_hot: torch.Tensor, prototypes: torch.Tensor,
            generators: list[torch.Generator], ways: int, settings: PUTMSettings,
            hook: Callable[[EMStep], None] | None = None,
            progress: Callable[[Iterable[int]], Iterable[int]] = iter,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EM steps then the final E-step (Algorithm 1); returns ``(π_f, prototypes, EM steps run)`` per task.

    ``rows`` ``[T, S+Q, m]`` (support rows, then queries), ``one_hot`` ``[T, S, N]`` the support weights.
    """
    check_stop()  # solver=triton runs the whole loop on the device: it stops between chunks
    if hook is None:  # nothing to report between E-steps: the engine may run the whole loop on its device
        whole = engine.whole_em_loop(rows, one_hot, prototypes, ways, progress)
        if whole is not None:
            return whole
    s = settings
    total, num_support = rows.shape[0], one_hot.shape[1]
    forward_out = rows.new_empty(total, rows.shape[1] - num_support, ways)
    prototypes_out = prototypes.clone()
    em_steps = torch.full((total,), s.em_steps, dtype=torch.long)
    flags = torch.ones(total, dtype=torch.bool, device=rows.device)
    parts = [Part(engine, torch.arange(total, device=rows.device), rows, one_hot, prototypes, generators, flags, None)]
    for step in itertools.chain(progress(range(s.em_steps)), [None]):  # None: the final E-step
        running: list[Part] = []
        for part in parts:
            check_stop()  # Ctrl-C or SIGTERM: stop between E-steps, in a worker thread too (lightning_putm.signals)
            if s.reinit_navigator:  # Algorithm 1: a new navigator (and Adam state) every EM step
                part.engine.reinit(part.generators)
            if part.engine.fixed_batch:  # the engine may skip the tasks that already have their result
                part.engine.keep_only(part.live)
            before = None if hook is None else part.engine.snapshot()
            # E-step: inner_steps Adam steps of the navigator on the CT loss -> (π_f, π_b)
            forward, backward = part.engine.run(part.rows[:, num_support:], part.prototypes, ways)
            final = part.live if step is None else part.final
            if final is not None:  # keep the results of the tasks whose final E-step this was
                forward_out[part.tasks[final]] = forward[final]
                prototypes_out[part.tasks[final]] = part.prototypes[final]
                part.live = part.live & ~final
                if step is None or not bool(part.live.any()):
                    report(hook, None, part, before, forward, backward)
                    continue
            # M-step: query weights from the chosen navigator, class means, inertia μ ← μ + a(μ̂ − μ)
            weights = query_weights(forward, backward, s.prototype_update, s.rho)
            updated = m_step(part.rows, part.one_hot, weights, part.prototypes, s.inertia)
            report(hook, step, part, before, forward, backward, weights, updated)
            done = settled(part.prototypes, updated, s.early_stop_tol)  # None: early stopping is off
            part.prototypes = updated
            if done is None:
                running.append(part)
                continue
            done = done & part.live
            em_steps[part.tasks[done].cpu()] = step + 1
            running += part.let_go(done)
        parts = running
        if not parts:
            break
    return forward_out, prototypes_out, em_steps


def report(hook: Callable[[EMStep], None] | None, step: int | None, part: Part, before: torch.Tensor | None,
           forward: torch.Tensor, backward: torch.Tensor, weights: torch.Tensor | None = None,
           updated: torch.Tensor | None = None) -> None:
    """One :class:`EMStep` for the hook (nothing when no hook listens)."""
    if hook is not None and before is not None:
        hook(EMStep(step, part.tasks.clone(), part.engine, before, part.engine.snapshot(), part.prototypes,
                    forward.detach(), backward.detach(), weights, updated))
