"""The ``compiled`` E-step engine: the ``fused`` engine's mathematics in a form a GPU runs at full speed.

Not part of the paper (a speed option). Three things stop the ``fused`` engine (:mod:`.engines`) from being
captured in a CUDA graph or compiled well, and this engine removes each:

* Adam's step counter and bias corrections are Python numbers that change every step: here they live in a
  device tensor (:class:`.adam.StackedAdam` with ``on_device=True``), and the update is torch's own fused Adam
  kernel over the one flat buffer of all navigators.
* the fused engine writes through ``out=`` into preallocated buffers: here the same step function
  (:func:`.step.navigator_step`) runs without buffers, where it is pure, so ``torch.compile`` can fuse it.
* early stopping shrinks the batch: this engine has a fixed batch (:attr:`CompiledEngine.fixed_batch`), so
  the EM loop (:mod:`.em`) freezes finished tasks instead and every E-step has the same shapes.

On CUDA the ``inner_steps`` Adam steps of an E-step are captured once in a CUDA graph and replayed (static
input and output buffers); :func:`.step.navigator_step` is compiled there too. On CPU the same step function
runs eagerly unless ``compile_step=True``: on a 2-core CPU compiling did not pay off (docs/gpu.md).
The navigator re-draw can run on the device (``init_draw=device``, :func:`.navigator.device_normal`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from lightning_putm.methods.putm.adam import StackedAdam
from lightning_putm.methods.putm.engines import Engine, FusedEngine
from lightning_putm.methods.putm.navigator import Navigator
from lightning_putm.methods.putm.settings import PUTMSettings
from lightning_putm.methods.putm.step import navigator_step, pair_inputs
from lightning_putm.signals import check_stop


class CompiledEngine(Engine):
    """The E-step's ``inner_steps`` Adam steps as :func:`navigator_step` + device-side Adam (``solver=compiled``).

    ``compile_step``: ``torch.compile`` the step function (``None``: only on CUDA). ``use_graph``: capture the
    inner loop in a CUDA graph (``None``: on CUDA). Re-draws are the navigator's (on the device with
    ``init_draw=device``, :meth:`Navigator.redraw`).
    The batch never shrinks (:attr:`fixed_batch`): the EM loop freezes finished tasks instead.
    """

    fixed_batch = True

    def __init__(self, navigator: Navigator, settings: PUTMSettings, compute_dtype: torch.dtype,
                 compile_step: bool | None = None,
                 use_graph: bool | None = None) -> None:
        super().__init__(navigator, settings, compute_dtype)
        device = navigator.flat.device
        self.adam = StackedAdam(navigator.flat, settings.lr, settings.adam_betas, on_device=True)
        on_cuda = device.type == "cuda"
        self.compile_step = on_cuda if compile_step is None else compile_step
        self.use_graph = on_cuda if use_graph is None else use_graph
        if self.use_graph and not on_cuda:
            raise ValueError("CUDA graphs need a CUDA device; pass use_graph=None or False")
        self.step_function: Callable = torch.compile(navigator_step, dynamic=False) if self.compile_step \
            else navigator_step
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: dict[str, torch.Tensor] = {}
        self._runs_seen: set[tuple] = set()

    @classmethod
    def bytes_per_task(cls, pairs: int, m: int, settings: PUTMSettings) -> int:
        """The ``fused`` engine's buffers: the same step function, its intermediates allocated instead of
        preallocated."""
        return FusedEngine.bytes_per_task(pairs, m, settings)

    def reinit(self, generators: list[torch.Generator]) -> None:
        """A new navigator (Algorithm 1) and fresh Adam state, in place (the CUDA graph stays valid)."""
        self.navigator.redraw(generators)
        self.adam.reset()

    def one_step(self, inputs: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One Adam step; returns ``(π_f, π_b)`` before the update."""
        s, nav = self.settings, self.navigator
        arguments = (inputs, cost, nav.stored, nav.biases, nav.widths[-1], s.negative_slope, s.rho, s.theta,
                     self.compute_dtype)
        try:
            forward, backward, grad = self.step_function(*arguments)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop an evaluation
            if self.step_function is navigator_step:
                raise
            # the step is pure (nothing was updated yet), so the eager function gives this step's exact result
            fall_back("torch.compile of the navigator step", exc)
            self.step_function = navigator_step
            forward, backward, grad = navigator_step(*arguments)
        self.adam.step(grad)
        return forward, backward

    def inner_loop(self, inputs: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        forward = backward = cost
        for _ in range(self.settings.inner_steps):
            check_stop()  # eager only: a CUDA graph replays the loop without Python (em.py checks every E-step)
            forward, backward = self.one_step(inputs, cost)
        return forward, backward

    @torch.no_grad()
    def run(self, query: torch.Tensor, prototypes: torch.Tensor, ways: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``inner_steps`` Adam steps on the CT loss; returns ``(π_f, π_b)`` of the last step, pre-update."""
        squared, cost = pair_inputs(query, prototypes)
        inputs = squared.to(self.compute_dtype)
        if self.use_graph:
            try:
                return self._run_graph(inputs, cost)
            except Exception as exc:  # noqa: BLE001 - a capture failure must not stop an evaluation
                # the warm-up and the capture fail before they change the navigator or Adam state (a captured
                # graph runs nothing until replayed), so the eager loop below gives this E-step's result
                fall_back("the CUDA graph of the E-step", exc)
                self.use_graph, self._graph, self._static = False, None, {}
        return self.inner_loop(inputs, cost)

    def _run_graph(self, inputs: torch.Tensor, cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CUDA: the first call of a shape runs eagerly (warm-up, compilation); the second captures the inner
        loop into a graph on static buffers; every later call copies its inputs in and replays."""
        shape = (tuple(inputs.shape), tuple(cost.shape))
        if shape not in self._runs_seen:
            self._runs_seen.add(shape)
            stream = torch.cuda.Stream(device=inputs.device)
            stream.wait_stream(torch.cuda.current_stream(inputs.device))
            with torch.cuda.stream(stream):
                result = self.inner_loop(inputs, cost)
            torch.cuda.current_stream(inputs.device).wait_stream(stream)
            return result
        static = self._static
        if self._graph is None or static["inputs"].shape != inputs.shape or static["cost"].shape != cost.shape:
            static["inputs"], static["cost"] = inputs.clone(), cost.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static["forward"], static["backward"] = self.inner_loop(static["inputs"], static["cost"])
            self._graph = graph
        static["inputs"].copy_(inputs)
        static["cost"].copy_(cost)
        self._graph.replay()
        return static["forward"].clone(), static["backward"].clone()


def fall_back(what: str, exc: BaseException) -> None:
    """One warning when a GPU speed-up fails and the engine continues with the same mathematics, eagerly."""
    warnings.warn(f"putm solver=compiled: {what} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                  "continuing without it (same results, slower). Please report this with your torch and GPU versions",
                  RuntimeWarning, stacklevel=3)
