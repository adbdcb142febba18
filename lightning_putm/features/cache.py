"""Features from saved checkpoints: a safe backbone loader and a feature cache keyed by what produced them.

Evaluating many methods, shots and α values on the same checkpoint needs the backbone's features of the
novel split once, not once per run. The cache key is everything that determines those features:

* the SHA-256 of the checkpoint file's *content* (a retrained checkpoint at the same path is a new key); for a
  timm model (``checkpoint=timm:<name>``) that of its weights file, and the model's name,
* the dataset, its root and reader options, the split,
* the evaluation image transform (its ``repr``: size, resize, normalisation),
* the numeric precision of the extraction (``trainer.precision``: bf16 features are not fp32 features).

Cached files use our tensor-only feature format (``lightning_putm.features``), are written atomically and are
read with ``weights_only=True``. A cache file whose stored key differs, or that cannot be read, is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_putm.errors import FeatureError
from lightning_putm.features.files import FeatureSet, load_features, save_features

CACHE_FORMAT = 1


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (streamed)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk_bytes), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class FeatureCacheKey:
    """What determines the extracted features of one split."""

    checkpoint_sha256: str
    dataset: str
    root: str
    options: str  # JSON of the reader options
    split: str
    transform: str  # repr of the evaluation transform
    model: str = ""  # timm model name (checkpoint=timm:<name>); "" for a train_backbone.py checkpoint
    precision: str = ""  # the extraction's trainer.precision; "" for full precision (fp32)

    def fields(self) -> dict[str, str]:
        """The key as stored; ``model`` and ``precision`` only when set, so the keys of caches written before they
        existed (by fp32 extractions) stay valid."""
        values = asdict(self)
        for optional in ("model", "precision"):
            if not values[optional]:
                del values[optional]
        return values

    def digest(self) -> str:
        text = json.dumps({"format": CACHE_FORMAT, **self.fields()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def extraction_precision(value: object) -> str:
    """``trainer.precision`` as the cache key holds it: "" for full precision (unset, 32, ``32-true``), else
    Lightning's name (``bf16-mixed``, ``16-mixed``, ``64-true``, ...)."""
    text = "" if value is None else str(value).strip()
    return "" if text in ("", "32", "32-true", "None", "null") else text


class FeatureCache:
    """One cache file for one key: ``<folder>/<dataset>-<split>-<checkpoint sha[:12]>-<key digest[:12]>.pt``."""

    def __init__(self, folder: str | Path, key: FeatureCacheKey) -> None:
        self.key = key
        name = f"{key.dataset}-{key.split}-{key.checkpoint_sha256[:12]}-{key.digest()[:12]}.pt"
        self.path = Path(folder) / name

    def load(self) -> FeatureSet | None:
        """The cached features, or ``None`` when absent, unreadable or stored under another key."""
        if not self.path.is_file():
            return None
        try:
            cached = load_features(self.path)
        except FeatureError as exc:
            warnings.warn(f"ignoring unreadable feature cache {self.path} ({exc}); extracting again", stacklevel=2)
            return None
        if cached.metadata.get("cache_key") != self.key.fields():
            return None
        return cached

    def store(self, feature_set: FeatureSet) -> Path:
        """Write atomically, recording the key in the metadata."""
        feature_set.metadata["cache_key"] = self.key.fields()
        return save_features(feature_set, self.path)
