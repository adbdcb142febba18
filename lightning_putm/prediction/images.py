"""Prediction on a user's own images: labelled support folders and unlabelled query images → one few-shot task.

The question most asked of few-shot code is how to use a trained backbone on one's own pictures. This module
answers it with the pieces evaluation already uses, for exactly one task:

* :func:`read_folders` finds the images: ``support/<class>/…`` (one sub-folder per class, searched recursively, any
  number of images per class) and ``query/…`` (searched recursively). Images are found by extension
  (:data:`IMAGE_EXTENSIONS`); hidden files and folders are skipped; empty classes are errors.
* :func:`checkpoint_image_reader` turns a file into the tensor the backbone saw during evaluation: the checkpoint
  records its data settings (``data_config``), and the reader applies that dataset's decoding (grayscale or RGB,
  whatever the file holds; Omniglot's resize and ink inversion) and then the same evaluation transform
  (:func:`~lightning_putm.data.transforms.eval_transform`: resize, centre crop, normalisation) as extraction does.
* :func:`extract_features` runs the backbone (no gradients, in batches) and names every file that cannot be decoded.
* :func:`predict_task` solves the task ``N`` = number of classes, ``K`` per class as given, ``Q`` = every query
  with any method of the registry; :func:`write_predictions` and :func:`write_counts` write the CSV files atomically.

The estimated number of queries per class is the column sum of the method's query probabilities. For PUTM these
probabilities are the forward navigator π_f(k|j) (Tian et al., ICCV 2023, §3), so the estimate is PUTM's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from lightning_putm.config import group_options, load_group, to_container
from lightning_putm.data.imagesplit import decode_image
from lightning_putm.data.registry import dataset_info
from lightning_putm.data.transforms import eval_transform
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.models.batching import MemoryAdaptedForward
from lightning_putm.models.timm_pretrained import timm_transform

#: Files with these extensions (any case) are images; everything else in the folders is ignored with a notice.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
#: How many unreadable files an error lists by name (the rest are counted).
LISTED_FILES = 5


# ------------------------------------------------------------------------------------------------ folders
@dataclass
class PredictionImages:
    """The images of one prediction task: support files with labels ``0..N-1`` and the query files."""

    class_names: list[str]
    support_paths: list[Path]
    support_labels: torch.Tensor  # [S] long
    query_root: Path
    query_paths: list[Path]
    ignored: list[Path]  # files skipped because their extension is not an image's

    @property
    def ways(self) -> int:
        return len(self.class_names)

    def shots(self) -> list[int]:
        """Support images per class, in class order."""
        return torch.bincount(self.support_labels, minlength=self.ways).tolist()

    def query_names(self) -> list[str]:
        """Each query's path relative to the query folder (POSIX separators), as written in the CSV."""
        return [p.relative_to(self.query_root).as_posix() for p in self.query_paths]


def _visible_files(folder: Path) -> list[Path]:
    """Every file under ``folder`` (recursively, sorted), skipping hidden files and anything in hidden folders."""
    found = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder).parts
        if any(part.startswith(".") for part in relative) or not path.is_file():
            continue
        found.append(path)
    return sorted(found)


def _split_images(files: list[Path]) -> tuple[list[Path], list[Path]]:
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    return images, [p for p in files if p.suffix.lower() not in IMAGE_EXTENSIONS]


def _require_folder(folder: Path, key: str, what: str) -> Path:
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise DataError(f"{key}={folder}: folder not found; pass {key}=<folder> with {what}")
    if not folder.is_dir():
        raise DataError(f"{key}={folder} is a file, not a folder; pass {key}=<folder> with {what}")
    return folder


def read_folders(support: str | Path, query: str | Path) -> PredictionImages:
    """The support classes (sorted sub-folder names) and images, and the query images; every problem is a
    :class:`DataError` naming the folder."""
    extensions = ", ".join(IMAGE_EXTENSIONS)
    support = _require_folder(Path(support), "support", "one sub-folder of images per class")
    query = _require_folder(Path(query), "query", "the unlabelled images")
    class_dirs = sorted(p for p in support.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose, _ = _split_images([p for p in support.iterdir() if p.is_file() and not p.name.startswith(".")])
    if loose:
        names = ", ".join(p.name for p in loose[:LISTED_FILES]) + (" …" if len(loose) > LISTED_FILES else "")
        raise DataError(f"support={support} holds images outside class sub-folders ({names}); put every support "
                        "image in the sub-folder named after its class")
    if len(class_dirs) < 2:
        found = f"only {class_dirs[0].name!r}" if class_dirs else "none"
        raise DataError(f"support={support} needs at least 2 class sub-folders (support/<class>/<images>), found "
                        f"{found}")
    paths: list[Path] = []
    labels: list[int] = []
    ignored: list[Path] = []
    empty: list[str] = []
    for label, folder in enumerate(class_dirs):
        images, others = _split_images(_visible_files(folder))
        ignored += others
        if not images:
            empty.append(str(folder))
        paths += images
        labels += [label] * len(images)
    if empty:
        raise DataError(f"support class folder(s) with no images ({extensions}): {', '.join(empty)}; add images "
                        "or remove the folder")
    query_images, others = _split_images(_visible_files(query))
    ignored += others
    if not query_images:
        raise DataError(f"query={query} holds no images ({extensions}); put the unlabelled images there")
    overlap = sorted({p.resolve() for p in paths} & {p.resolve() for p in query_images})
    if overlap:
        raise DataError(f"{overlap[0]} is both a support and a query image; keep the query folder apart from the "
                        "support folder")
    return PredictionImages([d.name for d in class_dirs], paths, torch.tensor(labels, dtype=torch.long), query,
                            query_images, ignored)


# ------------------------------------------------------------------------------------------ image reading
@dataclass
class ImageReader:
    """File → the ``[C, H, W]`` tensor the backbone expects, as the checkpoint's evaluation reads its data."""

    dataset: str
    channels: int
    decode: Callable[[Path], Any]  # file → what the evaluation transform takes (PIL image or float tensor)
    transform: Callable[[Any], torch.Tensor]
    description: str

    def __call__(self, path: Path) -> torch.Tensor:
        return self.transform(self.decode(path))


def omniglot_pixels(path: Path, image_size: int) -> torch.Tensor:
    """An Omniglot-style image as the Omniglot reader stores it: grayscale, Lanczos-resized to ``image_size``,
    ink = 1 on a 0 background (ProtoNets feed 1 − pixel), float ``[1, s, s]`` in [0, 1]."""
    gray = decode_image(path, "L")
    try:
        resized = gray.resize((image_size, image_size), Image.Resampling.LANCZOS)
    except Exception as exc:  # a PIL failure on a decoded image: still the file's fault
        raise DataError(f"cannot read image {path}: {exc}. The file is corrupt or not an image") from exc
    ink = 255 - np.asarray(resized, dtype=np.uint8)
    return torch.from_numpy(ink.copy()).unsqueeze(0).float().div_(255.0)


def grayscale_pixels(path: Path) -> torch.Tensor:
    """Any image as one float channel in [0, 1], brightness as stored (the digits demo: bright ink on dark)."""
    return v2.functional.to_dtype(v2.functional.to_image(decode_image(path, "L")), torch.float32, scale=True)


def checkpoint_image_reader(hparams: dict[str, Any], source: str = "the checkpoint") -> ImageReader:
    """The reader for a ``train_backbone.py`` checkpoint's hyper-parameters (its recorded ``data_config``).

    Datasets read from files (miniImageNet, tieredImageNet, CUB, CIFAR-FS) decode to RGB or grayscale as the
    backbone's input channels say, then apply the evaluation transform (resize to ``eval_resize × size``, centre
    crop, normalisation). Datasets decoded into memory apply their reader's decoding first: Omniglot's grayscale,
    Lanczos resize and ink inversion; the digits demo's grayscale in [0, 1]. Then the same evaluation transform.
    """
    recorded = hparams.get("data_config")
    if not isinstance(recorded, dict) or not recorded.get("name"):
        raise DataError(f"{source} records no data settings (data_config), so it is unknown how its images were "
                        "read; use a checkpoint written by this version of train_backbone.py")
    name = str(recorded["name"])
    try:
        info = dataset_info(name)
    except ConfigError as exc:
        raise DataError(f"{source} was trained on data={name}, which this version cannot read ({exc})") from exc
    # as evaluate.py does with checkpoint=: conf/data/<name>.yaml, then the values the checkpoint records
    defaults = to_container(load_group("data", name)) if name in group_options("data") else {}
    data = {**defaults, **recorded}
    channels = int(hparams.get("in_channels", info.channels))
    if channels not in (1, 3):
        raise DataError(f"{source} expects {channels}-channel images; only 1 (grayscale) or 3 (RGB) can be read")
    image_size = int(data.get("image_size") or 84)
    normalize = data.get("normalize") or None
    eval_resize = 1.15 if data.get("eval_resize") is None else float(data["eval_resize"])  # FewShotDataModule's default
    transform = eval_transform(image_size, channels, normalize, from_files=not info.in_memory,
                               resize_factor=eval_resize)
    mode = "RGB" if channels == 3 else "L"
    if not info.in_memory:
        decode: Callable[[Path], Any] = lambda path: decode_image(path, mode)  # noqa: E731
        how = f"{'RGB' if channels == 3 else 'grayscale'}"
    elif name == "omniglot":
        stored = int((data.get("options") or {}).get("image_size", 28))
        decode = lambda path: omniglot_pixels(path, stored)  # noqa: E731
        how = f"grayscale, Lanczos-resized to {stored}×{stored}, ink inverted (dark ink on light paper expected)"
    elif name == "digits":
        decode = grayscale_pixels
        how = "grayscale in [0, 1] as stored (bright ink on a dark background, as scikit-learn's digits)"
    else:
        raise DataError(f"{source} was trained on in-memory data={name}; reading image files for it is not supported")
    steps = ", ".join(" ".join(str(step).split()) for step in transform.transforms)
    return ImageReader(name, channels, decode, transform, f"{name} evaluation: {how}; then {steps}")


class RGBFile:
    """Decode a file as RGB (picklable, unlike a lambda)."""

    def __call__(self, path: Path) -> Any:
        return decode_image(path, "RGB")


def timm_image_reader(name: str) -> ImageReader:
    """The reader for ``checkpoint=timm:<name>``: any file decoded as RGB (grayscale repeated to three channels), then
    the model's own evaluation preprocessing (its resize, centre crop and normalisation)."""
    transform = timm_transform(name)
    return ImageReader(f"timm:{name}", 3, RGBFile(), transform, f"timm:{name} preprocessing: RGB; then "
                       f"{repr(transform)[len('TimmPreprocess(RGBImage(), '):-1]}")


# ------------------------------------------------------------------------------------------------ features
@torch.no_grad()
def extract_features(backbone: torch.nn.Module, paths: Sequence[Path], reader: Callable[[Path], torch.Tensor],
                     device: torch.device, batch_size: int = 256,
                     progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Backbone features ``[n, d]`` (float32, CPU) of ``paths`` in order; ``progress(n)`` after each batch of
    ``n`` files (e.g. :class:`~lightning_putm.evaluation.progress.ProgressLines` in a log file).

    Every file is decoded even after a bad one, so the error lists all unreadable files at once (up to
    :data:`LISTED_FILES` by name); nothing is written in any case.
    """
    backbone = backbone.eval().to(device)
    forward = MemoryAdaptedForward(backbone)  # halves the batch on out-of-memory
    rows: list[torch.Tensor] = []
    batch: list[torch.Tensor] = []
    bad: list[tuple[Path, str]] = []

    def flush() -> None:
        if batch and not bad:
            rows.append(forward(torch.stack(batch).to(device)).float().cpu())
        if progress is not None:
            progress(len(batch))
        batch.clear()

    for path in paths:
        try:
            batch.append(reader(path))
        except DataError as exc:
            bad.append((path, str(exc)))
        if len(batch) >= batch_size:
            flush()
    flush()
    if bad:
        named = "; ".join(f"{p}" for p, _ in bad[:LISTED_FILES])
        more = f" and {len(bad) - LISTED_FILES} more" if len(bad) > LISTED_FILES else ""
        raise DataError(f"{len(bad)} file(s) cannot be read as images: {named}{more} (first: {bad[0][1]}); "
                        "replace or remove them")
    return torch.cat(rows) if rows else torch.empty(0, 0)


# ---------------------------------------------------------------------------------------------- prediction


# ---------------------------------------------------------------------------------------------------- CSV
