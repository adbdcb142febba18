"""One split of an image dataset (labels, class names, images on disk or in memory) and its torch Datasets.

Readers of the on-disk layouts all return an :class:`ImageSplit`; it holds either file paths,
decoded lazily (miniImageNet, tieredImageNet, CUB, CIFAR-FS), or an in-memory uint8/float tensor (Omniglot at
28×28, the digits demo), whose tiny images are cheaper to keep decoded than to re-read every epoch.

Images that fail to decode. Reading a split lists files without opening them (decoding every image of
miniImageNet or tieredImageNet up front would take minutes). The first time a file that cannot be decoded is
loaded (truncated, empty, random bytes, not an image, too large for PIL's decompression-bomb guard),
:class:`FileImageDataset` raises a :class:`DataError` that names the file and says to replace or remove it;
the run stops with that one line (exit code 2), also from DataLoader worker processes. Bad images are never
skipped silently: a skipped image would change the episode bank and the class sizes without notice.
:func:`find_unreadable_images` checks a whole split ahead of a long run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image
from torch.utils.data import Dataset

from lightning_putm.errors import DataError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")


@dataclass
class ImageSplit:
    """Images of one split with integer labels ``0..C-1`` (one class name each)."""

    dataset: str
    split: str
    labels: torch.Tensor  # [n] long
    class_names: list[str]
    channels: int
    paths: list[Path] | None = None  # file-backed images (decoded on access)
    images: torch.Tensor | None = None  # or in-memory [n, C, H, W] (uint8 or float in [0, 1])
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.labels = torch.as_tensor(self.labels, dtype=torch.long)
        if (self.paths is None) == (self.images is None):
            raise ValueError("an ImageSplit holds either paths or in-memory images")
        n = len(self.paths) if self.paths is not None else int(self.images.shape[0])
        if n != len(self.labels):
            raise ValueError(f"{n} images but {len(self.labels)} labels")
        if n and (int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.class_names)):
            raise ValueError(f"labels must lie in 0..{len(self.class_names) - 1}")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def class_sizes(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)

    def to_dataset(self, transform: Callable[[Any], torch.Tensor] | None = None, with_index: bool = False) -> Dataset:
        """A torch Dataset of ``(image, label)`` (``(image, label, index)`` with ``with_index``)."""
        if self.paths is not None:
            return FileImageDataset(self.paths, self.labels, self.channels, transform, with_index)
        return TensorImageDataset(self.images, self.labels, transform, with_index)


class FileImageDataset(Dataset):
    """Decodes image files with PIL (RGB or L) and applies ``transform``."""

    def __init__(self, paths: list[Path], labels: torch.Tensor, channels: int,
                 transform: Callable[[Any], torch.Tensor] | None, with_index: bool = False) -> None:
        self.paths, self.labels, self.transform, self.with_index = paths, labels, transform, with_index
        self.mode = "RGB" if channels == 3 else "L"

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        path = self.paths[index]
        image = decode_image(path, self.mode)
        if self.transform is not None:
            image = self.transform(image)
        label = int(self.labels[index])
        return (image, label, index) if self.with_index else (image, label)


def decode_image(path: Path, mode: str = "RGB") -> Image.Image:
    """Decode one image file in ``mode``; any failure is a :class:`DataError` naming the file."""
    try:
        with Image.open(path) as handle:
            return handle.convert(mode)
    except Exception as exc:  # OSError, UnidentifiedImageError, DecompressionBombError, SyntaxError, ValueError, ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise DataError(f"cannot read image {path}: {reason}. The file is corrupt or not an image: replace it "
                        "with a good copy or remove it from the dataset") from exc


def find_unreadable_images(split: ImageSplit) -> list[Path]:
    """Files of ``split`` that fail to decode (empty for in-memory splits); reads every image once."""
    bad = []
    for path in split.paths or []:
        try:
            with Image.open(path) as handle:
                handle.load()
        except Exception:
            bad.append(path)
    return bad


class TensorImageDataset(Dataset):
    """In-memory images ``[n, C, H, W]``; uint8 are scaled to float in [0, 1] before ``transform``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None, with_index: bool = False) -> None:
        self.images, self.labels, self.transform, self.with_index = images, labels, transform, with_index

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int):
        image = self.images[index]
        image = image.float().div_(255.0) if image.dtype == torch.uint8 else image.float()
        if self.transform is not None:
            image = self.transform(image)
        label = int(self.labels[index])
        return (image, label, index) if self.with_index else (image, label)


# ------------------------------------------------------------------------------------------ file helpers
def require_root(root: str | Path | None, dataset: str, expected: str) -> Path:
    """The dataset root as a Path, or a DataError saying what the folder must contain."""
    if root is None or str(root).strip() in ("", "None", "null"):
        raise DataError(f"{dataset}: no data root given; pass data.root=PATH, the folder that holds {expected}")
    path = Path(root).expanduser()
    if not path.is_dir():
        raise DataError(f"{dataset}: data root {path} does not exist or is not a folder; "
                        f"point data.root at the folder that holds {expected}")
    return path


def require_dir(path: Path, dataset: str, what: str) -> Path:
    if not path.is_dir():
        raise DataError(f"{dataset}: expected {what} at {path}, but it is missing; check data.root "
                        f"(now {path.parent if what else path})")
    return path


def require_file(path: Path, dataset: str, what: str) -> Path:
    if not path.is_file():
        raise DataError(f"{dataset}: expected {what} at {path}, but it is missing; check data.root")
    return path


def list_images(folder: Path) -> list[Path]:
    """Image files of one folder, sorted by name (hidden files skipped)."""
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES)


def split_from_class_folders(dataset: str, split: str, class_dirs: list[Path], channels: int = 3,
                             names: list[str] | None = None) -> ImageSplit:
    """An ImageSplit from one folder per class (label = position in ``class_dirs``); empty classes are errors."""
    paths: list[Path] = []
    labels: list[int] = []
    for label, folder in enumerate(class_dirs):
        files = list_images(folder)
        if not files:
            raise DataError(f"{dataset}: class folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}); "
                            "remove it or restore its images")
        paths.extend(files)
        labels.extend([label] * len(files))
    return ImageSplit(dataset, split, torch.tensor(labels, dtype=torch.long),
                      names or [d.name for d in class_dirs], channels, paths=paths)


def subfolders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
