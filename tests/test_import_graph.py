"""The package's import graph has no cycle, function-level imports included, and its layers point down.

The graph is read from the source with :mod:`ast` (every ``import``/``from`` statement anywhere in a module,
also inside functions and ``TYPE_CHECKING`` blocks), so a cycle hidden behind a lazy import is found too.
An edge ``a → b`` means module ``a`` names module ``b`` (``from pkg import name`` counts as ``pkg.name`` when
that is a module, else as ``pkg``); the implicit import of a parent package by Python is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "lightning_putm"


def module_name(root: Path, path: Path) -> str:
    """``lightning_putm/evaluation/__init__.py`` → ``lightning_putm.evaluation`` (``root`` is the package folder)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted(root.rglob("*.py"))}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """``{module: {internal modules it imports}}`` from every import statement in each file."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative import: resolve against this module's package
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module name: its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(package_modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: a cycle closed only by an import inside a function, or a relative one, is found."""
    package = tmp_path / "lightning_putm"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from lightning_putm.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import thing\n")
    (package / "c.py").write_text("import lightning_putm.a\nthing = 1\n")
    graph = import_graph(package_modules(package))
    assert graph["lightning_putm.sub.b"] == {"lightning_putm.c"}
    assert find_cycle(graph) == ["lightning_putm.a", "lightning_putm.sub.b", "lightning_putm.c", "lightning_putm.a"]
    (package / "c.py").write_text("thing = 1\n")
    assert find_cycle(import_graph(package_modules(package))) is None


#: Lower layers never import higher ones. Bottom to top: the core (config, validators, errors, atomic, runs, ...),
#: models / features / data / methods (methods know only tensors), the S2M2 module and checkpoints, evaluation,
#: prediction and pretraining's stages, studies, jobs. A wing's settings may read evaluation's settings (the
#: in-training few-shot check, predict's method settings); the S2M2 module and the checkpoints may not.
JOBS, STUDIES, CALLBACK = "lightning_putm.jobs", "lightning_putm.studies", "lightning_putm.evaluation.callback"
TRAINING_RUN = {"lightning_putm.pretraining.settings", "lightning_putm.pretraining.stages",
                "lightning_putm.pretraining.progress", "lightning_putm.pretraining.interruption"}
LAYERS = [
    ("lightning_putm.methods", {"lightning_putm.evaluation", "lightning_putm.pretraining", "lightning_putm.features",
                                "lightning_putm.prediction", "lightning_putm.data", "lightning_putm.models", STUDIES,
                                JOBS}),
    ("lightning_putm.features", {"lightning_putm.evaluation", "lightning_putm.pretraining", "lightning_putm.prediction",
                                 "lightning_putm.data", "lightning_putm.methods", STUDIES, JOBS}),
    ("lightning_putm.data", {"lightning_putm.evaluation", "lightning_putm.pretraining", "lightning_putm.prediction",
                             "lightning_putm.methods", "lightning_putm.features.extraction",
                             "lightning_putm.features.cache", STUDIES, JOBS}),
    ("lightning_putm.pretraining.module", {"lightning_putm.evaluation", "lightning_putm.prediction", *TRAINING_RUN,
                                           STUDIES, JOBS}),
    ("lightning_putm.pretraining.checkpoints", {"lightning_putm.evaluation", "lightning_putm.prediction",
                                                *TRAINING_RUN, STUDIES, JOBS}),
    ("lightning_putm.evaluation", {*TRAINING_RUN, "lightning_putm.prediction", STUDIES, JOBS}),
    # folders → one task: data readers, the methods and tensors; no Lightning module, no evaluation run
    ("lightning_putm.prediction.images", {"lightning_putm.evaluation", "lightning_putm.pretraining",
                                          "lightning_putm.features.extraction", STUDIES, JOBS}),
    ("lightning_putm.prediction.outputs", {"lightning_putm.evaluation", "lightning_putm.pretraining",
                                           "lightning_putm.features.extraction", STUDIES, JOBS}),
    ("lightning_putm.prediction.settings", {CALLBACK, "lightning_putm.pretraining", STUDIES, JOBS}),
    ("lightning_putm.pretraining.settings", {CALLBACK, "lightning_putm.pretraining.stages", STUDIES, JOBS}),
    ("lightning_putm.pretraining.stages", {STUDIES, JOBS}),
    # studies and analyses of finished runs: they read folders and run evaluations handed to them; no Trainer
    (STUDIES, {CALLBACK, "lightning_putm.pretraining", "lightning_putm.features.extraction", JOBS}),
]


@pytest.mark.parametrize(("layer", "forbidden"), LAYERS, ids=[layer for layer, _ in LAYERS])
def test_imports_point_down(layer: str, forbidden: set[str]) -> None:
    graph = import_graph(package_modules())
    wrong = sorted(f"{source} -> {target}" for source, targets in graph.items()
                   if source == layer or source.startswith(layer + ".")
                   for target in targets if any(target == f or target.startswith(f + ".") for f in forbidden))
    assert not wrong, "imports pointing up: " + "; ".join(wrong)


def test_only_the_jobs_and_a_training_stage_import_the_callback() -> None:
    graph = import_graph(package_modules())
    users = sorted(source for source, targets in graph.items() if CALLBACK in targets)
    assert users and all(user.startswith(JOBS + ".") or user == "lightning_putm.pretraining.stages"
                         for user in users), users


def test_only_the_jobs_and_the_entry_point_import_the_studies() -> None:
    """``studies/`` sits just below the jobs: no module of the other wings or the core imports it; the study and
    tune jobs and ``python -m lightning_putm`` (``__main__``) are its only users outside the wing."""
    graph = import_graph(package_modules())
    users = sorted(source for source, targets in graph.items() if not source.startswith(STUDIES)
                   for target in targets if target.startswith(STUDIES))
    assert users and set(users) <= {"lightning_putm.__main__", f"{JOBS}.study", f"{JOBS}.tune"}, users


def test_nothing_but_the_entry_point_imports_a_job() -> None:
    graph = import_graph(package_modules())
    users = sorted(source for source, targets in graph.items() if not source.startswith(JOBS + ".")
                   for target in targets if target.startswith(JOBS))
    assert set(users) <= {"lightning_putm.__main__"}, users


def test_the_top_level_is_the_core() -> None:
    """Wings are folders; the package's top level holds only the small core every wing may use."""
    top = sorted(p.stem for p in PACKAGE_ROOT.glob("*.py"))
    assert top == ["__init__", "__main__", "atomic", "cli", "config", "csv_logger", "errors", "help", "job_options",
                   "loggers", "metrics", "reproducibility", "runs", "signals", "tasks", "validators"], top


#: A module a newcomer can read in one sitting; past this, it holds more than one concept (split it).
MAX_MODULE_LINES = 450


def test_no_module_is_longer_than_a_newcomer_reads_in_one_sitting() -> None:
    long = sorted(f"{path.relative_to(PACKAGE_ROOT.parent)} ({count} lines)" for path in PACKAGE_ROOT.rglob("*.py")
                  if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES)
    assert not long, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(long)
