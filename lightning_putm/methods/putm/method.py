"""The PUTM method class: Algorithm 1 on a chunk of tasks (the package's docstring walks through it).

In its own module so that the package, and :mod:`.settings` with it, import without torch: ``from
lightning_putm.methods.putm import PUTM`` loads this module on first use.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch
from tqdm.auto import tqdm

from lightning_putm.methods.preprocessing import (check_power_transform_input, l2_normalise, power_transform,
                                                  reduce_basis, resolve_basis)
from lightning_putm.errors import ConfigError
from lightning_putm.methods.putm.em import EMStep, em_loop
from lightning_putm.methods.putm.engines import Engine
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.plumbing import ChunkedSolver
from lightning_putm.methods.putm.precision import compute_dtype, resolve_precision
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.methods.putm.solvers import make_engine
from lightning_putm.tasks import TaskBatch, weighted_class_means
from lightning_putm.methods.registry import register_method

if TYPE_CHECKING:
    from lightning_putm.methods.putm.engines import Engine


@register_method("putm")
class PUTM(ChunkedSolver):
    """The CT-EM solver of PUTM, batched over tasks."""

    plot_slot = 0  # its colour and marker in every figure
    display_name = "PUTM"
    Settings = PUTMSettings

    def __init__(self, settings: PUTMSettings | None = None, *, shots: int | None = None, balanced: bool = False,
                 engine: type[Engine] | None = None, **options: Any) -> None:
        """``settings`` or keyword options (``method.putm.*``; :class:`PUTMSettings` declares them), resolved for
        ``shots`` (inertia) and the protocol (``balanced``: rho, theta); also ``memory_budget_mb`` and
        ``show_progress``. Without ``shots``, ``inertia`` must be given.

        ``engine``: an :class:`~.engines.Engine` subclass to run the E-steps instead of ``solver``'s, for engines
        that are no ``solver`` value (Python only, not a config key): the tests run the Hopper kernel's CPU
        emulation, :class:`.hopper.emulate.EmulatedEngine`, through the method this way."""
        if engine is not None and not (isinstance(engine, type) and issubclass(engine, Engine)):
            raise ConfigError(f"putm: engine must be an Engine subclass (Python only; a config chooses the engine "
                              f"with method.putm.solver), got {engine!r}")
        super().__init__(settings, shots=shots, balanced=balanced, **options)
        self.engine = engine
        self.settings: PUTMSettings
        self.last_state: dict[str, torch.Tensor] = {}
        #: The precision the last chunk actually ran in (``auto`` resolved for its device).
        self.last_precision: str | None = None
        #: Called with an :class:`EMStep` after every E-step (inspection and tests); ``None``: off.
        self.em_step_hook: Callable[[EMStep], None] | None = None

    def check_features(self, features: torch.Tensor) -> None:
        check_power_transform_input(features, self.settings.beta, self.name)

    def preprocess(self, tasks: TaskBatch) -> torch.Tensor:
        """Rows ``[T, S+Q, m]`` (§3.1): power transform, per-task basis (``basis``: QR, or the sign-equivalent
        Cholesky factor of the Gram matrix, :mod:`..preprocessing`; ``auto``: :func:`resolve_basis`), L2
        normalisation."""
        x = torch.cat([tasks.support, tasks.query], dim=1)
        x = power_transform(x, self.settings.beta, self.name)
        basis = resolve_basis(self.settings.basis, x.device)
        coords, _ = reduce_basis(x, basis, self.name, warn=self.settings.basis != "auto")
        return l2_normalise(coords)

    def solve_tasks(self, tasks: TaskBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Algorithm 1 on one chunk: preprocess, initial prototypes and navigators, the CT-EM loop."""
        s = self.settings
        with torch.no_grad():
            x = self.preprocess(tasks)
        one_hot = tasks.one_hot_support()
        prototypes = weighted_class_means(x[:, : tasks.num_support], one_hot)  # support class means
        if s.support_weight != 1.0:  # M-step weight of a support row against a query's navigator mass
            one_hot = one_hot * s.support_weight
        generators = [torch.Generator().manual_seed(int(seed)) for seed in tasks.task_seeds.tolist()]
        seeds = tasks.task_seeds.to(x.device) if s.init_draw == "device" else None
        navigator = Navigator([x.shape[2], *s.hidden, 1], generators, s.init_tasks, x.device, x.dtype,
                              s.negative_slope, requires_grad=s.solver == "autograd", seeds=seeds)
        engine = make_engine(navigator, s, compute_dtype(resolve_precision(s.precision, x.device)), self.engine)
        bar = self.show_progress and self.cpu_workers(x.device) <= 1  # worker threads: no bar per part
        progress = partial(tqdm, desc=f"putm EM ({len(x)} tasks)", leave=False, disable=None) if bar else iter
        forward, final_prototypes, em_steps = em_loop(engine, x, one_hot, prototypes, generators, tasks.ways, s,
                                                      self.em_step_hook, progress)
        # For inspection (plots): the chunk, in the preprocessed space (support rows, then queries).
        state = {"initial_prototypes": prototypes, "prototypes": final_prototypes, "rows": x, "forward": forward,
                 "em_steps": em_steps}
        return forward, state

