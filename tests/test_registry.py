"""Methods register themselves: every method class of the package is found by name and built with the context its
class flags ask for, and a method in a user's own module (``plugins``) runs through ``evaluate.py`` with no other
file touched."""

from __future__ import annotations

import csv
import importlib
import inspect
import re
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from helpers.cli import run_script
from lightning_putm.errors import ConfigError
from lightning_putm.methods import METHOD_CLASSES, build_method, method_order, register_method
from lightning_putm.methods.base import FewShotMethod
from lightning_putm.methods.catalog import BUILTIN_SETTINGS
from lightning_putm.methods.registry import builtin_modules, import_plugins

REPO = Path(__file__).resolve().parents[1]


def method_classes_defined_in_the_package() -> dict[str, type]:
    """Every concrete FewShotMethod subclass defined in a module of ``lightning_putm.methods``."""
    found = {}
    for name in builtin_modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, FewShotMethod) and cls.__module__ == name and not inspect.isabstract(cls):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_method_class_of_the_package_is_registered_under_its_settings_name() -> None:
    """Kills: a method class without ``@register_method`` (never reachable by name), a module the discovery does not
    import, or a settings class whose ``method`` (the name in its error messages) differs from the config name."""
    defined = method_classes_defined_in_the_package()
    assert len(defined) == 12
    registered = {f"{cls.__module__}.{cls.__qualname__}" for name, cls in METHOD_CLASSES.items()
                  if cls.__module__.startswith("lightning_putm.methods.")}
    assert set(defined) == registered
    for name, cls in METHOD_CLASSES.items():
        assert cls.name == name and (cls.Settings is None or cls.Settings.method == name), name
    builtin = {cls.name: cls for cls in defined.values()}
    assert {settings.method: settings for settings in BUILTIN_SETTINGS} == {
        name: cls.Settings for name, cls in builtin.items()}


def test_the_figure_order_keeps_each_built_in_methods_slot() -> None:
    """The colour and marker of a method are its place in this order. Kills: an order that follows module discovery
    (alphabetical) and so repaints every figure."""
    assert method_order()[:12] == ["putm", "ptmap", "simpleshot", "alpha_tim", "tim", "bdcspn", "laplacianshot",
                                   "ilpc", "bavardage", "protonet", "alpha_am", "unem"]


def test_a_name_is_registered_once() -> None:
    """Kills: a user's class that silently replaces a built-in method (every result under that name would change),
    and a name that cannot be a config key."""
    class Impostor(FewShotMethod):
        def solve(self, tasks):  # pragma: no cover - never built
            raise AssertionError

    with pytest.raises(ConfigError, match=r"method 'putm' is registered twice: .*PUTM and .*Impostor"):
        register_method("putm")(Impostor)
    assert METHOD_CLASSES["putm"].__name__ == "PUTM"
    with pytest.raises(ConfigError, match="must be a Python identifier"):
        register_method("my-method")


def test_build_method_gives_base_statistics_and_counts_only_to_the_classes_that_ask() -> None:
    """One rule for every method instead of a factory each: ``shots``/``balanced`` to all, ``base_mean``,
    ``base_covariance`` and the oracle counts by class flag. Kills: passing ``base_mean`` to every class (ProtoNet,
    which takes none, would refuse it) or to none (SimpleShot would silently normalise without the base mean), the
    scatter withheld from BAVARDAGE, and counts given to a method without a class prior."""
    mean, scatter, counts = torch.ones(4), torch.eye(4), torch.tensor([[3, 2]])
    context = dict(shots=5, balanced=True, base_mean=mean, base_covariance=scatter, query_counts=counts)
    simpleshot, protonet = build_method("simpleshot", {}, **context), build_method("protonet", {}, **context)
    assert simpleshot.base_mean is mean and not hasattr(protonet, "base_mean")
    assert (protonet.shots, protonet.balanced, protonet.oracle_prior) == (5, True, False)
    bavardage = build_method("bavardage", {}, **context)
    assert bavardage.precision is not None and bavardage.oracle_counts is counts
    assert build_method("ptmap", {}, **{**context, "query_counts": None}).oracle_prior is False


def test_a_plugin_that_cannot_be_imported_is_one_error_naming_the_key(tmp_path: Path) -> None:
    """Kills: a traceback (or a silent skip) for a mistyped module name, a missing file or a plugin that fails."""
    with pytest.raises(ConfigError, match=r"^`plugins`: cannot import 'no_such_module_47' \(ModuleNotFoundError"):
        import_plugins(["no_such_module_47"])
    with pytest.raises(ConfigError, match=r"^`plugins`: file not found: .*missing\.py"):
        import_plugins([str(tmp_path / "missing.py")])
    broken = tmp_path / "broken_plugin_47.py"
    broken.write_text("raise RuntimeError('half-written')\n")
    with pytest.raises(ConfigError, match=r"cannot import .*broken_plugin_47\.py' \(RuntimeError: half-written\)"):
        import_plugins([str(broken)])
    with pytest.raises(ConfigError, match=r"^`plugins` must be a list of module names or \.py file paths"):
        import_plugins([5])


#: A whole new method in one file: its settings and its class. ``farthest`` predicts the farthest class mean, so the
#: test can see that an option given on the command line reached the method.
TOY_METHOD = '''
    """Nearest class mean with a temperature: a user's method in a module of its own."""
    from dataclasses import dataclass

    import torch

    from lightning_putm.methods import FewShotMethod, register_method
    from lightning_putm.methods.options import MethodOptions, option


    @dataclass(frozen=True)
    class ToySettings(MethodOptions):
        temperature: float = option(1.0, low=0, low_open=True, help="probabilities = softmax(-temperature * d^2)")
        farthest: bool = option(False, help="predict the farthest class mean instead (to see an option arrive)")


    @register_method("toy")
    class NearestMean(FewShotMethod):
        Settings = ToySettings

        def solve(self, tasks):
            distances = torch.cdist(tasks.query, tasks.support_means(tasks.support)) ** 2
            sign = -1.0 if self.farthest else 1.0
            return torch.softmax(-sign * self.temperature * distances, dim=2)
'''


def test_a_method_in_its_own_module_runs_through_evaluate_py(tmp_path: Path) -> None:
    """A 13th method is one file outside the package, named by ``plugins``: its options are ``method.toy.<key>``
    with the declared bounds, ``--help`` lists them, and ``evaluate.py`` evaluates it beside the built-ins; the
    package's files are not touched. Kills: a method list or factory that must be edited to add a method, plugins
    imported after the methods are checked, options that do not reach the method (``farthest`` would change
    nothing), help without the plugin's methods."""
    before = {path: path.stat().st_mtime_ns for path in (REPO / "lightning_putm").rglob("*.py")}
    before.update({path: path.stat().st_mtime_ns for path in (REPO / "conf").rglob("*.yaml")})
    plugin = tmp_path / "toy_nearest_mean.py"
    plugin.write_text(textwrap.dedent(TOY_METHOD))
    fast = ["tasks=10", "shots=[1]", "alphas=[balanced]", "logger=none", "plots=false", "progress=false"]
    done = run_script("evaluate", [f"plugins=[{plugin}]", "methods=[toy,protonet]", "method.toy.farthest=true",
                                   f"output_dir={tmp_path / 'out'}", *fast], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = defaultdict(list)
    with open(tmp_path / "out" / "per_task.csv") as handle:
        for row in csv.DictReader(handle):
            accuracy[row["method"]].append(float(row["accuracy"]))
    assert len(accuracy["toy"]) == len(accuracy["protonet"]) == 10
    mean = {name: sum(values) / len(values) for name, values in accuracy.items()}
    assert mean["toy"] < mean["protonet"] - 0.3, mean  # the farthest mean: far below ProtoNet's nearest mean

    shown = run_script("evaluate", [f"plugins=[{plugin}]", "--help"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"method\.toy\.farthest\s+bool\s+false\s+predict the farthest class mean", shown.stdout)
    refused = run_script("evaluate", [f"plugins=[{plugin}]", "methods=[toy]", "method.toy.temperature=-1"],
                         cwd=tmp_path)
    assert refused.user_error_problem(r"^error: method\.toy\.temperature must be positive, got -1") is None, \
        refused.stderr
    after = {path: path.stat().st_mtime_ns for path in before}
    assert after == before and set((REPO / "lightning_putm").rglob("*.py")) <= set(before)


def test_the_docs_index_lists_every_registered_method_with_its_page() -> None:
    """docs/index.md's methods table is the registry's, in its figure order: one row per built-in method, named by
    its display name and linking its page. Kills: a method added without its row or page, a row left for a removed
    method, or a table out of the registry's order."""
    text = (REPO / "docs" / "index.md").read_text()
    rows = re.findall(r"^\| (.+?) \| \[methods/(\w+)\.md\]\(methods/\w+\.md\) \|", text, flags=re.M)
    builtin = [name for name in method_order() if METHOD_CLASSES[name].__module__.startswith("lightning_putm.")]
    assert [name for _, name in rows] == builtin
    for label, name in rows:
        assert label.startswith(METHOD_CLASSES[name].display_name), (label, name)
        assert (REPO / "docs" / "methods" / f"{name}.md").is_file()
