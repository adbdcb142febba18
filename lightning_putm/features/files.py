"""Feature sets: the in-memory type, our safe on-disk cache, and the legacy pickle reader.

Transductive few-shot methods work on pre-extracted backbone features, so features are the hand-off
point between a backbone (or a file from another project) and the episode bank.

* Our own format (``.pt``) is a plain dict of tensors and a JSON string, read with
  ``torch.load(weights_only=True)``, which cannot execute code. It is written atomically
  (:mod:`lightning_putm.atomic`) so an interrupted write never leaves a half-written file under the real name.
* The widely shared ``{int label: list of (d,) arrays}`` pickle (e.g. ``novel.plk`` from the S2M2 and
  PT-MAP code bases) runs arbitrary code when loaded, so it is read only with ``allow_pickle=True``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_putm.atomic import atomic_torch_save
from lightning_putm.errors import FeatureError
from lightning_putm.validators import path_hint

FORMAT_NAME = "lightning-putm-features"
FORMAT_VERSION = 1
PICKLE_SUFFIXES = (".plk", ".pkl", ".pickle")
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass
class FeatureSet:
    """Float32 features ``[n, d]`` with integer labels ``[n]`` in ``0..C-1``, class names and metadata."""

    features: torch.Tensor
    labels: torch.Tensor
    class_names: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.features, torch.Tensor) or self.features.dim() != 2:
            raise FeatureError(
                f"features must be a 2-D tensor [n, d]; got {getattr(self.features, 'shape', type(self.features))}"
            )
        if not isinstance(self.labels, torch.Tensor) or self.labels.dim() != 1:
            raise FeatureError("labels must be a 1-D tensor [n]")
        if self.labels.dtype not in _INTEGER_DTYPES:  # float, bool, complex
            raise FeatureError(f"labels must be integers, got dtype {self.labels.dtype}; store class indices 0..C-1")
        if self.features.shape[1] == 0 and len(self.features):
            raise FeatureError("features have 0 dimensions (shape [n, 0]); every row needs at least one value")
        if not (self.features.dtype.is_floating_point or self.features.dtype in _INTEGER_DTYPES):
            raise FeatureError(f"features must be real numbers, got dtype {self.features.dtype}")
        if len(self.labels) != len(self.features):
            raise FeatureError(f"{len(self.features)} feature rows but {len(self.labels)} labels; they must match")
        self.features = self.features.float()
        self.labels = self.labels.long()
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= len(self.class_names)):
            raise FeatureError(
                f"labels must lie in 0..{len(self.class_names) - 1} (one per class name); "
                f"found {int(self.labels.min())}..{int(self.labels.max())}"
            )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def check_finite(self, source: str = "features") -> None:
        """Refuse NaN/Inf: one bad row silently poisons every task that draws it."""
        bad = ~torch.isfinite(self.features).all(dim=1)
        if bad.any():
            rows = bad.nonzero().flatten()[:5].tolist()
            raise FeatureError(
                f"{source} contain NaN or Inf in {int(bad.sum())} row(s) (first rows: {rows}); "
                "re-extract the features or drop those rows"
            )

    def class_sizes(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)


def save_features(feature_set: FeatureSet, path: str | os.PathLike) -> Path:
    """Write ``feature_set`` atomically in our safe format and return the path."""
    path = Path(path)
    payload = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "features": feature_set.features.detach().cpu().contiguous(),
        "labels": feature_set.labels.detach().cpu().contiguous(),
        "meta_json": json.dumps({"class_names": feature_set.class_names, "metadata": feature_set.metadata}),
    }
    atomic_torch_save(payload, path)
    return path


def looks_like_torch_file(path: str | os.PathLike) -> bool:
    """``torch.save`` writes a zip archive (legacy files are a bare pickle, starting with the PROTO opcode).

    Anything else is truncated, random or foreign; saying so beats a confusing unpickler message.
    """
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as handle:
        return handle.read(1) == b"\x80"


def unsafe_load_reason(exc: BaseException) -> str:
    """One short line on why a weights-only ``torch.load`` refused a file (PyTorch's own text is a page long).

    ``Unsupported global: GLOBAL x.y`` means the file asks to import and call ``x.y`` (code execution); any other
    refusal (an opcode the safe unpickler does not run) means a corrupt file or a general pickle.
    """
    text = " ".join(str(exc).split())
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"it asks to import and call {found.group(1)}"
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
    return (found.group(1).strip() if found else text[:200]) or "refused by the weights-only unpickler"


def check_feature_path(path: str | os.PathLike, setting: str = "features=") -> Path:
    """``path`` as a :class:`Path`, or a :class:`FeatureError` when it is missing or not a regular file.
    ``setting`` is how the user gave it (``features=``, ``base_features=``, ``--features``), for the message."""
    path = Path(path)
    if not path.exists():
        raise FeatureError(f"feature file not found: {path}; {path_hint(path)}check the `{setting}` path")
    if not path.is_file():
        raise FeatureError(f"{path} is not a regular file (a folder or a device); check the `{setting}` path")
    return path


def load_features(path: str | os.PathLike, allow_pickle: bool = False, setting: str = "features=") -> FeatureSet:
    """Load a feature file: our ``.pt`` format, or a legacy pickle when ``allow_pickle`` is set (``setting``: as
    :func:`check_feature_path`)."""
    path = check_feature_path(path, setting)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return _load_pickle_features(path, allow_pickle)
    if not looks_like_torch_file(path):
        raise FeatureError(f"cannot read feature file {path}: it is not a complete PyTorch file (truncated, corrupt "
                           "or another format). Re-create it with lightning_putm.features.save_features; a legacy "
                           "pickle needs the .plk/.pkl suffix and allow_pickle=true")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise FeatureError(
            f"{path} is not a safe lightning-putm feature file: a weights-only load refused it "
            f"({unsafe_load_reason(exc)}); it is corrupt or needs code execution to load. If it is a trusted legacy "
            "pickle, rename it to .plk/.pkl and pass allow_pickle=true"
        ) from exc
    except Exception as exc:  # truncated, random bytes, not a torch file
        raise FeatureError(f"cannot read feature file {path}: {exc}. The file is corrupt or not a feature file") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_NAME:
        raise FeatureError(
            f"{path} is a torch file but not a lightning-putm feature file (missing format tag); "
            "write features with lightning_putm.features.save_features"
        )
    try:
        meta = json.loads(payload["meta_json"])
        names, metadata = meta["class_names"], meta["metadata"]
        if not isinstance(names, list) or not isinstance(metadata, dict):
            raise TypeError("class_names must be a list and metadata a mapping")
        feature_set = FeatureSet(payload["features"], payload["labels"], [str(n) for n in names], metadata)
    except (KeyError, json.JSONDecodeError, TypeError) as exc:
        raise FeatureError(f"feature file {path} is malformed ({exc!r}); re-create it") from exc
    feature_set.metadata.setdefault("source", str(path))
    return feature_set


def _load_pickle_features(path: Path, allow_pickle: bool) -> FeatureSet:
    if not allow_pickle:
        raise FeatureError(
            f"{path} is a pickle file. Loading a pickle can run arbitrary code, so it is off by default. "
            "If you trust the file, pass allow_pickle=true (or convert it once to our safe .pt format with "
            "lightning_putm.features.save_features)"
        )
    with open(path, "rb") as handle:
        try:
            raw = pickle.load(handle)  # noqa: S301 - explicit user opt-in above
        except Exception as exc:
            raise FeatureError(f"cannot unpickle {path}: {exc}") from exc
    return feature_set_from_label_dict(raw, source=str(path))


def feature_set_from_label_dict(raw: Any, source: str = "dict") -> FeatureSet:
    """Convert ``{label: list of (d,) or (1, d) arrays}`` (the shared ``.plk`` layout) to a FeatureSet."""
    if not isinstance(raw, dict) or not raw:
        raise FeatureError(f"{source}: expected a non-empty dict {{label: list of feature vectors}}, got {type(raw).__name__}")
    rows: list[torch.Tensor] = []
    labels: list[int] = []
    try:
        keys = sorted(raw.keys(), key=lambda k: (str(type(k)), k))
    except TypeError:  # keys of one type that do not compare (e.g. tuples of mixed types)
        keys = sorted(raw.keys(), key=lambda k: (str(type(k)), repr(k)))
    for index, key in enumerate(keys):
        vectors = raw[key]
        try:
            if len(vectors) == 0:
                continue
            block = torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in vectors])
        except (TypeError, ValueError, RuntimeError) as exc:
            raise FeatureError(f"{source}: the entry of label {key!r} is not a list of numeric feature vectors of one length "
                               f"({type(exc).__name__}: {exc})") from exc
        rows.append(block)
        labels.extend([index] * len(block))
    dims = {r.shape[1] for r in rows}
    if len(dims) != 1:
        raise FeatureError(f"{source}: feature vectors have different lengths {sorted(dims)}; all must share one d")
    return FeatureSet(
        torch.cat(rows),
        torch.tensor(labels, dtype=torch.long),
        [str(k) for k in keys],
        {"source": source, "format": "label-dict pickle"},
    )
