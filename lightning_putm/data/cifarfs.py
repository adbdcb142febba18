"""CIFAR-FS (Bertinetto et al., ICLR 2019): CIFAR-100 classes split 64 / 16 / 20, 600 images of 32×32 each.

Layout of the authors' release: ``root/data/<class name>/<image>.png`` and the split lists
``root/splits/bertinetto/{train,val,test}.txt`` (one class name per line). The lists are read, not built in.

Download (``data.download=true``): :func:`prepare_cifarfs` builds that layout from the official CIFAR-100 python
archive (Krizhevsky 2009; the file torchvision's ``CIFAR100`` downloads, same md5): each of its 60,000 images
(train and test sets together, 600 per class, as in the authors' release) is written losslessly as a PNG into
its class folder, and the three split lists shipped in this package (``lightning_putm/data/splits/cifarfs/``,
the Bertinetto lists in their order) are copied to ``splits/bertinetto/``.

Pickles. CIFAR-100's archive stores its images as Python pickles, and unpickling runs code chosen by the file's
author. They are read only from a file whose md5 is the official one (the archive, or each of ``train``, ``test``,
``meta`` in an unpacked ``cifar-100-python/`` folder): the checksum pins the content the CIFAR authors published.
A local file with another md5 is refused unless ``data.options.allow_pickle=true``. Either way the unpickler
admits only the globals a numpy array needs (and ``codecs.encode``, for bytes), so a file that tries anything
else is refused.
"""

from __future__ import annotations

import codecs
import io
import pickle
import tarfile
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lightning_putm.data.download import Resource, fetch, md5_of, md5_of_bytes, move_into_place, staging_folder
from lightning_putm.data.imagesplit import ImageSplit, require_dir, require_file, require_root, split_from_class_folders
from lightning_putm.errors import ConfigError, DataError

EXPECTED = "data/<class>/<image>.png and splits/bertinetto/{train,val,test}.txt"
SPLITS = ("train", "val", "test")
#: The official CIFAR-100 python archive and the md5s torchvision pins for it and for its three pickles.
CIFAR100 = Resource("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "cifar-100-python.tar.gz",
                    "eb9058c3a382ffc7106e4002c42a8d85")
CIFAR100_FOLDER = "cifar-100-python"
CIFAR100_MEMBER_MD5 = {"meta": "7973b15100ade9c7d40fb424638fde48", "train": "16019d7e3df5f24257cddd939b257f8d",
                       "test": "f0ef6b0ae62326f3e7ffdfab6717acfc"}
IMAGE_SIDE = 32


def read_cifarfs(root: str | Path | None, split: str) -> ImageSplit:
    base = require_root(root, "cifarfs", EXPECTED)
    data = require_dir(base / "data", "cifarfs", "the data/ folder (one sub-folder per CIFAR-100 class)")
    split_file = require_file(base / "splits" / "bertinetto" / f"{split}.txt", "cifarfs",
                              f"the Bertinetto split list splits/bertinetto/{split}.txt")
    names = [line.strip() for line in split_file.read_text().splitlines() if line.strip()]
    if not names:
        raise DataError(f"cifarfs: {split_file} lists no classes")
    if len(set(names)) != len(names):
        raise DataError(f"cifarfs: {split_file} lists a class twice")
    missing = [n for n in names if not (data / n).is_dir()]
    if missing:
        raise DataError(f"cifarfs: class folder(s) {', '.join(missing[:5])} listed in {split_file.name} are missing "
                        f"from {data}")
    return split_from_class_folders("cifarfs", split, [data / n for n in names])


# ------------------------------------------------------------------------------------------- split lists
def bertinetto_classes(split: str) -> list[str]:
    """The CIFAR-100 class names of ``split`` in the Bertinetto et al. (2019) CIFAR-FS split, as shipped here."""
    text = resources.files("lightning_putm.data").joinpath("splits", "cifarfs", f"{split}.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def cifarfs_present(root: Path) -> bool:
    """Whether ``root`` holds the layout's image folder (the reader checks the rest)."""
    return (root / "data").is_dir()


# ------------------------------------------------------------------------------------------- pickles
def _array_globals() -> dict[tuple[str, str], Any]:
    reconstruct = np.zeros(1).__reduce__()[0]  # numpy's array rebuilder, wherever this numpy version keeps it
    return {("numpy.core.multiarray", "_reconstruct"): reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): reconstruct,
            ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
            ("_codecs", "encode"): codecs.encode}  # how protocol-2 pickles written by Python 3 store bytes


class ArrayOnlyUnpickler(pickle.Unpickler):
    """Builds dicts, lists, strings, numbers and numpy arrays; any other global (code) is refused."""

    allowed = _array_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a CIFAR-100 file never needs")


def load_cifar_pickle(data: bytes, source: str) -> dict[str, Any]:
    """One CIFAR-100 pickle (``meta``, ``train`` or ``test``) as a dict with str keys."""
    try:
        loaded = ArrayOnlyUnpickler(io.BytesIO(data), encoding="latin1").load()  # the files were written by Python 2
    except Exception as exc:
        raise DataError(f"cifarfs: refusing to read {source}: {' '.join(str(exc).split())}") from exc
    if not isinstance(loaded, dict):
        raise DataError(f"cifarfs: {source} is not a CIFAR-100 pickle (a dict)")
    return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in loaded.items()}


def untrusted(source: str | Path, got: str, official: str) -> DataError:
    return DataError(f"cifarfs: {source} has md5 {got}, not the official CIFAR-100 {official}; it holds pickles, "
                     "read only from the official file: delete it (data.download=true then downloads the official "
                     "archive) or, if you trust it, set data.options.allow_pickle=true")


def check_member(data: bytes, name: str, source: str, allow_pickle: bool) -> None:
    got = md5_of_bytes(data)
    if got != CIFAR100_MEMBER_MD5[name] and not allow_pickle:
        raise untrusted(source, got, CIFAR100_MEMBER_MD5[name])


def read_archive_members(archive: Path, check: bool, allow_pickle: bool) -> dict[str, bytes]:
    """``meta``, ``train``, ``test`` read from the ``.tar.gz`` into memory (nothing is unpacked to disk)."""
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for name in CIFAR100_MEMBER_MD5:
                try:
                    info = tar.getmember(f"{CIFAR100_FOLDER}/{name}")
                except KeyError:
                    raise DataError(f"cifarfs: {archive} has no {CIFAR100_FOLDER}/{name}; it is not the CIFAR-100 "
                                    "python archive") from None
                handle = tar.extractfile(info) if info.isfile() else None
                if handle is None:
                    raise DataError(f"cifarfs: {CIFAR100_FOLDER}/{name} in {archive} is not a regular file")
                members[name] = handle.read()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(f"cifarfs: cannot read the archive {archive} ({exc}); delete it and download it again") from exc
    if check:
        for name, data in members.items():
            check_member(data, name, f"{CIFAR100_FOLDER}/{name} in {archive}", allow_pickle)
    return members


def read_folder_members(folder: Path, allow_pickle: bool) -> dict[str, bytes]:
    members = {}
    for name in CIFAR100_MEMBER_MD5:
        path = require_file(folder / name, "cifarfs", f"the CIFAR-100 pickle {CIFAR100_FOLDER}/{name}")
        members[name] = path.read_bytes()
        check_member(members[name], name, str(path), allow_pickle)
    return members


# ------------------------------------------------------------------------------------------- building the layout
def write_layout(members: dict[str, bytes], out: Path) -> None:
    """``out/data/<class>/<file>.png`` for every image of CIFAR-100 (train + test) and ``out/splits/bertinetto``."""
    meta = load_cifar_pickle(members["meta"], f"{CIFAR100_FOLDER}/meta")
    names = [str(n) for n in meta.get("fine_label_names", [])]
    wanted = {s: bertinetto_classes(s) for s in SPLITS}
    unknown = sorted({c for classes in wanted.values() for c in classes} - set(names))
    if len(names) != 100 or unknown:
        raise DataError(f"cifarfs: {CIFAR100_FOLDER}/meta does not list the 100 CIFAR-100 fine classes"
                        + (f" (missing {', '.join(unknown[:5])})" if unknown else ""))
    for name in names:
        (out / "data" / name).mkdir(parents=True, exist_ok=True)
    used: set[tuple[str, str]] = set()
    for part in ("train", "test"):
        table = load_cifar_pickle(members[part], f"{CIFAR100_FOLDER}/{part}")
        pixels = np.asarray(table.get("data"))
        labels, files = list(table.get("fine_labels", [])), list(table.get("filenames", []))
        if pixels.ndim != 2 or pixels.shape[1] != 3 * IMAGE_SIDE * IMAGE_SIDE or pixels.dtype != np.uint8 \
                or not len(labels) == len(files) == len(pixels):
            raise DataError(f"cifarfs: {CIFAR100_FOLDER}/{part} does not hold CIFAR-100 images (data [n, 3072] "
                            "uint8 with as many fine_labels and filenames)")
        # rows are 1024 red, 1024 green, 1024 blue values, each a 32×32 image in row-major order
        images = pixels.reshape(-1, 3, IMAGE_SIDE, IMAGE_SIDE).transpose(0, 2, 3, 1)
        for image, label, file in zip(images, labels, files):
            if not 0 <= int(label) < len(names):
                raise DataError(f"cifarfs: {CIFAR100_FOLDER}/{part} has fine label {label}, outside 0..99")
            cls = names[int(label)]
            stem = Path(str(file)).stem or "image"
            if (cls, stem) in used:  # keep every image even if two share a file name
                stem = f"{part}_{stem}"
            used.add((cls, stem))
            Image.fromarray(np.ascontiguousarray(image), "RGB").save(out / "data" / cls / f"{stem}.png")
    lists = out / "splits" / "bertinetto"
    lists.mkdir(parents=True)
    for split, classes in wanted.items():
        (lists / f"{split}.txt").write_text("\n".join(classes) + "\n")


def prepare_cifarfs(root: str | Path, allow_pickle: bool = False) -> None:
    """Build CIFAR-FS under ``root`` from CIFAR-100 (``data.download=true``); no-op when ``root/data/`` exists.

    Source, first found: ``root/cifar-100-python.tar.gz``, ``root/cifar-100-python/`` (both checked against the
    official md5s), else a download of the official archive, which is kept as ``root/cifar-100-python.tar.gz``.
    """
    if not isinstance(allow_pickle, bool):
        raise ConfigError(f"data.options.allow_pickle must be true or false, got {allow_pickle!r}")
    root = Path(root).expanduser()
    if cifarfs_present(root) and (root / "splits" / "bertinetto").is_dir():
        return
    archive, folder = root / CIFAR100.filename, root / CIFAR100_FOLDER
    archive_md5 = md5_of(archive) if not cifarfs_present(root) and archive.is_file() else None
    if archive_md5 is not None:  # refuse an unknown local archive before any side effect
        if archive_md5 != CIFAR100.md5 and not allow_pickle:
            raise untrusted(archive, archive_md5, CIFAR100.md5)
    with staging_folder(root) as stage:
        out = stage / "layout"
        if cifarfs_present(root):  # images in place (e.g. the authors' release): only the split lists are missing
            (out / "splits" / "bertinetto").mkdir(parents=True)
            for split in SPLITS:
                (out / "splits" / "bertinetto" / f"{split}.txt").write_text("\n".join(bertinetto_classes(split)) + "\n")
        else:
            if archive_md5 is not None:
                members = read_archive_members(archive, check=archive_md5 != CIFAR100.md5, allow_pickle=allow_pickle)
            elif folder.is_dir():
                members = read_folder_members(folder, allow_pickle)
            else:
                downloaded = fetch(CIFAR100, stage, "cifarfs", root,
                                   f"{CIFAR100.filename} (or the {EXPECTED} layout)")
                members = read_archive_members(downloaded, check=False, allow_pickle=False)  # md5 verified by fetch
                move_into_place(downloaded, archive)  # kept: rebuilding the layout needs no second download
            write_layout(members, out)
            move_into_place(out / "data", root / "data")
        move_into_place(out / "splits" / "bertinetto", root / "splits" / "bertinetto")
