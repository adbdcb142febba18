"""Import code that is not installed (a local checkout of a paper's reference code) the one way the benchmarks do.

The side-by-side benchmarks run other people's code (RashLog/PUTM, iLPC, BAVARDAGE, the realistic-imbalance
benchmark) from a checkout the user names with ``--reference``/``--benchmark``. That code imports its own
modules by top-level name (``import vb_equi_iso``, ``from src.methods...``), sometimes inside functions at run
time, so the checkout must stay importable for the whole process. Rather than editing ``sys.path`` (which also
makes every folder of the checkout shadow installed packages), :func:`import_from_checkout` registers one
finder per checkout that resolves only the top-level names the checkout holds, just before the regular path
finder: its files win over installed modules of the same name, as they would when run from the checkout, and
an installed regular package still wins over a bare folder of the checkout (as it would on ``sys.path``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds top-level modules and packages in one folder; submodules come through their package's ``__path__``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001 (importlib's signature)
        if "." in fullname:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, [str(self.root)])
        if spec is None or spec.origin is not None:  # nothing here, or a module / regular package: take it
            return spec
        # a bare folder (namespace portion): an installed regular package of that name comes first, as on sys.path
        installed = importlib.machinery.PathFinder.find_spec(fullname)
        return installed if installed is not None and installed.origin is not None else spec

    def __repr__(self) -> str:
        return f"CheckoutFinder({str(self.root)!r})"


def checkout_finder(root: Path) -> CheckoutFinder:
    """The finder of ``root``, registered once per process just before the regular path finder."""
    for finder in sys.meta_path:
        if isinstance(finder, CheckoutFinder) and finder.root == root:
            return finder
    finder = CheckoutFinder(root)
    position = next((i for i, f in enumerate(sys.meta_path) if f is importlib.machinery.PathFinder),
                    len(sys.meta_path))
    sys.meta_path.insert(position, finder)
    return finder


def import_from_checkout(checkout: str | Path, module: str, flag: str = "--reference") -> ModuleType:
    """Import ``module`` (dotted, e.g. ``methods.putm``) from the folder ``checkout`` and return it.

    A checkout without the module's file, or a module of that name already imported from somewhere else, is a
    one-line ``SystemExit`` naming ``flag``, the folder and the file expected, before anything is imported.
    """
    root = Path(checkout).expanduser().resolve()
    relative = Path(*module.split("."))
    candidates = [root / relative.with_suffix(".py"), root / relative / "__init__.py"]
    if not any(path.is_file() for path in candidates):
        raise SystemExit(f"{flag} {checkout}: no {relative.with_suffix('.py')} in it; give the folder of a checkout "
                         f"that holds {relative.with_suffix('.py')}")
    loaded = sys.modules.get(module)
    if loaded is not None and not _inside(loaded, root):
        raise SystemExit(f"{flag} {checkout}: a module named {module!r} is already imported from "
                         f"{getattr(loaded, '__file__', None) or 'elsewhere'}; run the script in a fresh process")
    checkout_finder(root)
    imported = importlib.import_module(module)
    if not _inside(imported, root):
        raise SystemExit(f"{flag} {checkout}: {module!r} was imported from {imported.__file__}, not from the checkout; "
                         f"a package of that name shadows it")
    return imported


def _inside(module: ModuleType, root: Path) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(root)
