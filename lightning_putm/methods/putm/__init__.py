"""PUTM: prototypes-oriented transductive few-shot learning with conditional transport.

Tian et al., "Prototypes-oriented Transductive Few-shot Learning with Conditional Transport", ICCV 2023
(arXiv 2308.03047), re-implemented from the paper and its reference code (github.com/RashLog/PUTM). All tasks
of a chunk are solved at once as stacked tensors ``[T, ...]`` on the input's device, with no Python loop
over tasks or pairs. The CT-EM loop of the paper's Algorithm 1 (:meth:`PUTM.em_loop`):

1. Preprocess each task (§3.1): power transform β, QR reduction to the task's own basis, L2 normalisation.
2. Prototypes start at the support class means.
3. For each of ``em_steps`` EM steps:

   a. optionally draw a new navigator (``reinit_navigator=True``, Algorithm 1; the reference code keeps
      the navigator and its Adam state across EM steps, the default);
   b. E-step (:mod:`.engines`): ``inner_steps`` Adam steps of the navigator (:mod:`.navigator`) on the
      conditional-transport loss (:mod:`.loss`), giving the forward navigator π_f and backward navigator π_b;
   c. M-step (:mod:`.m_step`): prototypes from the support rows and the queries weighted by π_f
      (``prototype_update``: or π_b, or the ρ-mixture), moved with inertia ``μ ← μ + a(μ̂ − μ)``;
   d. with ``early_stop_tol``, a task whose prototypes stopped moving leaves the loop.

4. A final E-step; the prediction is π_f(k|j).

Speed options that are not in the paper: ``solver`` (:mod:`.engines`, :mod:`.compiled`), ``init_draw``,
``precision`` (:mod:`.precision`),
``early_stop_tol``, ``max_chunk_tasks`` and ``cpu_workers`` (:mod:`.workers`); ``canonical_query_order``
(:mod:`.query_order`) makes the result independent of the order of the queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.preprocessing import l2_normalise, power_transform, reduce_basis
from lightning_putm.methods.putm.adam import ADAM_EPS, StackedAdam
from lightning_putm.methods.putm.compiled import CompiledTrainer, DeviceAdam, masked_em_loop
from lightning_putm.methods.putm.engines import (AutogradTrainer, FusedTrainer, e_step_autograd, make_trainer,
                                                 resolve_solver)
from lightning_putm.methods.putm.loss import ct_loss, ct_loss_gradient
from lightning_putm.methods.putm.m_step import m_step, query_weights, settled
from lightning_putm.methods.putm.navigator import GEMM_MIN_WIDTH, Navigator, select_tasks
from lightning_putm.methods.putm.precision import PRECISIONS, compute_dtype, matmul_precision, resolve_precision
from lightning_putm.methods.putm.query_order import canonical_query_order, sort_queries, unsort_rows
from lightning_putm.methods.putm.settings import PROTOTYPE_UPDATES, SOLVERS, PUTMSettings, resolve_settings
from lightning_putm.methods.putm.workers import (CPU_MAX_CHUNK_TASKS, solve_in_threads, split_among_workers,
                                                 worker_count)
from lightning_putm.tasks import TaskBatch, weighted_class_means

Trainer = FusedTrainer | AutogradTrainer | CompiledTrainer


@dataclass
class EMStep:
    """What one step of the EM loop saw, for :attr:`PUTM.em_step_hook` (inspection and tests only).

    ``step`` counts from 0, ``None`` for the final E-step; ``tasks`` are the chunk rows of the tasks still
    running. ``navigator_before``/``navigator_after`` are copies of the flat navigator buffer at the start
    of the E-step (after any re-draw) and after it; ``weights`` and ``updated`` (M-step query weights and new
    prototypes) are ``None`` for the final E-step.
    """

    step: int | None
    tasks: torch.Tensor
    trainer: Trainer
    navigator_before: torch.Tensor
    navigator_after: torch.Tensor
    prototypes: torch.Tensor
    forward: torch.Tensor
    backward: torch.Tensor
    weights: torch.Tensor | None = None
    updated: torch.Tensor | None = None


class PUTM(FewShotMethod):
    """The CT-EM solver of PUTM, batched over tasks."""

    name = "putm"
    display_name = "PUTM"

    def __init__(
        self,
        shots: int,
        balanced: bool,
        beta: float = 0.6,
        rho: float | None = None,
        theta: float | None = None,
        inertia: float | None = None,
        inertia_one_shot: float = 0.2,
        inertia_few_shot: float = 0.1,
        inner_steps: int = 30,
        em_steps: int = 50,
        lr: float = 1e-3,
        adam_betas: tuple[float, float] | list[float] = (0.5, 0.99),
        hidden: tuple[int, ...] | list[int] = (128, 64),
        init_tasks: int = 1000,
        reinit_navigator: bool = False,
        prototype_update: str = "forward",
        canonical_query_order: bool = True,
        solver: str = "auto",
        init_draw: str = "cpu",
        precision: str = "auto",
        early_stop_tol: float | None = None,
        max_chunk_tasks: int | None = None,
        cpu_workers: int | None = None,
        basis: str = "qr",
        support_weight: float = 1.0,
        memory_budget_mb: float | str = 2048.0,
        show_progress: bool = False,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb, show_progress=show_progress)
        self.settings = resolve_settings(
            shots=shots, balanced=balanced, beta=beta, rho=rho, theta=theta, inertia=inertia,
            inertia_one_shot=inertia_one_shot, inertia_few_shot=inertia_few_shot, inner_steps=inner_steps,
            em_steps=em_steps, lr=lr, adam_betas=adam_betas, hidden=hidden, init_tasks=init_tasks,
            reinit_navigator=reinit_navigator, prototype_update=prototype_update,
            canonical_query_order=canonical_query_order, solver=solver, init_draw=init_draw, precision=precision,
            early_stop_tol=early_stop_tol, max_chunk_tasks=max_chunk_tasks, cpu_workers=cpu_workers,
            basis=basis, support_weight=support_weight)
        self.last_state: dict[str, torch.Tensor] = {}
        #: The precision the last chunk actually ran in (``auto`` resolved for its device).
        self.last_precision: str | None = None
        #: Called with an :class:`EMStep` after every E-step (inspection and tests); ``None``: off.
        self.em_step_hook: Callable[[EMStep], None] | None = None

    # ----------------------------------------------------------------------------------------------- sizes
    def bytes_per_task(self, tasks: TaskBatch) -> int:
        n = tasks.num_support + tasks.num_queries
        m = min(tasks.dim, n)
        pairs = tasks.num_queries * tasks.ways
        hidden = sum(self.settings.hidden)
        if resolve_solver(self.settings.solver, tasks.support.device) in ("fused", "compiled"):
            # squared differences, activations and their gradients, padded output + its gradient, and the
            # CT head; flat parameters, gradients and two Adam moments (+ the Adam denominator)
            params = Navigator.numel([m, *self.settings.hidden, 1], 1)
            floats = pairs * (m + 2 * hidden + 2 * GEMM_MIN_WIDTH + 16) + n * (tasks.dim + 2 * m) + 5 * params
        else:
            # squared differences + per-layer activations saved for backward and their gradients
            floats = pairs * (2 * m + 5 * hidden + 8) + n * (tasks.dim + 2 * m)
        return 4 * floats

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
        if workers <= 1:
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
        forward, state = self._solve(tasks)
        if order is not None:
            forward = unsort_rows(forward, order)
            state["query_order"] = order
        return forward, state

    # ------------------------------------------------------------------------------------------ the method
    def preprocess(self, tasks: TaskBatch) -> torch.Tensor:
        """Rows ``[T, S+Q, m]`` (§3.1): power transform, per-task basis (``basis``: QR, or the sign-equivalent
        Cholesky factor of the Gram matrix, :mod:`..preprocessing`), L2 normalisation."""
        x = torch.cat([tasks.support, tasks.query], dim=1)
        x = power_transform(x, self.settings.beta, self.name)
        coords, _ = reduce_basis(x, self.settings.basis, self.name)
        return l2_normalise(coords)

    def _solve(self, tasks: TaskBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = self.settings
        with torch.no_grad():
            x = self.preprocess(tasks)
        one_hot = tasks.one_hot_support()
        prototypes = weighted_class_means(x[:, : tasks.num_support], one_hot)  # support class means
        if s.support_weight != 1.0:  # M-step weight of a support row against a query's navigator mass
            one_hot = one_hot * s.support_weight
        initial_prototypes = prototypes.clone()
        generators = [torch.Generator().manual_seed(int(seed)) for seed in tasks.task_seeds.tolist()]
        seeds = tasks.task_seeds.to(x.device) if s.init_draw == "device" else None
        navigator = Navigator([x.shape[2], *s.hidden, 1], generators, s.init_tasks, x.device, x.dtype,
                              s.negative_slope, requires_grad=s.solver == "autograd", seeds=seeds)
        trainer = make_trainer(navigator, s, compute_dtype(resolve_precision(s.precision, x.device)))
        forward, prototypes, em_steps = self.em_loop(trainer, x, one_hot, prototypes, generators, tasks.ways)
        # For inspection (plots): the chunk, in the preprocessed space (support rows, then queries).
        state = {"initial_prototypes": initial_prototypes, "prototypes": prototypes, "rows": x, "forward": forward,
                 "em_steps": em_steps}
        return forward, state

    def em_loop(self, trainer: Trainer, rows: torch.Tensor, one_hot: torch.Tensor, prototypes: torch.Tensor,
                generators: list[torch.Generator], ways: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EM steps then the final E-step (Algorithm 1); returns ``(π_f, prototypes, EM steps run)``.

        With ``early_stop_tol`` a task whose prototypes moved by at most the tolerance (max abs change)
        gets its final E-step at once and leaves the batch, so its result does not depend on the others.
        """
        if getattr(trainer, "fixed_batch", False):  # the compiled engine: finished tasks frozen by a mask
            return masked_em_loop(self, trainer, rows, one_hot, prototypes, generators, ways)
        s = self.settings
        total, num_support = rows.shape[0], one_hot.shape[1]
        forward_out = rows.new_empty(total, rows.shape[1] - num_support, ways)
        prototypes_out = prototypes.clone()
        em_steps = torch.full((total,), s.em_steps, dtype=torch.long)
        active = torch.arange(total, device=rows.device)  # chunk rows of the tasks still running

        def final_e_step(index: torch.Tensor, trainer: Trainer, protos: torch.Tensor,
                         gens: list[torch.Generator]) -> None:
            if s.reinit_navigator:
                trainer.reinit(gens)
            before = self._snapshot(trainer)
            forward, backward = trainer.run(rows[active[index], num_support:], protos, ways)
            self._report(None, active[index], trainer, before, protos, forward, backward)
            forward_out[active[index]] = forward.detach()
            prototypes_out[active[index]] = protos

        steps = range(s.em_steps)
        if self.show_progress and self.cpu_workers(rows.device) <= 1:
            steps = tqdm(steps, desc=f"putm EM ({total} tasks)", leave=False, disable=None)
        for step in steps:
            if s.reinit_navigator:  # Algorithm 1: a new navigator (and Adam state) every EM step
                trainer.reinit(generators)
            rows_now = rows[active] if len(active) < total else rows
            before = self._snapshot(trainer)
            # E-step: inner_steps Adam steps of the navigator on the CT loss -> (π_f, π_b)
            forward, backward = trainer.run(rows_now[:, num_support:], prototypes, ways)
            # M-step: query weights from the chosen navigator, class means, inertia μ ← μ + a(μ̂ − μ)
            weights = self.update_weights(forward, backward)
            updated = self.m_step(rows_now, one_hot[active], weights, prototypes, s.inertia)
            self._report(step, active, trainer, before, prototypes, forward, backward, weights, updated)
            done = self.settled(prototypes, updated)
            prototypes = updated
            if done is None or not bool(done.any()):
                continue
            # early stop: settled tasks get their final E-step now and leave the batch
            finished = done.nonzero().squeeze(1)
            em_steps[active[finished].cpu()] = step + 1
            final_e_step(finished, trainer.select(finished), prototypes[finished],
                         [generators[i] for i in finished.tolist()])
            keep = (~done).nonzero().squeeze(1)
            if len(keep) == 0:
                return forward_out, prototypes_out, em_steps
            trainer, prototypes = trainer.select(keep), prototypes[keep]
            generators = [generators[i] for i in keep.tolist()]
            active = active[keep]
        # the final E-step gives the prediction π_f for the tasks still running
        final_e_step(torch.arange(len(active), device=rows.device), trainer, prototypes, generators)
        return forward_out, prototypes_out, em_steps

    def _snapshot(self, trainer: Trainer) -> torch.Tensor | None:
        """A copy of the navigator weights for :attr:`em_step_hook` (``None`` when no hook listens)."""
        return None if self.em_step_hook is None else trainer.navigator.flat.detach().clone()

    def _report(self, step: int | None, active: torch.Tensor, trainer: Trainer, before: torch.Tensor | None,
                prototypes: torch.Tensor, forward: torch.Tensor, backward: torch.Tensor,
                weights: torch.Tensor | None = None, updated: torch.Tensor | None = None) -> None:
        if self.em_step_hook is not None and before is not None:
            self.em_step_hook(EMStep(step, active.clone(), trainer, before, trainer.navigator.flat.detach().clone(),
                                     prototypes, forward.detach(), backward.detach(), weights, updated))

    def settled(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor | None:
        """Per-task ``max |Δμ| <= early_stop_tol`` (``None`` when early stopping is off)."""
        return settled(before, after, self.settings.early_stop_tol)

    def e_step(self, navigator: Navigator, optimiser: torch.optim.Optimizer, query: torch.Tensor,
               prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One E-step with autograd and a given optimiser (see :func:`e_step_autograd`)."""
        return e_step_autograd(navigator, optimiser, query, prototypes, ways, self.settings)

    def update_weights(self, forward: torch.Tensor, backward: torch.Tensor) -> torch.Tensor:
        """Query weights of the M-step: forward (default), backward, or the ρ-mixture of both navigators."""
        return query_weights(forward, backward, self.settings.prototype_update, self.settings.rho)

    m_step = staticmethod(m_step)


__all__ = ["ADAM_EPS", "CPU_MAX_CHUNK_TASKS", "EMStep", "GEMM_MIN_WIDTH", "PRECISIONS", "PROTOTYPE_UPDATES", "PUTM",
           "PUTMSettings", "SOLVERS", "AutogradTrainer", "CompiledTrainer", "DeviceAdam", "FusedTrainer", "Navigator",
           "StackedAdam",
           "canonical_query_order", "ct_loss", "ct_loss_gradient", "e_step_autograd", "matmul_precision",
           "resolve_precision", "resolve_solver", "select_tasks"]
