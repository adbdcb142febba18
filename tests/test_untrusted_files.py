"""Untrusted files: nothing is unpickled without the explicit opt-in, and a malicious pickle never runs.

* Malicious payloads: pickles whose loading would create a marker file (through ``open``, ``os.system``,
  ``exec`` or ``pathlib.Path.touch``). A positive control proves each payload really creates the marker under a
  plain ``pickle.loads``; then every place a user can hand us a file (feature file in every suffix and format,
  base features, checkpoint for evaluation, ``init_from``, ``resume``'s ``last.ckpt``, Lightning's own resume
  loader, the feature cache) must refuse it, and the marker must not exist afterwards.
* A static scan (AST, not regex) of the package and scripts fails on any unsafe load: ``pickle``/``dill``/
  ``joblib``/``marshal``/``shelve`` loads, ``torch.load`` without a literal ``weights_only=True``, ``np.load``
  with ``allow_pickle``, Lightning loads (``load_from_checkpoint``, ``fit/test(ckpt_path=...)``) without
  ``weights_only=True``, unsafe YAML. The only allowed ``pickle.load`` is the opt-in reader, and the scan checks
  that it is guarded by ``if not allow_pickle: raise``.
* A runtime guard: whole evaluate and train/resume jobs run with ``pickle.load(s)`` disabled and ``torch.load``
  wrapped to demand ``weights_only=True``.

Figures: ``untrusted files tried: N, refused: N`` plus ``payloads executed: 0``.
"""

from __future__ import annotations

import ast
import os
import pathlib
import pickle
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import make_clustered_features
from helpers.cli import FAST_EVAL, FAST_TRAIN, REPO, run_in_process
from helpers.ledger import Ledger, isolated_working_folder, module_figures
from lightning_putm.errors import LightningPutmError
from lightning_putm.features.cache import FeatureCache, FeatureCacheKey
from lightning_putm.features.files import FORMAT_NAME, load_features, save_features
from lightning_putm.pretraining.checkpoints import (AtomicCheckpointIO, init_from_checkpoint, load_backbone,
                                                    load_module, read_checkpoint)
from lightning_putm.pretraining.module import S2M2Module

LEDGER = Ledger("untrusted files", verb="refused")
pytestmark = pytest.mark.usefixtures("single_thread")


_isolated = isolated_working_folder()
_figures = module_figures(LEDGER, "test_untrusted_files", must_stay_zero=("payloads executed",))


# ------------------------------------------------------------------------------------------- payloads
class OpenMarker:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class SystemMarker(OpenMarker):
    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class ExecMarker(OpenMarker):
    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class TouchMarker(OpenMarker):
    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


PAYLOADS = {"open": OpenMarker, "os.system": SystemMarker, "exec": ExecMarker, "Path.touch": TouchMarker}


def test_positive_control_each_payload_runs_under_plain_pickle(tmp_path: Path) -> None:
    """Without this, 'the marker is absent' would prove nothing."""
    for name, payload in PAYLOADS.items():
        marker = tmp_path / f"control_{name}"
        pickle.loads(pickle.dumps({"x": payload(marker)}))
        assert marker.exists(), name


def refused(label: str, marker: Path, attempt) -> None:
    """``attempt()`` must raise a clear user error (or an unpickling refusal) and leave no marker."""
    try:
        attempt()
        ok, note = False, "loaded"
    except (LightningPutmError, pickle.UnpicklingError) as exc:
        ok, note = True, str(exc)[:200]
    if marker.exists():
        LEDGER.add("payloads executed", 1)
        ok, note = False, f"PAYLOAD RAN: {marker} exists"
    LEDGER.record(label, ok, note)
    assert ok, f"{label}: {note}"


def refused_by_cli(label: str, marker: Path, script: str, argv: list[str], pattern: str) -> None:
    outcome = run_in_process(script, argv)
    problem = outcome.user_error_problem(pattern)
    if marker.exists():
        LEDGER.add("payloads executed", 1)
        problem = f"PAYLOAD RAN: {marker} exists"
    LEDGER.record(label, problem is None, problem or outcome.error_lines[0])
    assert problem is None, f"{label}: {problem}\n{outcome.stderr[-1500:]}"


# ------------------------------------------------------------------------------------------- feature files
@pytest.mark.parametrize("payload", PAYLOADS, ids=list(PAYLOADS))
def test_malicious_feature_files_are_refused(tmp_path: Path, payload: str) -> None:
    marker = tmp_path / "marker"
    evil = PAYLOADS[payload](marker)
    good = make_clustered_features(classes=6, per_class=20, dim=8)
    label_dict = {c: [evil] for c in range(3)}
    files = {f"legacy{suffix}": pickle.dumps(label_dict) for suffix in (".pkl", ".plk", ".pickle")}
    files["legacy_pickle.pt"] = pickle.dumps({"format": FORMAT_NAME, "features": evil})
    files["legacy_pickle_protocol2.pt"] = pickle.dumps({"format": FORMAT_NAME, "features": evil}, protocol=2)
    zipped = tmp_path / "zipped.pt"
    torch.save({"format": FORMAT_NAME, "version": 1, "features": good.features, "labels": good.labels,
                "meta_json": "{}", "extra": evil}, zipped)
    files["torch_save_zip_with_payload.pt"] = zipped.read_bytes()
    for name, content in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        refused(f"load_features: {name} ({payload})", marker, lambda: load_features(path))
        refused_by_cli(f"evaluate features=: {name} ({payload})", marker, "evaluate",
                       [*FAST_EVAL, f"output_dir={tmp_path / 'out'}", f"features={path}"],
                       r"pickle file.*allow_pickle=true|not a safe lightning-putm feature file")
        refused_by_cli(f"evaluate base_features=: {name} ({payload})", marker, "evaluate",
                       [*FAST_EVAL, f"output_dir={tmp_path / 'out'}", f"base_features={path}"],
                       r"pickle file.*allow_pickle=true|not a safe lightning-putm feature file")


def test_allow_pickle_is_the_only_way_a_pickle_runs(tmp_path: Path) -> None:
    """The documented opt-in does unpickle (so the refusals above are the opt-in's absence, not luck)."""
    marker = tmp_path / "marker"
    path = tmp_path / "trusted.pkl"
    path.write_bytes(pickle.dumps({0: [OpenMarker(marker)]}))
    with pytest.raises(LightningPutmError):
        load_features(path, allow_pickle=True)  # the payload runs, then the content is rejected as malformed
    assert marker.exists()


# ------------------------------------------------------------------------------------------- checkpoints
def evil_checkpoint(real: Path, marker: Path, payload: str, where: str, folder: Path) -> Path:
    """A copy of a real checkpoint with the payload hidden at ``where``."""
    checkpoint = torch.load(real, map_location="cpu", weights_only=True)
    evil = PAYLOADS[payload](marker)
    if where == "hyper_parameters":
        checkpoint["hyper_parameters"] = {**checkpoint["hyper_parameters"], "note": evil}
    elif where == "state_dict":
        checkpoint["state_dict"] = {**checkpoint["state_dict"], "backbone.extra": evil}
    elif where == "callbacks":
        checkpoint["callbacks"] = {"ModelCheckpoint": evil}
    else:
        raise ValueError(where)
    path = folder / f"evil_{where}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    return path


@pytest.mark.parametrize("payload", PAYLOADS, ids=list(PAYLOADS))
def test_malicious_checkpoints_are_refused_everywhere(tmp_path: Path, tiny_checkpoint: Path, payload: str) -> None:
    marker = tmp_path / "marker"
    for where in ("hyper_parameters", "state_dict", "callbacks"):
        path = evil_checkpoint(tiny_checkpoint, marker, payload, where, tmp_path / "files")
        tag = f"({payload} in {where})"
        refused(f"read_checkpoint {tag}", marker, lambda: read_checkpoint(path))
        refused(f"load_module {tag}", marker, lambda: load_module(path))
        refused(f"load_backbone {tag}", marker, lambda: load_backbone(path))
        module = S2M2Module("conv4", {"width": 8}, in_channels=1, num_classes=5, stage="classifier")
        refused(f"init_from_checkpoint {tag}", marker, lambda: init_from_checkpoint(module, path))
        refused(f"AtomicCheckpointIO.load_checkpoint (Lightning's resume loader) {tag}", marker,
                lambda: AtomicCheckpointIO().load_checkpoint(path))
        refused_by_cli(f"train_backbone init_from= {tag}", marker, "train_backbone",
                       [*FAST_TRAIN, "stages=[classifier]", f"checkpoint_dir={tmp_path / 'ck'}", f"init_from={path}"],
                       r"cannot be loaded safely.*needs code execution")
        resume_dir = tmp_path / f"resume_{where}"
        last = resume_dir / "digits" / "conv4" / "planted" / "classifier" / "last.ckpt"
        last.parent.mkdir(parents=True, exist_ok=True)
        last.write_bytes(path.read_bytes())
        refused_by_cli(f"train_backbone resume=true with last.ckpt {tag}", marker, "train_backbone",
                       [*FAST_TRAIN, "stages=[classifier]", f"checkpoint_dir={resume_dir}", "resume=true",
                        "run=planted"],
                       r"cannot be loaded safely.*needs code execution")
        refused_by_cli(f"evaluate checkpoint= {tag}", marker, "evaluate",
                       [*FAST_EVAL, f"output_dir={tmp_path / 'out'}", f"checkpoint={path}",
                        f"feature_cache_dir={tmp_path / 'cache'}"], r"needs code execution to load")


def test_lightning_resume_path_itself_refuses_a_malicious_checkpoint(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Even without our pre-check, ``Trainer.fit(ckpt_path=...)`` with our checkpoint IO does not run the payload."""
    from lightning_putm.data.datamodule import FewShotDataModule

    marker = tmp_path / "marker"
    path = evil_checkpoint(tiny_checkpoint, marker, "open", "callbacks", tmp_path)
    module = S2M2Module("conv4", {"width": 8}, in_channels=1, num_classes=5, stage="classifier")
    import pytorch_lightning as pl

    trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", plugins=[AtomicCheckpointIO()],
                         limit_train_batches=1, limit_val_batches=0)

    def attempt():
        trainer.fit(module, datamodule=FewShotDataModule("digits", image_size=8, batch_size=16),
                    ckpt_path=str(path), weights_only=True)

    refused("Trainer.fit(ckpt_path=malicious, weights_only=True) with AtomicCheckpointIO", marker, attempt)


def test_a_malicious_feature_cache_file_is_ignored_and_rebuilt(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Someone replaced a cached feature file: the next run refuses it, extracts again and gets the same result."""
    marker = tmp_path / "marker"
    cache_dir = tmp_path / "cache"
    args = [*FAST_EVAL, f"checkpoint={tiny_checkpoint}", f"feature_cache_dir={cache_dir}"]
    first = run_in_process("evaluate", [*args, f"output_dir={tmp_path / 'a'}"])
    assert first.returncode == 0, first.stderr[-2000:]
    (cached,) = cache_dir.glob("digits-test-*.pt")  # the evaluated split (the base split is cached beside it)
    torch.save({"format": FORMAT_NAME, "evil": OpenMarker(marker)}, cached)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = run_in_process("evaluate", [*args, f"output_dir={tmp_path / 'b'}"])
    ok = (second.returncode == 0 and not marker.exists()
          and (tmp_path / "a" / "per_task.csv").read_bytes() == (tmp_path / "b" / "per_task.csv").read_bytes()
          and any("unreadable feature cache" in str(w.message) for w in caught))
    if marker.exists():
        LEDGER.add("payloads executed", 1)
    LEDGER.record("feature cache file replaced by a malicious pickle", ok, second.stderr[-300:])
    assert ok, second.stderr[-2000:]
    # the rebuilt cache is a clean feature file again
    assert load_features(cached).metadata["cache_key"]["checkpoint_sha256"]
    key = FeatureCacheKey("0" * 64, "digits", "", "{}", "test", "t")
    cache = FeatureCache(tmp_path / "other", key)
    cache.path.parent.mkdir(parents=True)
    torch.save({"evil": OpenMarker(marker)}, cache.path)
    with pytest.warns(UserWarning, match="unreadable feature cache"):
        assert cache.load() is None
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- static scan
UNSAFE_CALLS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
    "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads",
    "joblib.load", "marshal.load", "marshal.loads", "shelve.open", "pandas.read_pickle", "jsonpickle.decode",
    "yaml.unsafe_load", "yaml.full_load", "torch.jit.load", "numpy.lib.format.read_array",
}
#: (file, function) pairs allowed to call an unsafe loader, each behind a check the scan verifies.
ALLOWED = {("lightning_putm/features/files.py", "_load_pickle_features"): "pickle.load"}
#: (file, class) pairs allowed to subclass an unpickler: restricted unpicklers whose ``find_class`` admits only data
#: (CIFAR-100's own pickles: numpy arrays). The scan checks that ``find_class`` is overridden.
RESTRICTED_UNPICKLERS = {("lightning_putm/data/cifarfs.py", "ArrayOnlyUnpickler")}
LIGHTNING_LOADS = {"fit", "test", "validate", "predict"}


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name → dotted origin (``import numpy as np`` → np: numpy; ``from pickle import load`` → load: pickle.load)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = names.get(node.id, node.id)
    return ".".join([head, *reversed(parts)])


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _guarded_by_allow_pickle(function: ast.FunctionDef) -> bool:
    """The function starts (before any load) with ``if not allow_pickle: raise ...``."""
    for statement in function.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # docstring
        return (isinstance(statement, ast.If) and isinstance(statement.test, ast.UnaryOp)
                and isinstance(statement.test.op, ast.Not) and isinstance(statement.test.operand, ast.Name)
                and statement.test.operand.id == "allow_pickle" and isinstance(statement.body[-1], ast.Raise))
    return False


def unsafe_loads(source: str, filename: str) -> list[str]:
    """Every call in ``source`` that can unpickle (run code) without a literal opt-in, as ``file:line: what``."""
    tree = ast.parse(source, filename)
    names = _imports(tree)
    parents: dict[ast.AST, ast.AST] = {}
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent

    def enclosing_function(node: ast.AST) -> ast.FunctionDef | None:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):  # class X(pickle.Unpickler): X(f).load()
        if any((_dotted(base, names) or "") in UNSAFE_CALLS for base in cls.bases):
            restricted = any(isinstance(n, ast.FunctionDef) and n.name == "find_class" for n in cls.body)
            if not ((filename, cls.name) in RESTRICTED_UNPICKLERS and restricted):
                found.append(f"{filename}:{cls.lineno}: subclass of an unpickler ({cls.name})")
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        name = _dotted(call.func, names) or ""
        name = name.replace("np.", "numpy.", 1) if name.startswith("np.") else name
        problem = None
        if name in UNSAFE_CALLS:
            problem = name
        elif name == "torch.load" and not _is_true(_keyword(call, "weights_only")):
            problem = "torch.load without weights_only=True"
        elif name in ("numpy.load",) and _keyword(call, "allow_pickle") is not None and not (
                isinstance(_keyword(call, "allow_pickle"), ast.Constant) and _keyword(call, "allow_pickle").value is False):
            problem = "numpy.load with allow_pickle"
        elif name == "yaml.load" and not any(isinstance(a, ast.Attribute) and a.attr in ("SafeLoader", "CSafeLoader")
                                             for a in [*call.args[1:], *(k.value for k in call.keywords)]):
            problem = "yaml.load without SafeLoader"
        elif name.endswith((".pl_load", "cloud_io._load")) and not _is_true(_keyword(call, "weights_only")):
            problem = "Lightning's loader without weights_only=True"
        elif isinstance(call.func, ast.Attribute) and call.func.attr == "load_from_checkpoint" and not _is_true(
                _keyword(call, "weights_only")):
            problem = "load_from_checkpoint without weights_only=True"
        elif (isinstance(call.func, ast.Attribute) and call.func.attr in LIGHTNING_LOADS
              and _keyword(call, "ckpt_path") is not None
              and not (isinstance(_keyword(call, "ckpt_path"), ast.Constant) and _keyword(call, "ckpt_path").value is None)
              and not _is_true(_keyword(call, "weights_only"))):
            problem = f"Trainer.{call.func.attr}(ckpt_path=...) without weights_only=True"
        if problem is None:
            continue
        function = enclosing_function(call)
        allowed = ALLOWED.get((filename, function.name if function else None))
        if allowed == problem and function is not None and _guarded_by_allow_pickle(function):
            continue
        found.append(f"{filename}:{call.lineno}: {problem}")
    return found


def project_sources() -> list[Path]:
    files = sorted((REPO / "lightning_putm").rglob("*.py")) + [REPO / "evaluate.py", REPO / "train_backbone.py"]
    files += sorted((REPO / "benchmarks").glob("*.py")) + sorted((REPO / "tools").glob("*.py"))
    return [f for f in files if f.is_file()]


def test_no_code_path_unpickles_without_the_opt_in() -> None:
    sources = project_sources()
    assert len(sources) > 20
    problems = []
    for path in sources:
        problems += unsafe_loads(path.read_text(), str(path.relative_to(REPO)))
    LEDGER.extra["source files scanned"] = len(sources)
    assert not problems, "unsafe loads:\n" + "\n".join(problems)


def test_the_scanner_catches_unsafe_loads() -> None:
    bad = '''
import pickle, torch, yaml, joblib
import numpy as np
import pickle as pk
from pickle import loads as l
from torch import load as tl
def f(path, trainer, model, Model):
    pickle.load(open(path, "rb"))
    pk.loads(b"")
    l(b"")
    torch.load(path)
    torch.load(path, weights_only=False)
    tl(path, weights_only=flag)
    np.load(path, allow_pickle=True)
    yaml.load(open(path))
    joblib.load(path)
    Model.load_from_checkpoint(path)
    trainer.fit(model, ckpt_path=path)
    trainer.test(model, ckpt_path="last")
def _load_pickle_features(path, allow_pickle):
    return pickle.load(open(path, "rb"))  # allowed name, but no guard
class Sneaky(pickle.Unpickler):
    pass
'''
    found = unsafe_loads(bad, "lightning_putm/features/files.py")
    assert len(found) == 14, "\n".join(found)
    unrestricted = "import pickle\nclass ArrayOnlyUnpickler(pickle.Unpickler):\n    pass\n"
    assert len(unsafe_loads(unrestricted, "lightning_putm/data/cifarfs.py")) == 1  # allowed name, no find_class
    good = '''
import pickle, torch, yaml
import numpy as np
def _load_pickle_features(path, allow_pickle):
    """doc"""
    if not allow_pickle:
        raise ValueError("no")
    return pickle.load(open(path, "rb"))
def g(path, trainer, model):
    torch.load(path, map_location="cpu", weights_only=True)
    np.load(path)
    np.load(path, allow_pickle=False)
    yaml.load(open(path), Loader=yaml.SafeLoader)
    trainer.fit(model, ckpt_path=path, weights_only=True)
    trainer.fit(model, ckpt_path=None)
    pickle.dumps(1)
'''
    assert unsafe_loads(good, "lightning_putm/features/files.py") == []


# ------------------------------------------------------------------------------------------- runtime guard
def _guarded_torch_load(original):
    def load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, f"torch.load called without weights_only=True: {args[:1]}"
        return original(*args, **kwargs)
    return load


def _no_pickle(*args, **kwargs):
    raise AssertionError("pickle.load/loads called during a job that has no allow_pickle opt-in")


def test_whole_jobs_run_without_any_unsafe_load(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Evaluate (feature file; checkpoint with cache write then cache read) and train + resume, with every
    ``pickle.load(s)`` disabled and ``torch.load`` demanding ``weights_only=True``."""
    features = save_features(make_clustered_features(classes=6, per_class=20, dim=8), tmp_path / "f.pt")
    guards = [mock.patch.object(torch, "load", _guarded_torch_load(torch.load)),
              mock.patch.object(pickle, "load", _no_pickle), mock.patch.object(pickle, "loads", _no_pickle)]
    for guard in guards:
        guard.start()
    try:
        jobs = {
            "evaluate features=<file>": ("evaluate", [*FAST_EVAL, f"output_dir={tmp_path / 'e1'}", f"features={features}"]),
            "evaluate checkpoint= (extract, write cache)": ("evaluate", [
                *FAST_EVAL, f"output_dir={tmp_path / 'e2'}", f"checkpoint={tiny_checkpoint}",
                f"feature_cache_dir={tmp_path / 'cache'}"]),
            "evaluate checkpoint= (read cache)": ("evaluate", [
                *FAST_EVAL, f"output_dir={tmp_path / 'e3'}", f"checkpoint={tiny_checkpoint}",
                f"feature_cache_dir={tmp_path / 'cache'}"]),
            "train_backbone two stages": ("train_backbone", [
                *FAST_TRAIN, f"checkpoint_dir={tmp_path / 'ck'}", "trainer.max_epochs=1"]),
            "train_backbone resume=true": ("train_backbone", [
                *FAST_TRAIN, f"checkpoint_dir={tmp_path / 'ck'}", "trainer.max_epochs=2", "resume=true"]),
        }
        for name, (script, argv) in jobs.items():
            outcome = run_in_process(script, argv)
            assert outcome.returncode == 0, f"{name}: {outcome.stderr[-2000:]}"
    finally:
        for guard in guards:
            guard.stop()
    assert (tmp_path / "e2" / "per_task.csv").read_bytes() == (tmp_path / "e3" / "per_task.csv").read_bytes()
    assert read_checkpoint(tmp_path / "ck" / "digits" / "conv4" / "latest" / "s2m2r" / "last.ckpt")["epoch"] == 1
