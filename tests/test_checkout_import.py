"""``import_from_checkout``: the one way the benchmarks import reference code from a checkout (no import-path edits).

Each test builds a tiny "checkout" in a temporary folder and restores ``sys.meta_path`` and ``sys.modules``
afterwards, so nothing leaks into other tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers.benchmarks import benchmark_module
from lightning_putm.studies.reference import CheckoutFinder, import_from_checkout

NAMES = ("ckref_main", "ckref_helper", "ckref_lazy", "ckref_pkg", "ckref_pkg.sub", "methods", "methods.putm")


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout whose module imports a sibling at import time and another one only when called."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    (tmp_path / "ckref_helper.py").write_text("VALUE = 7\n")
    (tmp_path / "ckref_lazy.py").write_text("LATE = 'late'\n")
    (tmp_path / "ckref_main.py").write_text(
        "import ckref_helper\n\ndef later():\n    import ckref_lazy\n    return ckref_lazy.LATE\n")
    (tmp_path / "ckref_pkg").mkdir()
    (tmp_path / "ckref_pkg" / "__init__.py").write_text("")
    (tmp_path / "ckref_pkg" / "sub.py").write_text("from ckref_helper import VALUE\n")
    yield tmp_path
    for name in NAMES:
        sys.modules.pop(name, None)


def test_a_module_and_its_imports_come_from_the_checkout_also_at_run_time(checkout: Path) -> None:
    """Kills: a finder removed right after the import (the reference imports inside functions too)."""
    main = import_from_checkout(checkout, "ckref_main")
    assert Path(main.__file__).parent == checkout.resolve() and main.ckref_helper.VALUE == 7
    assert main.later() == "late"  # imported only now, after import_from_checkout returned
    sub = import_from_checkout(checkout, "ckref_pkg.sub")
    assert sub.VALUE == 7 and Path(sub.__file__) == checkout.resolve() / "ckref_pkg" / "sub.py"
    assert sum(isinstance(f, CheckoutFinder) and f.root == checkout.resolve() for f in sys.meta_path) == 1


def test_a_missing_module_is_one_clear_error_before_any_finder_is_registered(checkout: Path) -> None:
    before = list(sys.meta_path)
    with pytest.raises(SystemExit, match=r"--benchmark .*: no src/methods/tim\.py in it"):
        import_from_checkout(checkout, "src.methods.tim", flag="--benchmark")
    assert sys.meta_path == before


def test_a_name_already_imported_from_elsewhere_is_refused(checkout: Path) -> None:
    """Kills: silently returning the installed ``pytest`` instead of the checkout's ``pytest.py``."""
    (checkout / "pytest.py").write_text("")
    with pytest.raises(SystemExit, match="'pytest' is already imported from"):
        import_from_checkout(checkout, "pytest")


def test_a_bare_folder_does_not_shadow_an_installed_package_but_a_file_does(checkout: Path) -> None:
    """As on the import path: a regular installed package beats a namespace folder; the checkout's files come first."""
    (checkout / "optuna").mkdir()  # a bare folder named like an installed package
    finder = CheckoutFinder(checkout.resolve())
    assert not str(finder.find_spec("optuna").origin).startswith(str(checkout.resolve()))
    assert finder.find_spec("ckref_helper").origin == str(checkout.resolve() / "ckref_helper.py")
    assert finder.find_spec("ckref_pkg.sub") is None  # submodules: through the package's __path__
    assert finder.find_spec("not_in_the_checkout") is None


def test_the_putm_reference_adapter_loads_methods_putm_from_a_checkout(checkout: Path) -> None:
    """benchmarks/reference_putm.py goes through the same helper (RashLog/PUTM's methods/ has no __init__.py)."""
    (checkout / "methods").mkdir()
    (checkout / "methods" / "putm.py").write_text("class PUTM:\n    pass\n")
    module = benchmark_module("reference_putm").load_reference_module(checkout)
    assert Path(module.__file__) == checkout.resolve() / "methods" / "putm.py" and hasattr(module, "PUTM")
    with pytest.raises(SystemExit, match="no methods/putm.py in it"):
        benchmark_module("reference_putm").load_reference_module(checkout / "ckref_pkg")
