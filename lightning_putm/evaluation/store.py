"""Finished settings on disk, so an interrupted evaluation resumes where it stopped.

An evaluation of many (method, shot, α) settings can run for hours. Each finished setting's per-task accuracies
are written at once, atomically, to ``<output_dir>/settings/<method>-<shots>shot-alpha_<α>.pt`` (with K_eff classes
in the query set, ``<method>-<shots>shot-keff_<K_eff>-alpha_<α>.pt``), together with a *fingerprint*: everything
that determines that setting's numbers (the feature table's content, the base-class statistics, the method and its
parameters, ways, shots, α, K_eff when set, queries, tasks, seed, oracle prior, device type). Run
the same command with the same ``output_dir`` again and every setting whose stored fingerprint matches is read
back instead of solved; a setting whose inputs changed is solved again, and the run says which inputs changed.
Episode banks are a pure function of the seed, so the per-task files of a resumed run equal an uninterrupted
run's byte for byte (``results.csv`` too: the stored solve time is reused).

Files are tensors plus JSON text, read with ``torch.load(weights_only=True)``: no pickle.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_putm.atomic import atomic_torch_save
from lightning_putm.validators import alpha_label, query_classes_label

#: Folder under ``output_dir`` that holds one file per finished setting.
SETTINGS_FOLDER = "settings"
FORMAT = "lightning-putm/setting-result/v1"


def tensor_digest(tensor: torch.Tensor | None) -> str | None:
    """SHA-256 of a tensor's dtype, shape and bytes (``None`` for ``None``): identifies features and statistics."""
    if tensor is None:
        return None
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def fingerprint(inputs: dict[str, Any]) -> str:
    """A stable hash of JSON-serialisable inputs (keys sorted)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class StoredSetting:
    """One finished setting read back from disk."""

    accuracies: torch.Tensor  # [T] float64
    seconds: float
    precision: str
    oracle_prior: bool


class SettingStore:
    """Per-setting result files under ``<folder>/settings`` (see the module docstring).

    ``writable`` is false on the non-zero ranks of a distributed run: every rank reads, one rank writes.
    """

    def __init__(self, folder: Path, writable: bool = True) -> None:
        self.folder = Path(folder) / SETTINGS_FOLDER
        self.writable = writable
        self.written: list[Path] = []  # files this run wrote or reused (the rest are stale)
        self.reused: list[str] = []  # settings read back instead of solved
        self.changed: dict[str, list[str]] = {}  # setting -> inputs that differ from the stored ones

    def path(self, method: str, shots: int, alpha: float | str | None, query_classes: int | None = None) -> Path:
        """The setting's file; a K_eff (PADDLE's protocol) has its own, so no setting is read back for another."""
        keff = "" if query_classes is None else f"-keff_{query_classes_label(query_classes)}"
        return self.folder / f"{method}-{shots}shot{keff}-alpha_{alpha_label(alpha)}.pt"

    def load(self, method: str, shots: int, alpha: float | str | None, inputs: dict[str, Any],
             query_classes: int | None = None) -> StoredSetting | None:
        """The stored result when its fingerprint equals that of ``inputs``; else ``None`` (and the reason is kept)."""
        path = self.path(method, shots, alpha, query_classes)
        if not path.is_file():
            return None
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            meta = json.loads(payload["meta"])
            accuracies = payload["accuracies"]
            if meta.get("format") != FORMAT or not isinstance(accuracies, torch.Tensor):
                raise ValueError("unknown format")
        except Exception:  # a file we cannot read is solved again (and replaced), never trusted
            self.changed[path.stem] = ["unreadable file"]
            return None
        if meta.get("fingerprint") != fingerprint(inputs):
            stored = meta.get("inputs", {})
            self.changed[path.stem] = sorted(k for k in set(stored) | set(inputs) if stored.get(k) != _jsonable(inputs.get(k)))
            return None
        if accuracies.numel() != int(inputs.get("tasks", accuracies.numel())):
            self.changed[path.stem] = ["tasks"]
            return None
        self.written.append(path)
        self.reused.append(path.stem)
        return StoredSetting(accuracies.to(torch.float64), float(meta["seconds"]), str(meta.get("precision", "")),
                             bool(meta.get("oracle_prior", False)))

    def save(self, method: str, shots: int, alpha: float | str | None, inputs: dict[str, Any],
             accuracies: torch.Tensor, seconds: float, precision: str, oracle_prior: bool,
             query_classes: int | None = None) -> Path | None:
        """Write one finished setting atomically (:mod:`lightning_putm.atomic`); nothing on read-only ranks."""
        path = self.path(method, shots, alpha, query_classes)
        if not self.writable:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "fingerprint": fingerprint(inputs), "inputs": _jsonable(inputs),
                "seconds": seconds, "precision": precision, "oracle_prior": oracle_prior}
        atomic_torch_save({"accuracies": accuracies.detach().to("cpu", torch.float64).clone(),
                           "meta": json.dumps(meta)}, path)
        self.written.append(path)
        return path

    def notice(self) -> str | None:
        """One line about what was resumed and what had to be solved again (``None`` when nothing was stored)."""
        parts = []
        if self.reused:
            parts.append(f"resumed {len(self.reused)} finished setting(s) from {self.folder}")
        for stem, keys in sorted(self.changed.items()):
            parts.append(f"{stem} solved again: its stored result was computed with different {', '.join(keys)}")
        return "; ".join(parts) or None


def _jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists), so stored and new inputs compare equal."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))
