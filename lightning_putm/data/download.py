"""Downloads of the public datasets (``data.download=true``): fetch, check the md5, move into place atomically.

Why this shape: a dataset folder is either complete or absent. Each archive is downloaded with torchvision's
downloader (it shows a progress bar) into a temporary folder *inside* ``data.root`` (same file system, so the
final move is a rename), its md5 is compared with the pinned checksum of the official file, and only then is it
unpacked and renamed into place. An interrupted or corrupt download leaves nothing behind but the temporary folder,
which is removed. A second call finds the dataset in place and does not touch the network.

torchvision is imported on first use only: feature-only users of :mod:`lightning_putm.data` never pay for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import shutil
import tempfile
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from lightning_putm.errors import DataError

#: Prefix of the temporary folders made inside ``data.root`` while a download is under way.
TEMP_PREFIX = ".lightning_putm-download-"


@dataclass(frozen=True)
class Resource:
    """One official archive: where it is, the name it is saved under, and the md5 that pins its content."""

    url: str
    filename: str
    md5: str


def md5_of(path: Path, chunk: int = 1 << 20) -> str:
    """Hex md5 of a file (a checksum against corruption and substitution, not a password hash)."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def md5_of_bytes(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


@contextlib.contextmanager
def staging_folder(root: Path) -> Iterator[Path]:
    """A fresh temporary folder inside ``root`` (created if needed), removed on exit whatever happens; ``root``
    itself is removed again if this call created it and it is still empty."""
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if created:  # a failed first download leaves no empty data.root behind
            with contextlib.suppress(OSError):
                root.rmdir()  # only succeeds when empty


def fetch(resource: Resource, folder: Path, dataset: str, root: Path, by_hand: str) -> Path:
    """Download ``resource`` into ``folder`` and check its md5; any failure is one :class:`DataError` line.

    ``by_hand`` says what to place in ``data.root`` instead when there is no network.
    """
    from torchvision.datasets.utils import download_url  # progress bar, redirects

    target = folder / resource.filename
    host = urlparse(resource.url).hostname or resource.url
    by_hand_hint = f"download it by hand and place {by_hand} in data.root ({root})"
    try:
        download_url(resource.url, str(folder), filename=resource.filename, md5=None)
    except urllib.error.HTTPError as exc:  # the server answered, but not with the file
        raise DataError(f"{dataset}: cannot download {resource.url}: {host} answered HTTP {exc.code} {exc.reason}; "
                        f"{by_hand_hint}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
        reason = " ".join(str(getattr(exc, "reason", exc)).split()) or type(exc).__name__
        raise DataError(f"{dataset}: cannot download {resource.url}: {host} is unreachable ({reason}); without "
                        f"network, {by_hand_hint}") from exc
    except OSError as exc:  # e.g. disk full, no permission to write into data.root
        raise DataError(f"{dataset}: cannot save {resource.filename} into {root}: {exc}") from exc
    got = md5_of(target)
    if got != resource.md5:
        target.unlink(missing_ok=True)
        raise DataError(f"{dataset}: the download of {resource.filename} from {resource.url} is corrupt: md5 {got}, "
                        f"expected {resource.md5}; nothing was kept, run again (data.download=true) to retry")
    return target


def move_into_place(source: Path, target: Path) -> bool:
    """Rename ``source`` to ``target`` unless ``target`` exists (another process finished first); True if moved."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        return False
    try:
        os.rename(source, target)
    except OSError:
        if target.exists():  # lost a race with a concurrent download of the same data: keep theirs
            return False
        raise
    return True
