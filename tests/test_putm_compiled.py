"""The ``compiled`` PUTM engine (issue 15): device-side Adam, pure step function, device draw, mask-freeze.

The ``fused`` engine is the specification: ``compiled`` must agree with it to float rounding (same argmax on
≥ 99.5% of queries, mean accuracy within 0.1 points). Small problems (d = 32, few EM/Adam steps) and one
thread keep the file to a few seconds on CPU; CUDA-only checks are marked ``cuda``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_clustered_features
from lightning_putm.data.episodes import sample_episode_bank
from lightning_putm.errors import ConfigError
from lightning_putm.methods.putm import PUTM, PUTMSettings
from lightning_putm.methods.putm.adam import StackedAdam
from lightning_putm.methods.putm.compiled import CompiledEngine
from lightning_putm.methods.putm.engines import FusedEngine
from lightning_putm.methods.putm.navigator import Navigator, device_normal
from lightning_putm.methods.putm.solvers import make_engine, resolve_solver
from lightning_putm.methods.putm.step import navigator_step
from lightning_putm.metrics import task_accuracy

pytestmark = pytest.mark.usefixtures("single_thread")

FAST = dict(em_steps=3, inner_steps=4, precision="fp32")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_tasks(tasks: int = 6, queries: int = 15, dim: int = 32, seed: int = 0, spread: float = 0.35):
    features = make_clustered_features(classes=8, per_class=50, dim=dim, spread=spread, seed=seed)
    bank = sample_episode_bank(features.labels, 5, 1, queries, 2.0, tasks, seed)
    return bank.gather(features.features)


def navigator_for(tasks: int, dim: int = 12, hidden: tuple[int, ...] = (16, 8), seed: int = 0) -> Navigator:
    generators = [torch.Generator().manual_seed(seed + t) for t in range(tasks)]
    return Navigator([dim, *hidden, 1], generators, 1000, torch.device("cpu"), torch.float32, 0.01,
                     requires_grad=False)


def test_compiled_agrees_with_fused_on_a_few_hundred_tasks():
    # kills: a wrong gradient term, a wrong Adam constant, a wrong bias/LeakyReLU fold in navigator_step
    gathered = make_tasks(tasks=300, queries=10, dim=16, spread=1.0)
    options = dict(em_steps=3, inner_steps=4, precision="fp32", max_chunk_tasks=300)
    fused = PUTM(shots=1, balanced=False, solver="fused", **options).predict(gathered.batch)
    compiled = PUTM(shots=1, balanced=False, solver="compiled", **options).predict(gathered.batch)
    same = (fused.argmax(2) == compiled.argmax(2)).double().mean().item()
    accuracy = [100 * task_accuracy(p, gathered.query_labels).mean().item() for p in (fused, compiled)]
    assert same >= 0.995
    assert abs(accuracy[0] - accuracy[1]) <= 0.1
    assert 30 < accuracy[0] < 90  # the tasks are neither trivial nor hopeless, so agreement means something
    assert (fused - compiled).abs().max().item() < 1e-2


@pytest.mark.parametrize("options", [dict(balanced=True), dict(reinit_navigator=True),
                                     dict(prototype_update="mixed", rho=0.7, theta=0.2), dict(precision="bf16")])
def test_compiled_agrees_with_fused_under_options(options):
    """In fp32 within twice the noise floor: how far ``fused`` itself moves when the features move by one rounding
    error (× (1 ± 2⁻²³), as crosscheck_putm.py). A fixed 1e-4 failed on another CPU (2026-11-28, MKL's
    reproducibility mode: the ρ-mixture case 1.1e-4 against a floor of 2.0e-4; without the mode 3e-8)."""
    gathered = make_tasks(tasks=6)
    balanced = options.pop("balanced", False)
    settings = {**FAST, **options}
    fused = PUTM(shots=1, balanced=balanced, solver="fused", **settings).predict(gathered.batch)
    compiled = PUTM(shots=1, balanced=balanced, solver="compiled", **settings).predict(gathered.batch)
    if settings["precision"] == "bf16":
        assert torch.allclose(fused, compiled, atol=2e-2)
        return
    floor = max((PUTM(shots=1, balanced=balanced, solver="fused", **settings).predict(dataclasses.replace(
        gathered.batch, support=gathered.batch.support * factor, query=gathered.batch.query * factor)) - fused)
        .abs().max().item() for factor in (1 + 2**-23, 1 - 2**-24))
    assert (fused - compiled).abs().max().item() <= max(2 * floor, 1e-6)


def test_step_function_gradient_equals_the_fused_engines():
    # the pure step function must give the fused engine's π_f, π_b and flat gradient (layout included)
    navigator = navigator_for(3)
    settings = PUTMSettings(rho=0.6, theta=0.1, inner_steps=1, hidden=(16, 8))
    fused = FusedEngine(navigator, settings, torch.float32)
    generator = torch.Generator().manual_seed(1)
    query, prototypes = torch.rand(3, 7, 12, generator=generator), torch.rand(3, 4, 12, generator=generator)
    squared = (query.unsqueeze(2) - prototypes.unsqueeze(1)).pow(2)
    inputs, cost = squared.reshape(3, 28, 12), squared.sum(-1)
    forward, backward, grad = navigator_step(inputs, cost, navigator.stored, navigator.biases, 1, 0.01, 0.6, 0.1,
                                             torch.float32)
    fused.adam.step = lambda g: None  # keep the weights: compare the gradient of the same point
    expected_forward, expected_backward = fused.run(query, prototypes, 4)
    assert torch.allclose(forward, expected_forward, atol=1e-6) and torch.allclose(backward, expected_backward,
                                                                                      atol=1e-6)
    assert grad.shape == navigator.flat.shape
    assert torch.allclose(grad, fused.grad, rtol=1e-5, atol=1e-7)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("fused", [True, False])
def test_device_adam_equals_stacked_adam(fused):
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(300, generator=generator)
    reference, device = start.clone(), start.clone()
    stacked, adam = StackedAdam(reference, 1e-2, (0.5, 0.99)), StackedAdam(device, 1e-2, (0.5, 0.99), on_device=True)
    adam.fused = fused and adam.fused  # both the fused kernel and the tensor-op fallback
    for step in range(6):
        grad = torch.randn(300, generator=generator)
        stacked.step(grad)
        adam.step(grad)
        assert torch.allclose(device, reference, rtol=1e-6, atol=1e-7), step
    assert not torch.equal(device, start)
    adam.reset()
    assert adam.exp_avg.abs().sum() == 0 and adam.exp_avg_sq.abs().sum() == 0 and int(adam.steps) == 0


@pytest.mark.parametrize("fused", [True, False])
def test_device_adam_counts_steps_in_a_tensor_only(fused, monkeypatch):
    # kills a mutant keeping the step count or bias corrections in Python numbers (not capturable in a graph):
    # no Python counter may change, and no tensor may be read back into Python during a step
    adam = StackedAdam(torch.zeros(10), 1e-3, (0.5, 0.99), on_device=True)
    adam.fused = fused and adam.fused
    plain_before = {k: v for k, v in vars(adam).items() if not isinstance(v, torch.Tensor)}
    counter = adam.steps

    def no_readback(*args):
        raise AssertionError("a device tensor was read back into Python during an Adam step")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, no_readback)
        for _ in range(3):
            adam.step(torch.ones(10))
    plain_after = {k: v for k, v in vars(adam).items() if not isinstance(v, torch.Tensor)}
    assert plain_after == plain_before
    assert isinstance(adam.steps, torch.Tensor) and adam.steps.device == adam.params.device
    assert adam.steps is counter and float(counter) == 3.0  # updated in place: a graph replay sees it


def test_device_draw_is_chunk_independent_and_deterministic():
    seeds = torch.tensor([3, 99, 2**40 + 5, 7])
    together = device_normal(seeds, draw=2, layer=1, shape=(20, 9), max_elements=50)  # several task slices
    for t in range(len(seeds)):
        alone = device_normal(seeds[t : t + 1], draw=2, layer=1, shape=(20, 9))
        assert torch.equal(alone[0], together[t])
    assert torch.equal(device_normal(seeds, 2, 1, (20, 9)), together)
    assert not torch.allclose(device_normal(seeds, 3, 1, (20, 9)), together)  # a new draw: new values
    assert not torch.allclose(device_normal(seeds, 2, 0, (20, 9)), together)  # another layer: new values
    assert not torch.allclose(together[0], together[3])  # tasks differ
    many = device_normal(torch.arange(4), 0, 0, (100, 100)).flatten()
    assert abs(many.mean().item()) < 0.02 and abs(many.std().item() - 1) < 0.02  # standard normals


@pytest.mark.parametrize("solver", ["compiled", "fused"])
def test_device_draw_keeps_a_task_alone_equal_to_in_a_batch(solver):
    gathered = make_tasks(tasks=5)
    options = dict(solver=solver, init_draw="device", reinit_navigator=True, **FAST)
    together = PUTM(shots=1, balanced=False, **options).predict(gathered.batch)
    cpu_draw = PUTM(shots=1, balanced=False, **{**options, "init_draw": "cpu"}).predict(gathered.batch)
    assert not torch.equal(together, cpu_draw)  # the option changes the draw
    for t in (0, 3):
        alone = PUTM(shots=1, balanced=False, **options).predict(gathered.batch.slice(t, t + 1))
        assert torch.allclose(alone, together[t : t + 1], atol=1e-5)
        assert torch.equal(alone.argmax(2), together[t : t + 1].argmax(2))


def test_mask_freeze_early_stop_matches_solving_alone():
    gathered = make_tasks(tasks=6)
    options = dict(solver="compiled", early_stop_tol=0.03, em_steps=8, inner_steps=4, precision="fp32")
    whole = PUTM(shots=1, balanced=False, **options)
    together = whole.predict(gathered.batch)
    steps = whole.last_state["em_steps"]
    assert int(steps.min()) < int(steps.max())  # tasks stopped at different EM steps: the mask mattered
    fused = PUTM(shots=1, balanced=False, **{**options, "solver": "fused"})
    fused_probabilities = fused.predict(gathered.batch)
    assert torch.equal(fused.last_state["em_steps"], steps)  # same stopping decisions as the shrinking loop
    assert torch.allclose(fused_probabilities, together, atol=1e-4)
    for t in range(6):
        method = PUTM(shots=1, balanced=False, **options)
        alone = method.predict(gathered.batch.slice(t, t + 1))
        assert int(method.last_state["em_steps"][0]) == int(steps[t])
        assert torch.allclose(alone, together[t : t + 1], atol=1e-5)
        assert torch.allclose(method.last_state["prototypes"], whole.last_state["prototypes"][t : t + 1], atol=1e-5)


def test_auto_is_fused_on_cpu_and_compiled_on_cuda(monkeypatch):
    """``auto`` on a CUDA device the fused kernel has not been measured on (an sm_80 GPU here; sm_90 picks
    ``triton``, tests/test_putm_triton.py) is ``compiled``."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert resolve_solver("auto", torch.device("cpu")) == "fused"
    assert resolve_solver("auto", torch.device("cuda")) == "compiled"
    assert resolve_solver("autograd", torch.device("cuda")) == "autograd"
    settings = PUTMSettings(hidden=(16, 8))
    assert type(make_engine(navigator_for(2), settings, torch.float32)) is FusedEngine
    # a CUDA device, monkeypatched: make_engine must build the compiled engine (no CUDA graph on a CPU navigator)
    monkeypatch.setattr("lightning_putm.methods.putm.solvers.resolve_solver",
                        lambda solver, device, precision: resolve_solver(solver, torch.device("cuda"), precision))
    assert type(make_engine(navigator_for(2), settings, torch.float32)) is CompiledEngine


def test_every_solver_names_an_engine_whose_own_estimate_sizes_the_chunks():
    """Each ``solver`` value but ``auto`` (``settings.ENGINES``) names a concrete :class:`Engine` subclass, and
    PUTM's memory per task is the preprocessing's rows plus the estimate of the engine that will run. Kills: a
    registry line naming a missing or wrong class, an engine without its own ``run``/``reinit``/``bytes_per_task``
    (abstract, not instantiable), chunks sized by one engine's estimate whatever the solver (``autograd`` keeps
    every layer's activations for its backward: a larger estimate than ``fused``'s)."""
    import inspect

    from lightning_putm.methods.putm.engines import Engine
    from lightning_putm.methods.putm.settings import ENGINES, SOLVERS
    from lightning_putm.methods.putm.solvers import engine_class

    assert SOLVERS == ("auto", *ENGINES) and set(ENGINES) == {"fused", "autograd", "compiled", "triton",
                                                                     "hopper"}
    for solver in ENGINES:
        engine = engine_class(solver)
        assert issubclass(engine, Engine) and not inspect.isabstract(engine), solver
        assert engine.__name__.endswith("Engine") and solver in engine.__name__.lower(), solver
    batch = make_tasks(tasks=2).batch
    m = min(batch.dim, batch.num_support + batch.num_queries)
    rows = {}
    for solver in ("fused", "autograd", "compiled"):
        settings = PUTMSettings(solver=solver)
        own = engine_class(solver).bytes_per_task(batch.num_queries * batch.ways, m, settings)
        rows[solver] = PUTM(settings, shots=1, balanced=False).bytes_per_task(batch) - own
        assert own > 0
    assert len(set(rows.values())) == 1  # the preprocessing's share does not depend on the engine
    assert engine_class("autograd").bytes_per_task(375, 80, PUTMSettings()) > engine_class("fused").bytes_per_task(
        375, 80, PUTMSettings())


def test_auto_on_cpu_is_byte_identical_to_fused():
    gathered = make_tasks(tasks=4)
    auto = PUTM(shots=1, balanced=False, **FAST)
    assert auto.settings.solver == "auto"
    fused = PUTM(shots=1, balanced=False, solver="fused", **FAST)
    assert torch.equal(auto.predict(gathered.batch), fused.predict(gathered.batch))


def test_bad_options_fail_with_the_key():
    with pytest.raises(ConfigError, match="putm.init_draw"):
        PUTM(shots=1, balanced=False, init_draw="gpu")
    with pytest.raises(ConfigError, match="putm.solver=compiled needs hidden widths"):
        PUTM(shots=1, balanced=False, solver="compiled", hidden=[16, 4])
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CompiledEngine(navigator_for(1), PUTMSettings(hidden=(16, 8)), torch.float32, use_graph=True)


def test_a_failing_compiler_or_graph_capture_falls_back_to_the_same_eager_result(monkeypatch):
    # kills: a fallback that skips the failed step, applies Adam twice, or lets the error stop the evaluation
    settings = PUTMSettings(inner_steps=3, hidden=(16, 8))
    generator = torch.Generator().manual_seed(4)
    query, prototypes = torch.rand(3, 7, 12, generator=generator), torch.rand(3, 4, 12, generator=generator)
    eager = CompiledEngine(navigator_for(3), settings, torch.float32, compile_step=False)
    expected = eager.run(query, prototypes, 4)

    def broken_compiler(function, **kwargs):
        def compiled(*args):
            raise RuntimeError("inductor exploded\nlong traceback")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compiler)
    trainer = CompiledEngine(navigator_for(3), settings, torch.float32, compile_step=True)
    with pytest.warns(RuntimeWarning, match=r"torch.compile of the navigator step failed \(RuntimeError: inductor exploded\)"):
        got = trainer.run(query, prototypes, 4)
    assert torch.equal(got[0], expected[0]) and torch.equal(trainer.navigator.flat, eager.navigator.flat)
    # a CUDA-graph capture that fails (here: no CUDA stream on this machine) leaves the state untouched
    graphed = CompiledEngine(navigator_for(3), settings, torch.float32)
    graphed.use_graph = True
    with pytest.warns(RuntimeWarning, match="the CUDA graph of the E-step failed"):
        got = graphed.run(query, prototypes, 4)
    assert torch.equal(got[0], expected[0]) and torch.equal(graphed.navigator.flat, eager.navigator.flat)
    assert graphed.use_graph is False


@pytest.mark.slow
def test_compiled_step_function_agrees_on_cpu():
    # torch.compile on CPU (inductor, C++ codegen): slow to compile, so marked slow
    navigator = navigator_for(3)
    settings = PUTMSettings(inner_steps=3, hidden=(16, 8))
    generator = torch.Generator().manual_seed(2)
    query, prototypes = torch.rand(3, 7, 12, generator=generator), torch.rand(3, 4, 12, generator=generator)
    eager = CompiledEngine(navigator, settings, torch.float32, compile_step=False)
    compiled = CompiledEngine(navigator_for(3), settings, torch.float32, compile_step=True)
    expected, got = eager.run(query, prototypes, 4), compiled.run(query, prototypes, 4)
    assert torch.allclose(expected[0], got[0], atol=1e-5)  # π_f after two Adam updates: the step is right
    assert torch.equal(expected[0].argmax(2), got[0].argmax(2))
    # Adam moves each weight by about lr·m̂/√v̂ whatever the gradient's size, so a gradient that is rounding noise
    # (the last bias: softmax is shift-invariant, its gradient sums to ~0) moves by up to a few lr in either
    # implementation; measured 2026-11-23: max 1.7e-3 after 3 steps, π_f within 5e-7
    moved = (eager.navigator.flat - compiled.navigator.flat).abs()
    assert moved.max() < 5 * settings.lr


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graph_engine_agrees_with_fused_on_cuda(precision):
    gathered = make_tasks(tasks=64)
    batch = gathered.batch.to(torch.device("cuda"))
    options = dict(em_steps=4, inner_steps=5, precision=precision)
    fused = PUTM(shots=1, balanced=False, solver="fused", **{**options, "precision": "fp32"}).predict(batch)
    method = PUTM(shots=1, balanced=False, solver="auto", **options)
    compiled = method.predict(batch)
    assert compiled.device.type == "cuda"
    same = (fused.argmax(2) == compiled.argmax(2)).double().mean().item()
    assert same >= (0.995 if precision == "fp32" else 0.95)


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_replays_the_eager_inner_loop():
    device = torch.device("cuda")
    settings = PUTMSettings(inner_steps=4, hidden=(16, 8))
    query, prototypes = torch.rand(3, 7, 12, device=device), torch.rand(3, 4, 12, device=device)
    # each navigator draws from its own generators: shared ones would give the second different weights
    trainers = [CompiledEngine(Navigator([12, 16, 8, 1], [torch.Generator().manual_seed(t) for t in range(3)],
                                          1000, device, torch.float32, 0.01, False),
                                settings, torch.float32, compile_step=False, use_graph=graph)
                for graph in (False, True)]
    for _ in range(3):  # eager warm-up, capture, replay
        results = [trainer.run(query, prototypes, 4) for trainer in trainers]
        assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert trainers[1]._graph is not None
    assert torch.allclose(trainers[0].navigator.flat, trainers[1].navigator.flat, atol=1e-5)
