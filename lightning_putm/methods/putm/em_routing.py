"""Early stopping's bookkeeping for the EM loop (:mod:`.em`): which tasks still run, on which engine, and where a
finished task's result goes. Not part of the paper (``early_stop_tol``).

A task whose prototypes moved by at most the tolerance gets its final E-step at the next E-step and stops. How it
leaves is its engine's choice (:attr:`.engines.Engine.fixed_batch`): the batch shrinks (the settled tasks are
:meth:`~.engines.Engine.select` ed into a :class:`Part` of their own for that final E-step, then dropped) or stays
whole (the engine is told which tasks still need results, :meth:`~.engines.Engine.keep_only`, and their rows are
computed and ignored). Either way a task's result is the one it gets alone. Without early stopping the chunk is one
part from start to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_putm.methods.putm.engines import Engine


@dataclass
class Results:
    """What the chunk's tasks end with, filled in as each task finishes: π_f of its final E-step (the prediction),
    its prototypes and the EM steps it ran."""

    forward: torch.Tensor
    prototypes: torch.Tensor
    em_steps: torch.Tensor

    @classmethod
    def empty(cls, rows: torch.Tensor, prototypes: torch.Tensor, num_support: int, ways: int,
              em_steps: int) -> Results:
        """Room for a chunk of ``rows`` ``[T, S+Q, m]``; every task counts ``em_steps`` EM steps until it settles."""
        total = rows.shape[0]
        return cls(rows.new_empty(total, rows.shape[1] - num_support, ways), prototypes.clone(),
                   torch.full((total,), em_steps, dtype=torch.long))


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

    @classmethod
    def whole(cls, engine: Engine, rows: torch.Tensor, one_hot: torch.Tensor, prototypes: torch.Tensor,
              generators: list[torch.Generator]) -> Part:
        """Every task of the chunk, none settled."""
        everyone = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        return cls(engine, torch.arange(rows.shape[0], device=rows.device), rows, one_hot, prototypes, generators,
                   everyone, None)

    def skip_finished(self) -> None:
        """A fixed batch: tell the engine which tasks still need results (it may skip the others)."""
        if self.engine.fixed_batch:
            self.engine.keep_only(self.live)

    def keep_final(self, forward: torch.Tensor, step: int | None, results: Results) -> bool:
        """After an E-step (``step`` ``None``: the loop's final one, every task's): the results of the tasks whose
        final E-step it was go to ``results``. ``True`` when no task of the part is left to run (no M-step)."""
        final = self.live if step is None else self.final
        if final is None:
            return False
        results.forward[self.tasks[final]] = forward[final]
        results.prototypes[self.tasks[final]] = self.prototypes[final]
        self.live = self.live & ~final
        return step is None or not bool(self.live.any())

    def let_go(self, done: torch.Tensor | None, step: int, results: Results) -> list[Part]:
        """The parts after the M-step of EM step ``step``, in which tasks ``done`` settled (``None``: early
        stopping is off): their next E-step is their final one, and they ran ``step + 1`` EM steps."""
        if done is None:
            return [self]
        done = done & self.live
        results.em_steps[self.tasks[done].cpu()] = step + 1
        if self.engine.fixed_batch:  # the batch stays whole: after that E-step their rows are ignored
            self.final = done
            return [self]
        if not bool(done.any()):
            return [self]
        finished, keep = done.nonzero().squeeze(1), (~done).nonzero().squeeze(1)
        return [self.subset(finished, final=True)] + ([self.subset(keep, final=False)] if len(keep) else [])

    def subset(self, index: torch.Tensor, final: bool) -> Part:
        """The tasks ``index`` alone, with an engine of their own (the batch shrinks)."""
        flags = torch.ones(len(index), dtype=torch.bool, device=index.device)
        generators = [self.generators[i] for i in index.tolist()]
        return Part(self.engine.select(index), self.tasks[index], self.rows[index], self.one_hot[index],
                    self.prototypes[index], generators, flags, flags if final else None)
