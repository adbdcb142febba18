"""The CT-EM loop of PUTM's Algorithm 1, over an E-step :class:`~.engines.Engine` (paper §3).

Every EM step: optionally re-draw the navigator (``reinit_navigator``), the E-step (``inner_steps`` Adam steps
of the navigator on the CT loss → π_f, π_b), the M-step (prototypes from the support rows and the queries
weighted by π_f, moved with inertia); then a final E-step, whose π_f is the prediction. With ``early_stop_tol``
a task whose prototypes settled gets its final E-step at the next E-step and stops; that bookkeeping is
:mod:`.em_routing`'s. An engine that can run the whole loop without the host between E-steps
(:meth:`.engines.Engine.whole_em_loop`: ``solver=triton``, :mod:`.triton_em`) does so when no hook listens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from lightning_putm.methods.putm.em_routing import Part, Results
from lightning_putm.methods.putm.engines import Engine
from lightning_putm.methods.putm.m_step import m_step, query_weights, settled
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.signals import check_stop


@dataclass
class EMStep:
    """What one E-step (and the M-step after it) saw, for ``PUTM.em_step_hook`` (inspection and tests only).

    ``step`` counts from 0, ``None`` for a final E-step; ``tasks`` are the chunk rows the ``engine`` holds.
    ``navigator_before``/``navigator_after`` are copies of the flat navigator buffer at the start of the E-step
    (after any re-draw) and after it; ``weights`` and ``updated`` (M-step query weights and new prototypes) are
    ``None`` for a final E-step.
    """

    step: int | None
    tasks: torch.Tensor
    engine: Engine
    navigator_before: torch.Tensor
    navigator_after: torch.Tensor
    prototypes: torch.Tensor
    forward: torch.Tensor
    backward: torch.Tensor
    weights: torch.Tensor | None = None
    updated: torch.Tensor | None = None


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
    s, num_support = settings, one_hot.shape[1]
    results = Results.empty(rows, prototypes, num_support, ways, s.em_steps)
    parts = [Part.whole(engine, rows, one_hot, prototypes, generators)]  # more only when tasks settle early
    for step in itertools.chain(progress(range(s.em_steps)), [None]):  # None: the final E-step
        running: list[Part] = []
        for part in parts:
            check_stop()  # Ctrl-C or SIGTERM: stop between E-steps, in a worker thread too (lightning_putm.signals)
            if s.reinit_navigator:  # Algorithm 1: a new navigator (and Adam state) every EM step
                part.engine.reinit(part.generators)
            part.skip_finished()
            before = None if hook is None else part.engine.navigator.flat.detach().clone()
            # E-step: inner_steps Adam steps of the navigator on the CT loss -> (π_f, π_b)
            forward, backward = part.engine.run(part.rows[:, num_support:], part.prototypes, ways)
            if part.keep_final(forward, step, results):  # that was the final E-step of every task left
                report(hook, None, part, before, forward, backward)
                continue
            # M-step: query weights from the chosen navigator, class means, inertia μ ← μ + a(μ̂ − μ)
            weights = query_weights(forward, backward, s.prototype_update, s.rho)
            updated = m_step(part.rows, part.one_hot, weights, part.prototypes, s.inertia)
            report(hook, step, part, before, forward, backward, weights, updated)
            done = settled(part.prototypes, updated, s.early_stop_tol)  # None: early stopping is off
            part.prototypes = updated
            running += part.let_go(done, step, results)
        parts = running
        if not parts:
            break
    return results.forward, results.prototypes, results.em_steps


def report(hook: Callable[[EMStep], None] | None, step: int | None, part: Part, before: torch.Tensor | None,
           forward: torch.Tensor, backward: torch.Tensor, weights: torch.Tensor | None = None,
           updated: torch.Tensor | None = None) -> None:
    """One :class:`EMStep` for the hook (nothing when no hook listens)."""
    if hook is not None and before is not None:
        after = part.engine.navigator.flat.detach().clone()
        hook(EMStep(step, part.tasks.clone(), part.engine, before, after, part.prototypes, forward.detach(),
                    backward.detach(), weights, updated))
