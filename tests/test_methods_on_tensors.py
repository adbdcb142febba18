"""Every method callable on plain tensors (docs/python_api.md): ``Method(shots=, balanced=, **options)(support,
support_labels, query)`` gives evaluate.py's predictions on the same tasks, for one task and for a batch, and refuses
bad input with one line before any work.

The reference is evaluate.py's own runner (:func:`~lightning_putm.evaluation.evaluate_features`) on all twelve
methods, with a base-features file (so the base statistics reach the methods that use them), a Dirichlet 1-shot and a
balanced 5-shot setting, and every method's probabilities captured as the runner computed them. Options are made
cheap (few iterations) the same way on both sides; the whole file takes seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lightning_putm.methods as methods
from conftest import make_clustered_features
from lightning_putm.errors import ConfigError, DataError, FeatureError
from lightning_putm.evaluation import evaluate_features, load_evaluate_config, settings_from_config
from lightning_putm.evaluation import runner
from lightning_putm.features.files import save_features
from lightning_putm.methods import METHOD_CLASSES, available_methods
from lightning_putm.methods.bavardage import base_within_class_scatter
from lightning_putm.metrics import task_accuracy

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_thread")
#: Small iteration counts so that every method costs well under a second here (the same on both sides).
CHEAP: dict[str, dict[str, object]] = {"putm": {"em_steps": 2, "inner_steps": 3}, "tim": {"iterations": 10},
                                       "alpha_tim": {"iterations": 10}, "alpha_am": {"iterations": 10},
                                       "ilpc": {"denoising_iterations": 10}}
#: (shots, alpha): a Dirichlet 1-shot bank and a balanced 5-shot one, so shots and balanced both choose defaults.
SETTINGS = [(1, 2.0), (5, None)]
WAYS, QUERIES, TASKS = 4, 20, 3  # Q != N, so a [Q, N] / [N, Q] mix-up cannot pass
#: Methods whose defaults or behaviour ``balanced`` changes (docs/python_api.md's table); the others ignore it.
BALANCE_AWARE = {"putm", "tim", "laplacianshot", "ilpc", "bavardage"}
#: Methods that refuse to be built without ``shots`` (a default is chosen by shots), with the options that make
#: them so: UNEM needs shots only for the published values (nearest published shot count); its default,
#: learned=auto, is the untrained start when built on tensors (nothing fitted), which needs none.
SHOT_AWARE: dict[str, dict[str, object]] = {"putm": {}, "alpha_tim": {}, "laplacianshot": {}, "alpha_am": {},
                                            "unem": {"learned": "mini_resnet18"}}


@pytest.fixture(scope="module")
def features():
    return make_clustered_features(classes=8, per_class=30, dim=24)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Base-class features (other clusters) in a file, and the statistics docs/python_api.md says to compute."""
    base_set = make_clustered_features(classes=5, per_class=20, dim=24, seed=1)
    path = save_features(base_set, tmp_path_factory.mktemp("base") / "base.pt")
    mean = base_set.features.double().mean(0).float()
    return path, mean, base_within_class_scatter(base_set.features, base_set.labels, mean)


@pytest.fixture(scope="module")
def evaluated(single_thread, features, base):
    """evaluate.py's runner on all twelve methods: ``{(method, shots, alpha): (SettingResult, probabilities)}``,
    computed with one thread like every test here (tiny tensors: threads only cost spin-waits on a busy machine)."""
    captured: dict[tuple[str, int, bool], torch.Tensor] = {}
    real_build = runner.build_method

    def capturing_build(name, params=None, **context):
        method = real_build(name, params, **context)
        predict = method.predict

        def recorded(batch, on_chunk=None):
            captured[(name, context["shots"], context["balanced"])] = probabilities = predict(batch, on_chunk)
            return probabilities

        method.predict = recorded
        return method

    cheap = [f"method.{name}.{key}={value}" for name, options in CHEAP.items() for key, value in options.items()]
    overrides = [f"methods=[{','.join(available_methods())}]", "shots=[1,5]", "alphas=[2,balanced]",
                 f"tasks={TASKS}", f"ways={WAYS}", f"queries={QUERIES}", "progress=false", "device=cpu",
                 f"base_features={base[0]}", *cheap]
    settings = settings_from_config(load_evaluate_config(overrides))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "build_method", capturing_build)
        results = evaluate_features(features, settings, lambda _: None)
    return {(r.method, r.shots, r.alpha): (r, captured[(r.method, r.shots, r.alpha is None)]) for r in results}


def build(name: str, base, **context):
    """``name``'s class as a user builds it: keyword options, and the base statistics the method takes."""
    cls = METHOD_CLASSES[name]
    extra = {}
    if cls.uses_base_mean:
        extra["base_mean"] = base[1]
    if cls.uses_base_covariance:
        extra["base_covariance"] = base[2]
    return cls(**context, **extra, **CHEAP.get(name, {}))


def test_all_twelve_methods_are_importable_by_class_name() -> None:
    """Kills: a method missing from ``lightning_putm.methods`` (``from lightning_putm.methods import PUTM``), or a
    thirteenth registered method this file would silently not cover."""
    assert len(available_methods()) == 12
    for name in available_methods():
        cls = METHOD_CLASSES[name]
        assert getattr(methods, cls.__name__) is cls  # every registered class by its class name


@pytest.mark.parametrize("name", available_methods())
def test_a_batch_on_tensors_is_evaluate_py_on_the_same_tasks(name, features, base, evaluated) -> None:
    """``Method(shots=K, balanced=b, **options)(support, labels, query, task_seeds=bank seeds)`` on the bank's tensors
    equals the runner's probabilities bit for bit, and so its per-task accuracies.

    Kills: ``task_seeds`` ignored or re-ordered (PUTM), the labels or the ways rebuilt wrongly from the tensors, the
    inputs converted on the way (another dtype or device), a tensor path that solves otherwise than ``predict``, the
    base statistics of docs/python_api.md's recipe differing from ``base_features=``'s. (A constructor that drops
    ``balanced`` is the same class on both sides: the ``balanced`` test below kills that.)"""
    for shots, alpha in SETTINGS:
        result, expected = evaluated[(name, shots, alpha)]
        gathered = result.bank.gather(features.features)
        batch = gathered.batch
        method = build(name, base, shots=shots, balanced=alpha is None)
        got = method(batch.support, batch.support_labels, batch.query, task_seeds=result.bank.task_seeds)
        assert got.shape == (TASKS, QUERIES, WAYS)
        assert torch.equal(got, expected), (name, shots, alpha)
        assert torch.equal(task_accuracy(got, gathered.query_labels), result.accuracies)


@pytest.mark.parametrize("name", available_methods())
def test_one_task_on_tensors_is_that_task_in_evaluate_py(name, features, base, evaluated) -> None:
    """One task as ``[S, d]``, ``[S]``, ``[Q, d]`` with its bank seed as an int gives ``[Q, N]``: that task's row of
    the runner's probabilities. PUTM bit for bit (a task's result does not depend on its batch); the peers with the
    project's alone-or-in-a-batch tolerance (tests/test_peer_methods.py: same argmax, 1e-5): SimpleShot's and
    ProtoNet's distances take a batch-size-dependent path on the CPU (a 2e-7 difference measured here).

    Kills: the single-task squeeze wrong (``[1, Q, N]`` returned, or the wrong axis), an int seed ignored (PUTM would
    use seed 0 for every task), a single task's labels not given a task axis."""
    shots, alpha = SETTINGS[0]
    result, expected = evaluated[(name, shots, alpha)]
    batch = result.bank.gather(features.features).batch
    method = build(name, base, shots=shots, balanced=alpha is None)
    for t in range(TASKS):
        got = method(batch.support[t], batch.support_labels[t], batch.query[t], task_seeds=int(result.bank.task_seeds[t]))
        assert got.shape == (QUERIES, WAYS)
        if name == "putm":
            assert torch.equal(got, expected[t])
        else:
            assert torch.equal(got.argmax(1), expected[t].argmax(1))
            torch.testing.assert_close(got, expected[t], atol=1e-5, rtol=0)


def test_default_seeds_are_the_task_indices(features, evaluated) -> None:
    """Without ``task_seeds`` task ``t`` of a call gets seed ``t`` (one task: 0), so a call is reproducible; the bank's
    seeds give other results (PUTM's navigator draws differ).

    Kills: a default that ignores the task index (every task seed 0: task 1 would differ from seed 1), a random or
    clock-based default (two calls would differ), seeds that do not reach the navigator."""
    result, _ = evaluated[("putm", 1, 2.0)]
    batch = result.bank.gather(features.features).batch
    putm = methods.PUTM(shots=1, **CHEAP["putm"])
    default = putm(batch.support, batch.support_labels, batch.query)
    assert torch.equal(default, putm(batch.support, batch.support_labels, batch.query))
    assert torch.equal(default, putm(batch.support, batch.support_labels, batch.query, task_seeds=torch.arange(TASKS)))
    assert not torch.equal(default, putm(batch.support, batch.support_labels, batch.query,
                                         task_seeds=result.bank.task_seeds))
    one = putm(batch.support[1], batch.support_labels[1], batch.query[1])
    assert torch.equal(one, putm(batch.support[1], batch.support_labels[1], batch.query[1], task_seeds=0))
    assert not torch.equal(one, putm(batch.support[1], batch.support_labels[1], batch.query[1], task_seeds=1))
    assert torch.equal(default[1], putm(batch.support[1], batch.support_labels[1], batch.query[1], task_seeds=1))


@pytest.mark.parametrize("name", available_methods())
def test_balanced_defaults_to_dirichlet_and_changes_only_the_documented_methods(name, features, base, evaluated) -> None:
    """``balanced`` omitted = ``balanced=False`` (Dirichlet) for every method; ``balanced=True`` changes the results
    of exactly the methods docs/python_api.md lists (PUTM, TIM, LaplacianShot, iLPC, BAVARDAGE).

    Kills: a default of ``balanced=True`` (or ``None`` read differently) on any constructor, a method that drops
    ``balanced`` before its settings are resolved, the docs' table out of date."""
    result, _ = evaluated[(name, 1, 2.0)]
    b = result.bank.gather(features.features).batch
    tensors = (b.support, b.support_labels, b.query)
    omitted = build(name, base, shots=1)(*tensors)
    assert torch.equal(omitted, build(name, base, shots=1, balanced=False)(*tensors))
    balanced = build(name, base, shots=1, balanced=True)(*tensors)
    assert torch.equal(omitted, balanced) is (name not in BALANCE_AWARE)


@pytest.mark.parametrize("name", available_methods())
def test_shots_are_needed_only_where_a_default_depends_on_them(name, features, base) -> None:
    """A method whose defaults are chosen by the number of shots refuses to be built without ``shots`` (one line
    naming ``shots=K``); the others accept any support, even an uneven one.

    Kills: PUTM (or UNEM with its published values) silently taking its few-shot (or 1-shot) values when
    ``shots`` is omitted, a refusal of a method (or UNEM's default) that does not need shots."""
    cls = METHOD_CLASSES[name]
    if name in SHOT_AWARE:
        with pytest.raises(ConfigError, match=r"shots=K") as error:
            cls(**CHEAP.get(name, {}), **SHOT_AWARE[name])
        assert "\n" not in str(error.value)
        if not SHOT_AWARE[name]:
            return
    support, labels, query = uneven_task(features)
    probabilities = build(name, base)(support, labels, query)
    assert probabilities.shape == (len(query), 3)


def uneven_task(features):
    """A 3-way task with 1, 2 and 3 support rows per class, its labels interleaved (not class-major)."""
    rows = {c: torch.nonzero(features.labels == c).flatten() for c in range(3)}
    order = [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (2, 2)]  # (class, index within the class)
    support = torch.stack([features.features[rows[c][i]] for c, i in order])
    labels = torch.tensor([c for c, _ in order])
    query = torch.cat([features.features[rows[c][5:10]] for c in range(3)])
    return support, labels, query


def test_a_support_with_other_shots_is_refused(features, evaluated) -> None:
    """Built with ``shots=1``, a 5-shot support is refused with one line naming both numbers; an uneven support is
    refused by a method built with shots; a method whose shot-dependent option is set needs no shots.

    Kills: the shots check missing (PUTM would run 5-shot tasks with its 1-shot inertia), comparing against the
    wrong count (total support rows instead of rows per class)."""
    result, _ = evaluated[("putm", 5, None)]
    b = result.bank.gather(features.features).batch
    with pytest.raises(DataError, match=r"shots=1 but the support has 5 rows per class; build it with shots=5"):
        methods.PUTM(shots=1, **CHEAP["putm"])(b.support, b.support_labels, b.query)
    assert methods.PUTM(shots=5, **CHEAP["putm"])(b.support[0], b.support_labels[0], b.query[0]).shape == (QUERIES, WAYS)
    support, labels, query = uneven_task(features)
    with pytest.raises(DataError, match=r"1 to 3 rows per class"):
        methods.SimpleShot(shots=2)(support, labels, query)
    assert methods.PUTM(inertia=0.1, **CHEAP["putm"])(support, labels, query).shape == (len(query), 3)


def test_column_k_is_label_k_whatever_the_support_order(features) -> None:
    """Renaming two classes in the support swaps the two output columns; interleaved labels are read as labels.

    Kills: labels remapped by order of appearance, or the support assumed class-major (labels rebuilt as
    ``arange(N).repeat_interleave(K)``)."""
    support, labels, query = uneven_task(features)
    simpleshot = methods.SimpleShot()
    plain = simpleshot(support, labels, query)
    swapped = simpleshot(support, torch.tensor([1, 0, 2])[labels], query)
    torch.testing.assert_close(swapped, plain[:, [1, 0, 2]], atol=1e-6, rtol=0)
    assert (plain.argmax(1) == torch.arange(3).repeat_interleave(5)).all()


S, Q, D = 6, 9, 24
GOOD = (torch.rand(S, D), torch.arange(3).repeat(2), torch.rand(Q, D))


@pytest.mark.parametrize(("change", "error", "message"), [
    ({0: [[0.0] * D] * S}, FeatureError, r"^support must be a torch.Tensor of features \[S, d\] \(one task\) or "
                                         r"\[T, S, d\]"),
    ({0: torch.rand(D)}, FeatureError, r"^support must be \[S, d\] \(one task\) or \[T, S, d\].*got shape \[24\]"),
    ({0: torch.rand(S, D, dtype=torch.float64)}, FeatureError, r"^support must hold float32.*support.float\(\)"),
    ({2: torch.rand(Q, D + 1)}, FeatureError, r"^query must be \[Q, d=24\] to match support \[6, 24\], got shape "
                                              r"\[9, 25\]"),
    ({2: torch.rand(1, Q, D)}, FeatureError, r"^query must be \[Q, d\] like support \[6, 24\] \(one task and a batch "
                                             r"cannot be mixed\)"),
    ({2: torch.rand(Q, D, device="meta")}, FeatureError, r"^query is on meta but support is on cpu"),
    ({1: torch.arange(3).repeat(2).float()}, DataError, r"^support_labels must hold integer class labels.*\.long\(\)"),
    ({1: torch.arange(3)}, DataError, r"^support_labels must be \[6\] \(one label per support row\), got shape \[3\]"),
    ({1: torch.tensor([1, 2, 3, 1, 2, 3])}, DataError, r"^support_labels must use every class 0..3 .* no row of class "
                                                        r"0; map your classes to 0..N-1"),
    ({1: torch.tensor([0, 1, -1, 0, 1, 2])}, DataError, r"^support_labels must be class labels 0..N-1, got -1"),
    ({1: torch.zeros(S, dtype=torch.long)}, DataError, r"^support_labels hold a single class"),
    ({1: [0, 1, 2, 0, 1, 2]}, DataError, r"^support_labels must be a torch.Tensor of integer labels \[6\]"),
    ({3: [1, 2]}, ConfigError, r"^task_seeds must be an integer or a \[1\] tensor \(one task\), got shape \[2\]"),
    ({3: 0.5}, ConfigError, r"^task_seeds must be an integer"),
])
def test_bad_input_is_one_line_naming_the_argument_and_its_shape(change, error, message) -> None:
    """Each mistake is refused before any work with one line that names the argument and what it must be.

    Kills: a missing check that lets a wrong shape reach a method (an index error or a silent broadcast deep inside),
    a message that names the wrong argument or shape, a labels check that accepts absent classes or ``1..N``."""
    args = list(GOOD) + [None]
    for index, value in change.items():
        args[index] = value
    simpleshot = methods.SimpleShot()
    simpleshot.predict = lambda *_: pytest.fail("predict must not be reached")  # type: ignore[method-assign]
    with pytest.raises(error, match=message) as raised:
        simpleshot(*args[:3], task_seeds=args[3])
    assert "\n" not in str(raised.value)


def test_a_batch_names_the_task_and_the_batch_shapes() -> None:
    """Batched input: the messages name ``T`` and the task whose support lacks a class.

    Kills: a batch check that only looks at the first task, a message with the single-task shapes."""
    support, labels, query = torch.rand(2, S, D), torch.arange(3).repeat(2).repeat(2, 1), torch.rand(2, Q, D)
    simpleshot = methods.SimpleShot()
    assert simpleshot(support, labels, query).shape == (2, Q, 3)
    with pytest.raises(FeatureError, match=r"query must be \[T=2, Q, d=24\] to match support \[2, 6, 24\], got shape "
                                           r"\[3, 9, 24\]"):
        simpleshot(support, labels, torch.rand(3, Q, D))
    with pytest.raises(DataError, match=r"support_labels must be \[2, 6\]"):
        simpleshot(support, labels[0], query)
    holed = labels.clone()
    holed[1] = torch.tensor([0, 1, 1, 0, 1, 0])
    with pytest.raises(DataError, match=r"task 1's support has no row of class 2"):
        simpleshot(support, holed, query)
    with pytest.raises(ConfigError, match=r"task_seeds must be \[T=2\] integers \(one per task\)"):
        simpleshot(support, labels, query, task_seeds=7)


@pytest.mark.parametrize(("build_it", "message"), [
    (lambda: methods.SimpleShot(shots=0), r"shots must be a positive integer"),
    (lambda: methods.SimpleShot(shots=True), r"shots must be a positive integer"),
    (lambda: methods.PUTM(shots=1, balanced="yes"), r"balanced must be True .* or False \(Dirichlet-imbalanced, the "
                                                    r"default\), got 'yes'"),
    (lambda: methods.PUTM(shots=1, rho=2), r"method.putm.rho must lie in \[0, 1\], got 2"),
])
def test_bad_constructor_arguments_are_one_line(build_it, message) -> None:
    """Kills: ``shots=0``/``True`` or ``balanced="yes"`` accepted (``bool("yes")`` would pick the balanced defaults),
    options no longer checked when given as keyword arguments."""
    with pytest.raises(ConfigError, match=message) as raised:
        build_it()
    assert "\n" not in str(raised.value)


@pytest.mark.cuda
def test_the_work_runs_on_the_inputs_device(features) -> None:
    """CUDA inputs give CUDA probabilities with the CPU's predictions (PUTM's defaults choose other engines there).

    Kills: a ``.cpu()`` or a default device inside the tensor path."""
    support, labels, query = uneven_task(features)
    for method in (methods.SimpleShot(), methods.PUTM(inertia=0.1, **CHEAP["putm"])):
        on_cpu = method(support, labels, query)
        on_gpu = method(support.cuda(), labels.cuda(), query.cuda())
        assert on_gpu.device.type == "cuda"
        assert torch.equal(on_gpu.argmax(1).cpu(), on_cpu.argmax(1))


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def test_the_python_api_page_runs() -> None:
    """docs/python_api.md's examples run as written (one namespace, in order) and their asserts hold.

    Kills: a page whose example has drifted from the API (a renamed argument, a shape that changed)."""
    blocks = python_blocks(ROOT / "docs" / "python_api.md")
    assert len(blocks) >= 2
    namespace: dict[str, object] = {"__name__": "python_api_page"}
    for block in blocks:
        exec(compile(block, "docs/python_api.md", "exec"), namespace)
