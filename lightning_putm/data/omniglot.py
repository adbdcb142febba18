"""Omniglot (Lake et al., Science 2015) with the split of Vinyals et al. (NeurIPS 2016) used by ProtoNets.

Layout (as released, and as torchvision expects): ``root/omniglot-py/images_background/<alphabet>/<characterNN>/*.png``
and ``root/omniglot-py/images_evaluation/...``. The split lists ``root/splits/<scheme>/{train,val,test}.txt``
(one ``images_<set>/<alphabet>/<characterNN>`` per line) are used when present. Without them, ``vinyals`` is
rebuilt from its rule: 1200 training characters = all of images_background, the evaluation alphabets
below, and Gurmukhi character01–41; the other 423 evaluation characters are the test split; no validation split.
``vinyals_protonets`` (the default in conf/data/omniglot.yaml) holds ProtoNets' five validation alphabets (172
characters) out of those 1200 as the validation split, so the best checkpoint is chosen on held-out classes.

Protocol (Vinyals et al.; Snell et al.): each character in each of the rotations 0/90/180/270° is its own
class (1200 × 4 = 4800 training classes, 423 × 4 = 1692 test classes) and images are resized to 28×28.
Images are decoded once into memory (uint8, ink = 255 on 0 background, as ProtoNets feed 1 − pixel); a rotation
is applied to the resized image, which for a square image and a symmetric filter equals resizing the rotated one.

Download (``data.download=true``): :func:`prepare_omniglot` fetches the two official zips of Lake et al.
(``brendenlake/omniglot``, the files torchvision's ``Omniglot`` downloads, with the same md5s) and unpacks each into
``root/omniglot-py/images_<set>/``; a set already in place is not downloaded again.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lightning_putm.data.download import Resource, fetch, move_into_place, staging_folder
from lightning_putm.data.imagesplit import ImageSplit, list_images, require_dir, require_root, subfolders
from lightning_putm.errors import DataError

EXPECTED = "omniglot-py/images_background/ and omniglot-py/images_evaluation/ (the folder torchvision calls root)"
SETS = ("images_background", "images_evaluation")
VINYALS_TRAIN_EVALUATION_ALPHABETS = ("Angelic", "Atemayar_Qelisayer", "Atlantean", "Aurek-Besh", "Avesta",
                                      "Ge_ez", "Glagolitic")
VINYALS_GURMUKHI_TRAIN = 41  # Gurmukhi character01..41 are training characters, 42..45 test
#: The validation alphabets Snell et al. (ProtoNets, 2017) hold out of the Vinyals training characters (172 of 1200).
PROTONETS_VAL_ALPHABETS = ("Armenian", "Bengali", "Early_Aramaic", "Hebrew", "Mkhedruli_(Georgian)")
REBUILDABLE_SCHEMES = ("vinyals", "vinyals_protonets")
#: The official zips (Lake et al. 2015), as torchvision.datasets.Omniglot fetches them; md5s pin their content.
DOWNLOAD_URL_PREFIX = "https://raw.githubusercontent.com/brendenlake/omniglot/master/python"
RESOURCES = {
    "images_background": Resource(f"{DOWNLOAD_URL_PREFIX}/images_background.zip", "images_background.zip",
                                  "68d2efa1b9178cc56df9314c21c6e718"),
    "images_evaluation": Resource(f"{DOWNLOAD_URL_PREFIX}/images_evaluation.zip", "images_evaluation.zip",
                                  "6b91aef0f799c5bb55b94e3f2daec811"),
}


def omniglot_present(root: Path) -> bool:
    """Whether ``root`` holds the Omniglot layout's top folder (the reader checks the rest)."""
    return (root / "omniglot-py").is_dir()


def prepare_omniglot(root: str | Path) -> None:
    """Download and unpack each set missing from ``root/omniglot-py/`` (``data.download=true``)."""
    root = Path(root).expanduser()
    for set_name, resource in RESOURCES.items():
        target = root / "omniglot-py" / set_name
        if target.is_dir():
            continue
        with staging_folder(root) as folder:
            by_hand = f"the unpacked {resource.filename} as omniglot-py/{set_name}/<alphabet>/<characterNN>/*.png"
            archive = fetch(resource, folder, "omniglot", root, by_hand)
            unpacked = folder / "unpacked"
            try:
                with zipfile.ZipFile(archive) as handle:
                    handle.extractall(unpacked)  # zipfile drops absolute and ".." path parts
            except (zipfile.BadZipFile, OSError) as exc:
                raise DataError(f"omniglot: cannot unpack {resource.filename} ({exc}); run again to download it "
                                "again") from exc
            if not (unpacked / set_name).is_dir():
                raise DataError(f"omniglot: {resource.filename} holds no {set_name}/ folder; nothing was kept")
            move_into_place(unpacked / set_name, target)


def vinyals_split_of(character: str) -> str:
    """``images_<set>/<alphabet>/<characterNN>`` → ``train`` or ``test`` by the Vinyals rule."""
    set_name, alphabet, char = character.split("/")
    if set_name == "images_background" or alphabet in VINYALS_TRAIN_EVALUATION_ALPHABETS:
        return "train"
    if alphabet == "Gurmukhi" and int(char.removeprefix("character")) <= VINYALS_GURMUKHI_TRAIN:
        return "train"
    return "test"


def omniglot_characters(base: Path) -> list[str]:
    """Every character folder as ``images_<set>/<alphabet>/<characterNN>``, sorted."""
    characters = []
    for set_name in SETS:
        folder = require_dir(base / "omniglot-py" / set_name, "omniglot", f"the {set_name}/ folder")
        for alphabet in subfolders(folder):
            characters.extend(f"{set_name}/{alphabet.name}/{c.name}" for c in subfolders(alphabet))
    return sorted(characters)


def split_characters(base: Path, split: str, scheme: str) -> list[str]:
    """Characters of ``split`` from ``root/splits/<scheme>/<split>.txt``, or by the Vinyals rule."""
    split_file = base / "splits" / scheme / f"{split}.txt"
    if split_file.is_file():
        return [line.strip() for line in split_file.read_text().splitlines() if line.strip()]
    if scheme not in REBUILDABLE_SCHEMES:
        raise DataError(f"omniglot: split file {split_file} is missing; the {scheme!r} split is read from "
                        "root/splits/<scheme>/{train,val,test}.txt (only vinyals and vinyals_protonets can be rebuilt "
                        "without it)")
    characters = omniglot_characters(base)
    if scheme == "vinyals":  # the 1200 training characters, no validation split
        return [] if split == "val" else [c for c in characters if vinyals_split_of(c) == split]
    held_out = [c for c in characters if vinyals_split_of(c) == "train" and c.split("/")[1] in PROTONETS_VAL_ALPHABETS]
    if split == "val":
        return held_out
    return [c for c in characters if vinyals_split_of(c) == split and c not in set(held_out)]


def load_character(folder: Path, image_size: int) -> np.ndarray:
    """All drawings of one character as uint8 ``[n, size, size]`` with ink = 255."""
    files = list_images(folder)
    if not files:
        raise DataError(f"omniglot: character folder {folder} holds no PNG images")
    out = np.empty((len(files), image_size, image_size), dtype=np.uint8)
    for i, path in enumerate(files):
        try:
            with Image.open(path) as handle:
                gray = handle.convert("L").resize((image_size, image_size), Image.Resampling.LANCZOS)
        except OSError as exc:
            raise DataError(f"omniglot: cannot read {path}: {exc}") from exc
        out[i] = 255 - np.asarray(gray, dtype=np.uint8)
    return out


def read_omniglot(root: str | Path | None, split: str, scheme: str = "vinyals",
                  rotations: list[int] | tuple[int, ...] = (0, 90, 180, 270), image_size: int = 28) -> ImageSplit:
    base = require_root(root, "omniglot", EXPECTED)
    require_dir(base / "omniglot-py", "omniglot", "the omniglot-py/ folder")
    rotations = [int(r) for r in rotations]
    if not rotations or any(r % 90 for r in rotations) or len(set(rotations)) != len(rotations):
        raise DataError(f"omniglot: rotations must be distinct multiples of 90, got {rotations}")
    characters = split_characters(base, split, scheme)
    blocks: list[torch.Tensor] = []
    labels: list[int] = []
    names: list[str] = []
    for character in characters:
        folder = base / "omniglot-py" / character
        if not folder.is_dir():
            raise DataError(f"omniglot: character folder {folder} (listed in the {scheme} {split} split) is missing")
        images = torch.from_numpy(load_character(folder, image_size)).unsqueeze(1)  # [n, 1, s, s]
        for degrees in rotations:
            blocks.append(torch.rot90(images, degrees // 90, dims=(-2, -1)))
            labels.extend([len(names)] * len(images))
            names.append(f"{character}/rot{degrees:03d}")
    data = torch.cat(blocks) if blocks else torch.empty((0, 1, image_size, image_size), dtype=torch.uint8)
    return ImageSplit("omniglot", split, torch.tensor(labels, dtype=torch.long), names, 1, images=data.contiguous(),
                      metadata={"characters": len(characters), "rotations": rotations, "scheme": scheme})
