"""``data.download=true`` for Omniglot and CIFAR-FS, with no network: real archive files built here and served
from a local HTTP server on 127.0.0.1, the download tables pointed at it.

The archives have the official formats: Omniglot zips holding ``images_<set>/<alphabet>/<characterNN>/*.png``;
the CIFAR-100 python ``.tar.gz`` holding the ``meta``/``train``/``test`` pickled dicts (a uint8 ``data`` array
of 3072-value rows, ``fine_labels``, ``filenames``; ``fine_label_names`` in ``meta``).
"""

from __future__ import annotations

import hashlib
import http.server
import io
import pickle
import socket
import tarfile
import threading
import zipfile
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from PIL import Image

from conftest import omniglot_skip_reason, real_omniglot_root
from lightning_putm.data import cifarfs, omniglot, read_split
from lightning_putm.data.download import TEMP_PREFIX, Resource
from lightning_putm.errors import ConfigError, DataError

REAL_OMNIGLOT = real_omniglot_root()

#: The 100 CIFAR-100 fine classes in label order (alphabetical, as in the official meta file).
CIFAR100_CLASSES = """apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus butterfly
camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch crab crocodile cup dinosaur dolphin
elephant flatfish forest fox girl hamster house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster man
maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain
plate poppy porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper snail snake
spider squirrel streetcar sunflower sweet_pepper table tank telephone television tiger tractor train trout tulip
turtle wardrobe whale willow_tree wolf woman worm""".split()


# ------------------------------------------------------------------------------------------- local server
class Server:
    """Files of one folder over HTTP on 127.0.0.1, counting the GET requests per path."""

    def __init__(self, folder: Path) -> None:
        hits: Counter[str] = Counter()
        self.hits = hits

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(folder), **kwargs)

            def do_GET(self):  # noqa: N802 (http.server's name)
                hits[self.path] += 1
                super().do_GET()

            def log_message(self, *args):  # keep the test output clean
                pass

        class Quiet(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that hangs up early is no test failure
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.timeout = 5
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name}"

    def total(self) -> int:
        return sum(self.hits.values())

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, Server]]:
    folder = tmp_path / "served"
    folder.mkdir()
    server = Server(folder)
    try:
        yield folder, server
    finally:
        server.stop()


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def leftovers(root: Path) -> list[Path]:
    return list(root.glob(f"{TEMP_PREFIX}*")) if root.is_dir() else []


# ------------------------------------------------------------------------------------------- Omniglot
OMNI = {  # set -> characters; by the Vinyals rule Latin/Angelic are training characters, Kannada/Gurmukhi42 test
    "images_background": ["Latin/character01", "Latin/character02"],
    "images_evaluation": ["Angelic/character01", "Gurmukhi/character42", "Kannada/character01"],
}
OMNI_SIDE, OMNI_DRAWERS = 20, 2


def omni_png(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((OMNI_SIDE, OMNI_SIDE)) > 0.3  # True = paper, as in Omniglot


def make_omniglot_zips(folder: Path) -> dict[str, np.ndarray]:
    """The two official-style zips; returns each drawing's expected in-memory image (ink = 255)."""
    expected = {}
    seed = 0
    for set_name, characters in OMNI.items():
        with zipfile.ZipFile(folder / f"{set_name}.zip", "w") as archive:
            for character in characters:
                for drawer in range(1, OMNI_DRAWERS + 1):
                    seed += 1
                    pixels = omni_png(seed)
                    buffer = io.BytesIO()
                    Image.fromarray(pixels).convert("1").save(buffer, format="PNG")
                    archive.writestr(f"{set_name}/{character}/{seed:04d}_{drawer:02d}.png", buffer.getvalue())
                    expected[f"{set_name}/{character}/{drawer}"] = np.where(pixels, 0, 255).astype(np.uint8)
    return expected


def point_omniglot_at(monkeypatch: pytest.MonkeyPatch, folder: Path, server: Server, **md5s: str) -> None:
    table = {s: Resource(server.url(f"{s}.zip"), f"{s}.zip", md5s.get(s, md5(folder / f"{s}.zip")))
             for s in omniglot.RESOURCES}
    monkeypatch.setattr(omniglot, "RESOURCES", table)


def test_omniglot_download_reads_back_and_is_not_repeated(tmp_path: Path, served, monkeypatch) -> None:
    folder, server = served
    expected = make_omniglot_zips(folder)
    point_omniglot_at(monkeypatch, folder, server)
    root = tmp_path / "new" / "omniglot"  # does not exist yet: download=true creates it
    options = {"scheme": "vinyals", "image_size": OMNI_SIDE}
    train = read_split("omniglot", root, "train", download=True, **options)
    assert server.hits["/images_background.zip"] >= 1 and server.hits["/images_evaluation.zip"] >= 1
    assert (root / "omniglot-py" / "images_background" / "Latin" / "character02").is_dir()
    assert not leftovers(root) and not list(root.rglob("*.zip"))  # temporary folder and archives removed
    characters = ["images_background/Latin/character01", "images_background/Latin/character02",
                  "images_evaluation/Angelic/character01"]
    assert train.class_names == [f"{c}/rot{r:03d}" for c in characters for r in (0, 90, 180, 270)]
    # the pixels that arrive are the ones in the zip (no resampling at the native size)
    first = train.images[train.labels == train.class_names.index("images_background/Latin/character02/rot000")]
    np.testing.assert_array_equal(first[1, 0].numpy(), expected["images_background/Latin/character02/2"])

    hits = server.total()
    test = read_split("omniglot", root, "test", download=True, **options)
    assert server.total() == hits  # in place: no second download
    assert {n.rsplit("/", 1)[0] for n in test.class_names} == {"images_evaluation/Gurmukhi/character42",
                                                                "images_evaluation/Kannada/character01"}
    offline = read_split("omniglot", root, "test", **options)  # download=false reads the same folder
    assert offline.class_names == test.class_names


def test_omniglot_downloads_only_the_missing_set(tmp_path: Path, served, monkeypatch) -> None:
    folder, server = served
    make_omniglot_zips(folder)
    point_omniglot_at(monkeypatch, folder, server)
    root = tmp_path / "omniglot"
    (root / "omniglot-py" / "images_background" / "Latin" / "character01").mkdir(parents=True)
    read_split("omniglot", root, "test", download=True, scheme="vinyals")
    assert server.hits["/images_background.zip"] == 0 and server.hits["/images_evaluation.zip"] >= 1


def test_corrupt_download_is_refused_and_leaves_nothing(tmp_path: Path, served, monkeypatch) -> None:
    folder, server = served
    make_omniglot_zips(folder)
    wrong = "0" * 32
    point_omniglot_at(monkeypatch, folder, server, images_evaluation=wrong)
    root = tmp_path / "omniglot"
    with pytest.raises(DataError, match=rf"images_evaluation\.zip.*corrupt: md5 [0-9a-f]{{32}}, expected {wrong}"):
        read_split("omniglot", root, "train", download=True)
    assert (root / "omniglot-py" / "images_background" / "Latin").is_dir()  # the good set is kept
    assert not (root / "omniglot-py" / "images_evaluation").exists()
    assert not leftovers(root) and not list(root.rglob("*.zip"))


def test_download_without_network_is_one_clear_line(tmp_path: Path, monkeypatch) -> None:
    port = closed_port()
    table = {s: Resource(f"http://127.0.0.1:{port}/{s}.zip", f"{s}.zip", "0" * 32) for s in omniglot.RESOURCES}
    monkeypatch.setattr(omniglot, "RESOURCES", table)
    root = tmp_path / "omniglot"
    with pytest.raises(DataError) as caught:
        read_split("omniglot", root, "train", download=True)
    message = str(caught.value)
    assert "\n" not in message
    assert f"cannot download http://127.0.0.1:{port}/images_background.zip: 127.0.0.1 is unreachable" in message
    assert "by hand" in message and f"data.root ({root})" in message and "omniglot-py/images_background" in message
    assert not root.exists()  # the root it would have created is not left behind


def test_download_answered_with_an_http_error(tmp_path: Path, served, monkeypatch) -> None:
    folder, server = served  # the folder is empty: every file is a 404
    point_cifar_at(monkeypatch, server.url("cifar-100-python.tar.gz"), "0" * 32)
    with pytest.raises(DataError, match=r"cannot download http://127\.0\.0\.1:\d+/cifar-100-python\.tar\.gz: "
                                        r"127\.0\.0\.1 answered HTTP 404 .*by hand"):
        read_split("cifarfs", tmp_path / "cifar-fs", "train", download=True)
    assert not (tmp_path / "cifar-fs").exists()


def test_offline_missing_root_names_data_root_and_download(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for name in ("omniglot", "cifarfs"):
        with pytest.raises(DataError, match=rf"{name}: data root .*nowhere does not exist; point data\.root .*"
                                            r"data\.download=true"):
            read_split(name, missing, "train")
        with pytest.raises(DataError, match=r"no data root given; pass data\.root=PATH.*data\.download=true"):
            read_split(name, None, "train")
    assert not missing.exists()  # no side effect
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"does not hold the dataset.*omniglot-py.*data\.download=true"):
        read_split("omniglot", empty, "train")
    assert list(empty.iterdir()) == []


def test_download_option_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"miniimagenet cannot be downloaded \(downloadable: cifarfs, omniglot\)"):
        read_split("miniimagenet", tmp_path, "train", download=True)
    with pytest.raises(ConfigError, match="data.download=true needs data.root"):
        read_split("omniglot", None, "train", download=True)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(DataError, match=r"data\.root .*a_file is a file, not a folder"):
        read_split("cifarfs", tmp_path / "a_file", "train", download=True)
    with pytest.raises(ConfigError, match="data.download must be true or false, got 'yes'"):
        read_split("omniglot", tmp_path, "train", download="yes")
    with pytest.raises(ConfigError, match=r"no option\(s\) allow_pickles; its options: allow_pickle$"):
        read_split("cifarfs", tmp_path, "train", allow_pickles=True)


def test_download_tables_match_torchvision() -> None:
    """Our pins are torchvision's (the official files); a typo here would refuse every real download."""
    from torchvision.datasets import CIFAR100, Omniglot

    for set_name, resource in omniglot.RESOURCES.items():
        assert resource.md5 == Omniglot.zips_md5[set_name]
        assert resource.url == f"{Omniglot.download_url_prefix}/{set_name}.zip"
    assert (cifarfs.CIFAR100.url, cifarfs.CIFAR100.filename, cifarfs.CIFAR100.md5) == (
        CIFAR100.url, CIFAR100.filename, CIFAR100.tgz_md5)
    pins = {name: md5 for name, md5 in CIFAR100.train_list + CIFAR100.test_list}
    pins[CIFAR100.meta["filename"]] = CIFAR100.meta["md5"]
    assert cifarfs.CIFAR100_MEMBER_MD5 == pins


@pytest.mark.skipif(not (REAL_OMNIGLOT / "omniglot-py").is_dir(), reason=omniglot_skip_reason(REAL_OMNIGLOT))
def test_download_of_real_omniglot_pngs(tmp_path: Path, served, monkeypatch) -> None:
    folder, server = served
    chosen = {"images_background": ["Latin/character01"], "images_evaluation": ["Kannada/character01"]}
    sources = {}
    for set_name, characters in chosen.items():
        with zipfile.ZipFile(folder / f"{set_name}.zip", "w") as archive:
            for character in characters:
                for png in sorted((REAL_OMNIGLOT / "omniglot-py" / set_name / character).glob("*.png")):
                    archive.write(png, f"{set_name}/{character}/{png.name}")
                    sources.setdefault(f"{set_name}/{character}", []).append(png)
    point_omniglot_at(monkeypatch, folder, server)
    root = tmp_path / "omniglot"
    test = read_split("omniglot", root, "test", download=True, scheme="vinyals", rotations=[0], image_size=105)
    assert test.class_names == ["images_evaluation/Kannada/character01/rot000"] and len(test) == 20
    with Image.open(sources["images_evaluation/Kannada/character01"][0]) as first:
        np.testing.assert_array_equal(test.images[0, 0].numpy(), 255 - np.asarray(first.convert("L")))


# ------------------------------------------------------------------------------------------- CIFAR-FS
def test_shipped_bertinetto_lists() -> None:
    lists = {s: cifarfs.bertinetto_classes(s) for s in ("train", "val", "test")}
    assert [len(lists[s]) for s in ("train", "val", "test")] == [64, 16, 20]
    assert sorted(lists["train"] + lists["val"] + lists["test"]) == sorted(CIFAR100_CLASSES)  # 100 distinct
    assert lists["val"][:4] == ["otter", "motorcycle", "television", "lamp"]
    assert lists["test"][:4] == ["baby", "bed", "bicycle", "chimpanzee"]
    assert lists["train"][:3] == ["train", "skyscraper", "turtle"]


TRAIN_PER_CLASS, TEST_PER_CLASS = 2, 1


def cifar_table(part: str, per_class: int, seed: int) -> dict:
    labels = [c for c in range(100) for _ in range(per_class)]
    rng = np.random.default_rng(seed)
    return {"batch_label": f"{part} batch", "fine_labels": labels, "coarse_labels": [c // 5 for c in labels],
            "filenames": [f"{CIFAR100_CLASSES[c]}_s_{seed}{i:05d}.png" for i, c in enumerate(labels)],
            "data": rng.integers(0, 256, (len(labels), 3072), dtype=np.uint8)}


def make_cifar_archive(path: Path, meta: object | None = None) -> dict[str, dict]:
    """A CIFAR-100 python ``.tar.gz`` with the official member names and dict formats (protocol 2 pickles)."""
    tables = {"meta": {"fine_label_names": CIFAR100_CLASSES, "coarse_label_names": [f"c{i}" for i in range(20)]},
              "train": cifar_table("training", TRAIN_PER_CLASS, 1), "test": cifar_table("testing", TEST_PER_CLASS, 2)}
    with tarfile.open(path, "w:gz") as tar:
        for name, table in tables.items():
            data = pickle.dumps(meta if (name == "meta" and meta is not None) else table, protocol=2)
            info = tarfile.TarInfo(f"cifar-100-python/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return tables


def point_cifar_at(monkeypatch: pytest.MonkeyPatch, url: str, md5sum: str) -> None:
    monkeypatch.setattr(cifarfs, "CIFAR100", Resource(url, "cifar-100-python.tar.gz", md5sum))


def test_cifarfs_download_builds_the_layout_and_reads_back(tmp_path: Path, served, monkeypatch) -> None:
    folder, server = served
    tables = make_cifar_archive(folder / "cifar-100-python.tar.gz")
    point_cifar_at(monkeypatch, server.url("cifar-100-python.tar.gz"), md5(folder / "cifar-100-python.tar.gz"))
    root = tmp_path / "cifar-fs"
    splits = {s: read_split("cifarfs", root, s, download=True) for s in ("train", "val", "test")}
    assert server.hits["/cifar-100-python.tar.gz"] >= 1
    for split, data in splits.items():
        assert data.class_names == cifarfs.bertinetto_classes(split)
        assert (data.class_sizes() == TRAIN_PER_CLASS + TEST_PER_CLASS).all()  # train + test images of each class
    assert (root / "splits" / "bertinetto" / "val.txt").read_text().split() == cifarfs.bertinetto_classes("val")
    assert (root / "cifar-100-python.tar.gz").is_file() and not leftovers(root)
    # one image, pixel for pixel: row = 1024 red, 1024 green, 1024 blue values of a row-major 32x32 image
    row = 5  # train row 5 is class 2 (baby), file baby_s_100005.png
    with Image.open(root / "data" / "baby" / "baby_s_100005.png") as image:
        pixels = np.asarray(image.convert("RGB"))
    np.testing.assert_array_equal(pixels, tables["train"]["data"][row].reshape(3, 32, 32).transpose(1, 2, 0))

    hits = server.total()
    again = read_split("cifarfs", root, "test", download=True)
    assert server.total() == hits and again.class_names == splits["test"].class_names
    offline = read_split("cifarfs", root, "train")
    assert len(offline) == len(splits["train"])


def test_cifarfs_corrupt_download_is_refused(tmp_path: Path, served, monkeypatch) -> None:
    folder, server = served
    make_cifar_archive(folder / "cifar-100-python.tar.gz")
    point_cifar_at(monkeypatch, server.url("cifar-100-python.tar.gz"), "f" * 32)
    root = tmp_path / "cifar-fs"
    with pytest.raises(DataError, match=r"cifar-100-python\.tar\.gz .*corrupt: md5 [0-9a-f]{32}, expected f{32}"):
        read_split("cifarfs", root, "train", download=True)
    assert not root.exists()  # no archive, no data/, no temporary folder, not even the folder it made


def test_cifarfs_local_archive_needs_the_official_md5_or_allow_pickle(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "cifar-fs"
    root.mkdir()
    archive = root / "cifar-100-python.tar.gz"
    make_cifar_archive(archive)
    point_cifar_at(monkeypatch, f"http://127.0.0.1:{closed_port()}/never.tar.gz", "0" * 32)  # not the local file's md5
    with pytest.raises(DataError, match=rf"{archive} has md5 {md5(archive)}, not the official .*allow_pickle=true"):
        read_split("cifarfs", root, "train", download=True)
    assert sorted(p.name for p in root.iterdir()) == ["cifar-100-python.tar.gz"]  # refused before any side effect
    with pytest.raises(ConfigError, match="allow_pickle must be true or false, got 'yes'"):
        read_split("cifarfs", root, "train", download=True, allow_pickle="yes")
    train = read_split("cifarfs", root, "train", download=True, allow_pickle=True)  # the user vouches for it
    assert train.class_names == cifarfs.bertinetto_classes("train")


def test_cifarfs_trusted_local_archive_and_unpacked_folder(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "cifar-100-python.tar.gz"
    make_cifar_archive(source)
    point_cifar_at(monkeypatch, f"http://127.0.0.1:{closed_port()}/never.tar.gz", md5(source))  # "official" = ours
    root = tmp_path / "from-archive"
    root.mkdir()
    (root / source.name).write_bytes(source.read_bytes())
    assert read_split("cifarfs", root, "val", download=True).num_classes == 16  # no network used: it is local
    # an unpacked cifar-100-python/ folder: each pickle is checked against its own official md5
    unpacked = tmp_path / "from-folder"
    with tarfile.open(source) as tar:
        tar.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    members = {p.name: md5(p) for p in (unpacked / "cifar-100-python").iterdir()}
    monkeypatch.setattr(cifarfs, "CIFAR100_MEMBER_MD5", {**members, "train": "1" * 32})
    with pytest.raises(DataError, match=r"cifar-100-python/train has md5 [0-9a-f]{32}, not the official CIFAR-100"):
        read_split("cifarfs", unpacked, "val", download=True)
    assert not (unpacked / "data").exists()
    monkeypatch.setattr(cifarfs, "CIFAR100_MEMBER_MD5", members)
    assert read_split("cifarfs", unpacked, "test", download=True).num_classes == 20


class Payload:
    """Unpickling this calls a function chosen by the file's author."""

    def __reduce__(self):
        return (print, ("pwned",))


def test_cifarfs_pickle_with_code_is_refused_even_when_allowed(tmp_path: Path, monkeypatch, capsys) -> None:
    root = tmp_path / "cifar-fs"
    root.mkdir()
    make_cifar_archive(root / "cifar-100-python.tar.gz", meta={"fine_label_names": Payload()})
    point_cifar_at(monkeypatch, "http://127.0.0.1:1/never.tar.gz", "0" * 32)
    refused = r"refusing to read cifar-100-python/meta: it refers to (__builtin__|builtins)\.print"
    with pytest.raises(DataError, match=refused):
        read_split("cifarfs", root, "train", download=True, allow_pickle=True)
    assert "pwned" not in capsys.readouterr().out and not (root / "data").exists()


def test_cifarfs_images_in_place_get_the_shipped_lists(tmp_path: Path) -> None:
    root = tmp_path / "cifar-fs"
    for name in CIFAR100_CLASSES:
        (root / "data" / name).mkdir(parents=True)
        Image.new("RGB", (32, 32)).save(root / "data" / name / "0.png")
    with pytest.raises(DataError, match=r"splits/bertinetto/train\.txt"):
        read_split("cifarfs", root, "train")  # offline: nothing is written
    assert read_split("cifarfs", root, "train", download=True).class_names == cifarfs.bertinetto_classes("train")


# ------------------------------------------------------------------------------------------- DataModule
def _datamodule_takes_download() -> bool:
    import inspect

    from lightning_putm.data import FewShotDataModule

    return "download" in inspect.signature(FewShotDataModule.__init__).parameters


@pytest.mark.skipif(not _datamodule_takes_download(), reason="data.download is not passed to FewShotDataModule yet")
def test_datamodule_downloads_in_prepare_data(tmp_path: Path, served, monkeypatch) -> None:
    from lightning_putm.data import EpisodeSettings, FewShotDataModule

    folder, server = served
    make_omniglot_zips(folder)
    point_omniglot_at(monkeypatch, folder, server)
    root = tmp_path / "omniglot"
    with pytest.raises(ConfigError, match="data.download must be true or false"):
        FewShotDataModule("omniglot", root=root, download="maybe")
    settings = EpisodeSettings(ways=2, shots=1, queries=2, tasks=2)
    dm = FewShotDataModule("omniglot", root=root, image_size=28, options={"scheme": "vinyals"}, download=True,
                           val_episodes=settings, test_episodes=settings)
    assert not root.exists()  # nothing happens before Lightning's prepare_data
    dm.prepare_data()
    assert (root / "omniglot-py" / "images_evaluation" / "Kannada").is_dir()
    hits = server.total()
    dm.setup("test")
    assert server.total() == hits and dm.split("test").num_classes == 2 * 4
