"""Pretrained timm models as backbones: ``checkpoint=timm:<model name>`` in ``evaluate.py`` and ``evaluate.py predict``.

* :func:`~lightning_putm.models.timm_names.check_model_name` — the name, checked first; in its own module, which
  imports no torch, so that the jobs' settings check it at start-up.
* :func:`find_weights` — where the weights come from, decided before anything is written: ``pretrained_file=<path>``
  (no network), else the file timm would download, found in the Hugging Face hub cache (or torch hub's, for the few
  models hosted elsewhere); only when it is not cached and the network answers is it downloaded. With
  ``HF_HUB_OFFLINE=1``, or when the hub's host does not answer within :data:`PROBE_SECONDS`, a missing file is one
  error line saying to pass ``pretrained_file=`` or to warm the cache.
* :func:`load_timm_backbone` — reads the file weights-only (safetensors, or ``torch.load(weights_only=True)``), lets
  timm build the model from it (``timm.create_model(name, pretrained=True)`` with the weights passed in, so timm's
  own key conversions apply), strictly, then drops the classifier: the features are the pooled pre-logits
  (``num_classes=0``). Missing or unexpected keys are an error naming the file and the keys.
* :func:`timm_transform` — the model's own evaluation preprocessing (``timm.data.resolve_data_config`` /
  ``create_transform``) behind a step that makes any image RGB (grayscale files and in-memory 1-channel tensors
  such as the digits or Omniglot are repeated to three channels).
"""

from __future__ import annotations

import os
import pickle
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import torch
from PIL import Image

from lightning_putm.errors import DataError

#: How long the hub's host may take to accept a connection before the network counts as absent.
PROBE_SECONDS = 3.0
#: Weights files the hub holds for a timm model, in timm's order of preference (safetensors first).
HUB_FILES = ("model.safetensors", "pytorch_model.bin")
#: Keys of a training checkpoint that hold the model's weights, in timm's order (EMA weights first).
STATE_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")
#: How many key names an error lists.
LISTED_KEYS = 5
_TRUE = {"1", "ON", "YES", "TRUE"}


def pretrained_config(name: str) -> Any:
    """timm's pretrained config of ``name`` (the default tag for a bare architecture), or ``None``."""
    from timm.models import get_pretrained_cfg

    return get_pretrained_cfg(name)


@dataclass(frozen=True)
class TimmWeights:
    """A timm model and the local file its weights are read from."""

    model: str
    file: Path
    origin: str  # where the file was found, for the console


def find_weights(name: str, pretrained_file: Path | None = None) -> TimmWeights:
    """The weights file of ``timm:<name>``: ``pretrained_file``, else the hub cache, else a download (online only)."""
    if pretrained_file is not None:
        path = Path(pretrained_file).expanduser()
        if not path.is_file():
            raise DataError(f"pretrained_file={path}: file not found; give the weights file of timm:{name} "
                            "(.safetensors, .pth, .bin)")
        return TimmWeights(name, path, f"pretrained_file={path}")
    cfg = pretrained_config(name)
    fix = (f"pass pretrained_file=<weights file of {name}>, or run once with network access to fill the cache "
           "(the same command downloads it)")
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise DataError(f"checkpoint=timm:{name}: timm knows no pretrained weights for it; pass "
                        f"pretrained_file=<weights file>, or pick a name from timm.list_pretrained()")
    if cfg.custom_load:
        raise DataError(f"checkpoint=timm:{name}: its published weights need timm's custom loader (e.g. a JAX "
                        ".npz), which is not read here; pick another tag of the model, or pass pretrained_file=<a "
                        ".safetensors/.pth of its state dict>")
    if cfg.hf_hub_id:
        repo, _, revision = cfg.hf_hub_id.partition("@")
        files = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HUB_FILES
        cache = hub_cache_dir()
        for filename in files:
            cached = _hub_cached(repo, filename, cache, revision or None)
            if cached is not None:
                return TimmWeights(name, cached, f"the Hugging Face hub cache ({cached})")
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
        reason = offline_reason(endpoint)
        if reason:
            raise DataError(f"checkpoint=timm:{name}: its weights are not in the hub cache {cache} and {reason}; "
                            f"{fix}")
        return TimmWeights(name, _hub_download(name, repo, files, cache, revision or None, endpoint),
                           f"a download from {endpoint}/{repo}")
    url = str(cfg.url)
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
    if cached.is_file():
        return TimmWeights(name, cached, f"the torch hub cache ({cached})")
    reason = offline_reason(url)
    if reason:
        raise DataError(f"checkpoint=timm:{name}: its weights are not in the torch hub cache {cached.parent} and "
                        f"{reason}; {fix}")
    try:
        torch.hub.download_url_to_file(url, str(cached), progress=False)
    except Exception as exc:  # network or disk: one line
        raise DataError(f"checkpoint=timm:{name}: downloading {url} failed ({' '.join(str(exc).split())[:200]}); "
                        f"{fix}") from exc
    return TimmWeights(name, cached, f"a download from {url}")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (``HF_HUB_CACHE``, ``HF_HOME``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _hub_cached(repo: str, filename: str, cache: Path, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=str(cache), revision=revision)
    return Path(found) if isinstance(found, str) and Path(found).is_file() else None


def offline_reason(url: str) -> str:
    """Why nothing can be downloaded from ``url`` now (``""`` when its host accepts a connection): offline mode is
    set, or the host cannot be resolved or reached within :data:`PROBE_SECONDS`."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").strip().upper() in _TRUE:
            return f"{variable}={os.environ[variable]} forbids downloads"
    parts = urlparse(url)
    host = parts.hostname or ""
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            return ""
    except OSError as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        return f"there is no network ({host}:{port} does not answer: {detail})"


def _hub_download(name: str, repo: str, files: tuple[str, ...], cache: Path, revision: str | None,
                  endpoint: str) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    for filename in files:
        try:
            return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=str(cache), endpoint=endpoint))
        except RemoteEntryNotFoundError:
            continue  # the repo holds the other format
        except (LocalEntryNotFoundError, OSError, ValueError) as exc:  # connection lost, repo gone, disk
            raise DataError(f"checkpoint=timm:{name}: downloading {repo}/{filename} failed "
                            f"({' '.join(str(exc).split())[:200]}); pass pretrained_file=<weights file of {name}>"
                            ) from exc
    raise DataError(f"checkpoint=timm:{name}: the hub repository {repo} holds none of {', '.join(files)}; pass "
                    f"pretrained_file=<weights file of {name}>")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A weights file's tensors, read without running code: safetensors, or ``torch.load(weights_only=True)``
    (a training checkpoint's ``state_dict_ema``/``model_ema``/``state_dict``/``model`` entry is taken, as timm does,
    and a ``module.`` prefix of DataParallel is removed)."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            payload: Any = load_file(str(path), device="cpu")
        else:
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise DataError(f"pretrained weights {path} cannot be loaded safely, so they are refused (loading them would "
                        "run code from the file); save the model's state dict with safetensors or torch.save of "
                        "tensors only") from exc
    except Exception as exc:  # truncated, not a weights file, wrong format for the suffix
        raise DataError(f"cannot read pretrained weights {path}: {' '.join(str(exc).split())[:200]}; give a "
                        ".safetensors or .pth file of the model's state dict") from exc
    if isinstance(payload, dict):
        for key in STATE_KEYS:
            if isinstance(payload.get(key), dict):
                payload = payload[key]
                break
    if not isinstance(payload, dict) or not payload or \
            not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload.items()):
        raise DataError(f"pretrained weights {path} hold no state dict (a mapping of parameter names to tensors); "
                        "give a .safetensors or .pth file of the model's state dict")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in payload.items()}


def _classifiers(cfg: Any) -> tuple[str, ...]:
    names = getattr(cfg, "classifier", None) if cfg is not None else None
    return (names,) if isinstance(names, str) else tuple(names or ())


def load_timm_backbone(weights: TimmWeights) -> torch.nn.Module:
    """The model with the file's weights (strict: every key must fit), classifier removed, in eval mode."""
    import timm

    state = read_state_dict(weights.file)
    cfg = pretrained_config(weights.model)
    heads = [c for c in _classifiers(cfg) if f"{c}.weight" in state]
    # the model is built with the file's own head (or none), so timm loads every key strictly; the head is dropped after
    classes = int(state[f"{heads[0]}.weight"].shape[0]) if heads else 0
    overlay = {"state_dict": state, "num_classes": classes}
    try:
        model = timm.create_model(weights.model, pretrained=True, num_classes=classes, pretrained_cfg_overlay=overlay)
    except (RuntimeError, KeyError, ValueError, AssertionError) as exc:
        raise DataError(f"pretrained weights {weights.file} do not fit timm:{weights.model} "
                        f"({_key_difference(weights.model, classes, state, exc)}); give the weights of that very "
                        "model (same architecture and tag), or name the model they belong to") from exc
    model.pretrained_cfg.pop("state_dict", None)  # the cfg would keep a second copy of every tensor alive
    model.reset_classifier(0)
    return model.eval()


def _key_difference(name: str, classes: int, state: dict[str, torch.Tensor], exc: Exception) -> str:
    """Missing and unexpected keys of ``state`` for the model ``name`` (or the loader's first line)."""
    import timm

    try:
        own = set(timm.create_model(name, pretrained=False, num_classes=classes).state_dict())
    except Exception:  # noqa: BLE001 - only for the message
        own = set()
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own) if own else []
    said = []
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            said.append(f"{len(keys)} {what} key(s): {', '.join(keys[:LISTED_KEYS])}"
                        f"{' …' if len(keys) > LISTED_KEYS else ''}")
    if said:
        return "; ".join(said)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] or type(exc).__name__


class RGBImage:
    """Any image as a 3-channel PIL image: PIL images are converted, ``[C, H, W]`` tensors in [0, 1] (1 or 3
    channels, the in-memory datasets) are scaled to 8 bits and repeated to RGB."""

    def __call__(self, image: Any) -> Image.Image:
        if isinstance(image, Image.Image):
            return image if image.mode == "RGB" else image.convert("RGB")
        tensor = torch.as_tensor(image)
        if tensor.dtype != torch.uint8:
            tensor = (tensor.float().clamp(0, 1) * 255).round().to(torch.uint8)
        if tensor.ndim == 2:
            tensor = tensor.unsqueeze(0)
        if tensor.shape[0] == 1:
            tensor = tensor.expand(3, -1, -1)
        return Image.fromarray(tensor.permute(1, 2, 0).contiguous().numpy(), "RGB")

    def __repr__(self) -> str:
        return "RGBImage()"


class TimmPreprocess:
    """The model's own evaluation transform after :class:`RGBImage` (picklable, for DataLoader workers)."""

    def __init__(self, transform: Callable[[Any], torch.Tensor], config: dict[str, Any]) -> None:
        self.rgb, self.transform, self.config = RGBImage(), transform, dict(config)

    def __call__(self, image: Any) -> torch.Tensor:
        return self.transform(self.rgb(image))

    def __repr__(self) -> str:  # part of the feature-cache key
        steps = getattr(self.transform, "transforms", [self.transform])
        steps = ", ".join(" ".join(str(step).split()) for step in steps)
        return f"TimmPreprocess({self.rgb!r}, {steps})"


def timm_transform(name: str) -> TimmPreprocess:
    """``timm:<name>``'s evaluation preprocessing (resize, centre crop, normalisation of its pretrained config)."""
    import timm.data

    cfg = pretrained_config(name)
    config = timm.data.resolve_data_config(pretrained_cfg=cfg.to_dict() if cfg is not None else {})
    return TimmPreprocess(timm.data.create_transform(**config, is_training=False), config)
