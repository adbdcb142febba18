"""PUTM: prototypes-oriented transductive few-shot learning with conditional transport.

Tian et al., "Prototypes-oriented Transductive Few-shot Learning with Conditional Transport", ICCV 2023
(arXiv 2308.03047), re-implemented from the paper and its reference code (github.com/RashLog/PUTM). All tasks
of a chunk are solved at once as stacked tensors ``[T, ...]`` on the input's device, with no Python loop
over tasks or pairs. Algorithm 1, step by step:

1. Preprocess each task (§3.1, :meth:`PUTM.preprocess`): power transform β, reduction to the task's own basis,
   L2 normalisation.
2. Prototypes start at the support class means; each task's navigator (:mod:`.navigator`) is drawn.
3. The CT-EM loop (:mod:`.em`), ``em_steps`` times: optionally re-draw the navigator (``reinit_navigator``);
   E-step: ``inner_steps`` Adam steps (:mod:`.adam`) of the navigator on the conditional-transport loss
   (:mod:`.loss`, :mod:`.step`), giving π_f and π_b; M-step (:mod:`.m_step`): prototypes from the support rows
   and the queries weighted by π_f (``prototype_update``), moved with inertia ``μ ← μ + a(μ̂ − μ)``.
4. A final E-step; the prediction is π_f(k|j).

The E-step runs on an engine (``solver``: :mod:`.engines`, :mod:`.compiled`, :mod:`.triton_engine`,
:mod:`.solvers`); with ``solver=triton`` the whole loop runs on the device (:mod:`.triton_em`). Speed and
determinism options that are not in the paper (memory sizing, ``max_chunk_tasks``, ``cpu_workers``, ``precision``,
``canonical_query_order``) are applied around the method by :mod:`.plumbing`.

The class is in :mod:`.method` and its options in :mod:`.settings`; this package loads the class (and torch) on
first use of ``PUTM``, so that reading PUTM's options (``--help``, config checks) imports no torch.
"""

from __future__ import annotations

from typing import Any

from lightning_putm.methods.putm.settings import PUTMSettings

__all__ = ["EMStep", "PUTM", "PUTMSettings"]

#: Names that load torch, imported on first use.
_LAZY = {"PUTM": "lightning_putm.methods.putm.method", "EMStep": "lightning_putm.methods.putm.em",
         "resolve_precision": "lightning_putm.methods.putm.precision"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
