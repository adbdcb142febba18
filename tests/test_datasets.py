"""Dataset readers in their real on-disk layouts, transforms and the DataModule (lightning_putm.data).

Each fixture writes a few classes of small PIL-generated images in the layout the reader expects.
A real Omniglot copy, when one is provided beside the checkout, is counted too; that test skips otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import omniglot_skip_reason, real_omniglot_root
from lightning_putm.data import EpisodeSettings, FewShotDataModule, read_split
from lightning_putm.data.cub import cub_split_of
from lightning_putm.data.omniglot import vinyals_split_of
from lightning_putm.data.samplers import EpochShuffleSampler
from lightning_putm.data.transforms import eval_transform, train_transform
from lightning_putm.errors import ConfigError, DataError

REAL_OMNIGLOT = real_omniglot_root()


def write_image(path: Path, seed: int, size: int = 12, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    if mode == "1":
        Image.fromarray(rng.random((size, size)) > 0.2).convert("1").save(path)
    else:
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)


def check_splits(name: str, root: Path | None, expected: dict[str, int], **options) -> dict[str, object]:
    """Read all splits; check class counts, label ranges, non-empty classes and disjoint class sets."""
    splits = {s: read_split(name, root, s, **options) for s in ("train", "val", "test")}
    for split, data in splits.items():
        assert data.num_classes == expected[split], (split, data.class_names)
        if len(data):
            assert int(data.labels.min()) == 0 and int(data.labels.max()) == data.num_classes - 1
            assert (data.class_sizes() > 0).all()
    names = {s: set(d.class_names) for s, d in splits.items()}
    assert not names["train"] & names["val"] and not names["train"] & names["test"] and not names["val"] & names["test"]
    return splits


# ------------------------------------------------------------------------------------------- miniImageNet
def make_miniimagenet(root: Path, classes: dict[str, list[str]], per_class: int = 3) -> Path:
    seed = 0
    for split, wnids in classes.items():
        lines = ["filename,label"]
        for wnid in wnids:
            for i in range(per_class):
                name = f"{wnid}{i:08d}.jpg"
                write_image(root / "images" / name, seed := seed + 1)
                lines.append(f"{name},{wnid}")
        (root / f"{split}.csv").write_text("\n".join(lines) + "\n")
    return root


MINI = {"train": ["n01", "n02", "n03"], "val": ["n04", "n05"], "test": ["n06", "n07"]}


def test_miniimagenet_csv_split(tmp_path: Path) -> None:
    root = make_miniimagenet(tmp_path / "mini", MINI)
    splits = check_splits("miniimagenet", root, {"train": 3, "val": 2, "test": 2})
    assert splits["val"].class_names == ["n04", "n05"] and len(splits["train"]) == 9
    assert all(p.parent == root / "images" for p in splits["test"].paths)
    image, label = splits["train"].to_dataset()[4]
    assert label == 1 and image.size == (12, 12)


def test_miniimagenet_errors_say_what_is_missing(tmp_path: Path) -> None:
    root = make_miniimagenet(tmp_path / "mini", MINI)
    with pytest.raises(DataError, match="no data root given.*data.root"):
        read_split("miniimagenet", None, "train")
    with pytest.raises(DataError, match=r"does not exist.*train\.csv"):
        read_split("miniimagenet", tmp_path / "nowhere", "train")
    (root / "val.csv").unlink()
    with pytest.raises(DataError, match=r"val\.csv.*" + str(root / "val.csv").replace(".", r"\.")):
        read_split("miniimagenet", root, "val")
    (root / "test.csv").write_text("filename,label\nn0600000000.jpg\n")
    with pytest.raises(DataError, match="line 2 is malformed"):
        read_split("miniimagenet", root, "test")
    (root / "test.csv").write_text("file,class\n")
    with pytest.raises(DataError, match="header `filename,label`"):
        read_split("miniimagenet", root, "test")
    (root / "images" / "n0100000000.jpg").unlink()
    with pytest.raises(DataError, match="1 image.*missing.*n0100000000.jpg"):
        read_split("miniimagenet", root, "train")


# ------------------------------------------------------------------------------------------- tieredImageNet
def test_tieredimagenet_class_folders(tmp_path: Path) -> None:
    root = tmp_path / "tiered"
    layout = {"train": ["n1", "n2", "n3", "n4"], "val": ["n5", "n6"], "test": ["n7", "n8", "n9"]}
    seed = 0
    for split, wnids in layout.items():
        for wnid in wnids:
            for i in range(2):
                write_image(root / split / wnid / f"{i}.JPEG", seed := seed + 1)
    (root / "train" / "n1" / "notes.txt").write_text("not an image")
    splits = check_splits("tieredimagenet", root, {"train": 4, "val": 2, "test": 3})
    assert splits["test"].class_names == ["n7", "n8", "n9"] and len(splits["train"]) == 8
    (root / "val" / "n5" / "0.JPEG").unlink()
    (root / "val" / "n5" / "1.JPEG").unlink()
    with pytest.raises(DataError, match="n5 holds no images"):
        read_split("tieredimagenet", root, "val")
    with pytest.raises(DataError, match="expected the test/ folder"):
        read_split("tieredimagenet", _empty(tmp_path), "test")


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir(exist_ok=True)
    return folder


# ------------------------------------------------------------------------------------------- CUB
def test_cub_standard_split_rule(tmp_path: Path) -> None:
    root = tmp_path / "CUB_200_2011"
    names = [f"{i + 1:03d}.Bird_{i}" for i in range(8)]
    for i, name in enumerate(names):
        for j in range(2):
            write_image(root / "images" / name / f"{name}_{j}.jpg", 10 * i + j)
    splits = check_splits("cub", root, {"train": 4, "val": 2, "test": 2})
    assert splits["train"].class_names == [names[i] for i in (0, 2, 4, 6)]
    assert splits["val"].class_names == [names[1], names[5]]
    assert splits["test"].class_names == [names[3], names[7]]
    assert [cub_split_of(i) for i in range(200)].count("train") == 100
    assert [cub_split_of(i) for i in range(200)].count("val") == 50
    # The parent of CUB_200_2011 works too.
    assert read_split("cub", tmp_path, "val").class_names == [names[1], names[5]]
    with pytest.raises(DataError, match="images/ folder"):
        read_split("cub", _empty(tmp_path), "train")


# ------------------------------------------------------------------------------------------- CIFAR-FS
def test_cifarfs_bertinetto_split_files(tmp_path: Path) -> None:
    root = tmp_path / "cifar-fs"
    layout = {"train": ["apple", "bed", "cup"], "val": ["otter", "lamp"], "test": ["baby", "rose"]}
    seed = 0
    for split, classes in layout.items():
        for cls in classes:
            for i in range(2):
                write_image(root / "data" / cls / f"{cls}_{i}.png", seed := seed + 1, size=32)
        (root / "splits" / "bertinetto").mkdir(parents=True, exist_ok=True)
        (root / "splits" / "bertinetto" / f"{split}.txt").write_text("\n".join(classes) + "\n")
    splits = check_splits("cifarfs", root, {"train": 3, "val": 2, "test": 2})
    assert splits["val"].class_names == ["otter", "lamp"]  # the order of the split list
    (root / "splits" / "bertinetto" / "test.txt").unlink()
    with pytest.raises(DataError, match=r"splits/bertinetto/test\.txt"):
        read_split("cifarfs", root, "test")
    (root / "splits" / "bertinetto" / "val.txt").write_text("otter\nwhale\n")
    with pytest.raises(DataError, match="whale"):
        read_split("cifarfs", root, "val")


# ------------------------------------------------------------------------------------------- Omniglot
OMNI_CHARACTERS = [
    "images_background/Latin/character01", "images_background/Latin/character02",
    "images_background/Greek/character01",
    "images_evaluation/Angelic/character01",
    "images_evaluation/Gurmukhi/character41", "images_evaluation/Gurmukhi/character42",
    "images_evaluation/Kannada/character01",
]


def make_omniglot(root: Path, drawers: int = 3) -> Path:
    for c, character in enumerate(OMNI_CHARACTERS):
        for d in range(drawers):
            write_image(root / "omniglot-py" / character / f"{c + 1:04d}_{d + 1:02d}.png", 100 * c + d, 105, "1")
    return root


def test_omniglot_vinyals_rule_rotations_and_size(tmp_path: Path) -> None:
    root = make_omniglot(tmp_path / "omniglot")
    splits = check_splits("omniglot", root, {"train": 5 * 4, "val": 0, "test": 2 * 4})
    train, test = splits["train"], splits["test"]
    assert {n.rsplit("/", 1)[0] for n in test.class_names} == {
        "images_evaluation/Gurmukhi/character42", "images_evaluation/Kannada/character01"}
    assert train.images.shape == (5 * 4 * 3, 1, 28, 28) and train.images.dtype == torch.uint8
    assert train.class_names[:4] == [f"images_background/Greek/character01/rot{r:03d}" for r in (0, 90, 180, 270)]
    assert (train.class_sizes() == 3).all()
    # Class k+1 holds the class-k images rotated by 90 degrees; ink is bright on a dark background.
    first, second = train.images[train.labels == 0], train.images[train.labels == 1]
    torch.testing.assert_close(second, torch.rot90(first, 1, dims=(-2, -1)))
    assert train.images.float().mean() < 127
    one = read_split("omniglot", root, "test", rotations=[0], image_size=20)
    assert one.num_classes == 2 and one.images.shape[-1] == 20
    with pytest.raises(DataError, match="multiples of 90"):
        read_split("omniglot", root, "test", rotations=[45])
    with pytest.raises(ConfigError, match="no option.*colour"):
        read_split("omniglot", root, "test", colour=True)


def test_omniglot_uses_split_files_when_present(tmp_path: Path) -> None:
    root = make_omniglot(tmp_path / "omniglot")
    folder = root / "splits" / "vinyals_protonets"
    folder.mkdir(parents=True)
    (folder / "train.txt").write_text("images_background/Latin/character01\nimages_background/Latin/character02\n")
    (folder / "val.txt").write_text("images_background/Greek/character01\n")
    (folder / "test.txt").write_text("images_evaluation/Kannada/character01\n")
    check_splits("omniglot", root, {"train": 8, "val": 4, "test": 4}, scheme="vinyals_protonets")
    with pytest.raises(DataError, match="split file .*other_scheme"):
        read_split("omniglot", root, "train", scheme="other_scheme")
    (folder / "test.txt").write_text("images_evaluation/Kannada/character09\n")
    with pytest.raises(DataError, match="character09.*missing"):
        read_split("omniglot", root, "test", scheme="vinyals_protonets")


def test_omniglot_missing_root_says_what_is_expected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="omniglot-py"):
        read_split("omniglot", _empty(tmp_path), "train")
    (tmp_path / "half" / "omniglot-py" / "images_background").mkdir(parents=True)
    with pytest.raises(DataError, match="images_evaluation"):
        read_split("omniglot", tmp_path / "half", "train")


def test_vinyals_rule() -> None:
    assert vinyals_split_of("images_background/Korean/character40") == "train"
    assert vinyals_split_of("images_evaluation/Glagolitic/character45") == "train"
    assert vinyals_split_of("images_evaluation/Gurmukhi/character41") == "train"
    assert vinyals_split_of("images_evaluation/Gurmukhi/character42") == "test"
    assert vinyals_split_of("images_evaluation/Tibetan/character01") == "test"


@pytest.mark.skipif(not (REAL_OMNIGLOT / "omniglot-py").is_dir(),
                    reason=omniglot_skip_reason(REAL_OMNIGLOT))
def test_real_omniglot_vinyals_counts() -> None:
    """The real data: 1200 / 423 characters x 4 rotations, 20 drawings each; the rule equals the split files."""
    from lightning_putm.data.omniglot import omniglot_characters

    characters = omniglot_characters(REAL_OMNIGLOT)
    assert len(characters) == 1623
    for split, count in (("train", 1200), ("test", 423)):
        listed = (REAL_OMNIGLOT / "splits" / "vinyals" / f"{split}.txt").read_text().split()
        assert len(listed) == count
        assert sorted(listed) == [c for c in characters if vinyals_split_of(c) == split]
    test = read_split("omniglot", REAL_OMNIGLOT, "test")
    assert test.num_classes == 423 * 4 and len(test) == 423 * 4 * 20
    assert test.images.shape[1:] == (1, 28, 28) and (test.class_sizes() == 20).all()
    assert read_split("omniglot", REAL_OMNIGLOT, "val").num_classes == 0


# ------------------------------------------------------------------------------------------- digits demo
def test_digits_demo_splits() -> None:
    train, val, test = (read_split("digits", None, s) for s in ("train", "val", "test"))
    assert train.class_names == [f"digit_{d}" for d in range(5)]
    assert test.class_names == [f"digit_{d}" for d in range(5, 10)] and val.class_names == train.class_names
    assert set(train.labels.tolist()) == set(range(5)) and set(test.labels.tolist()) == set(range(5))
    assert not set(train.class_names) & set(test.class_names)
    assert len(train) + len(val) + len(test) == 1797
    assert train.images.shape[1:] == (1, 8, 8) and 0 <= float(train.images.min()) and float(train.images.max()) <= 1


# ------------------------------------------------------------------------------------------- transforms, sampler
def test_transforms_give_tensors_of_the_configured_size() -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 40, 3), dtype=np.uint8))
    augment = {"random_resized_crop": True, "color_jitter": 0.4, "horizontal_flip": True}
    normalise = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
    assert train_transform(24, 3, augment, normalise, from_files=True)(image).shape == (3, 24, 24)
    assert eval_transform(24, 3, normalise, from_files=True)(image).shape == (3, 24, 24)
    small = train_transform(8, 1, {"crop_padding": 1}, None, from_files=False)(torch.rand(1, 8, 8))
    assert small.shape == (1, 8, 8)
    with pytest.raises(ConfigError, match="3 mean and std"):
        eval_transform(8, 3, {"mean": [0.5], "std": [0.5]}, from_files=True)
    with pytest.raises(ConfigError, match="unknown data.augment"):
        train_transform(8, 1, {"mixup": True}, None, from_files=False)


def test_epoch_shuffle_sampler_depends_only_on_seed_and_epoch() -> None:
    a, b = EpochShuffleSampler(50, seed=3), EpochShuffleSampler(50, seed=3)
    torch.manual_seed(1)
    first = list(a)
    torch.manual_seed(2)
    assert list(b) == first and sorted(first) == list(range(50))
    a.set_epoch(1)
    assert list(a) != first


# ------------------------------------------------------------------------------------------- DataModule
def test_datamodule_loaders_and_episode_bank() -> None:
    dm = FewShotDataModule("digits", image_size=8, batch_size=32, eval_batch_size=100,
                           augment={"crop_padding": 1}, val_episodes=EpisodeSettings(tasks=10, queries=25))
    dm.setup("fit")
    assert dm.num_classes == 5 and dm.in_channels == 1 and dm.has_split("val")
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (32, 1, 8, 8) and labels.max() < 5
    assert len(dm.train_dataloader()) == len(dm.split("train")) // 32  # drop_last
    images, labels, index = next(iter(dm.val_dataloader()))
    assert images.shape == (100, 1, 8, 8) and index.tolist() == list(range(100))
    bank = dm.episodes("val")
    assert len(bank) == 10 and bank.queries == 25 and dm.episodes("val") is bank
    again = FewShotDataModule("digits", image_size=8, val_episodes=EpisodeSettings(tasks=10, queries=25))
    assert torch.equal(again.episodes("val").query_indices, bank.query_indices)
    assert int(bank.query_indices.max()) < len(dm.split("val"))


def test_datamodule_without_validation_classes(tmp_path: Path) -> None:
    root = make_omniglot(tmp_path / "omniglot")
    dm = FewShotDataModule("omniglot", root=root, image_size=28, batch_size=8, options={"scheme": "vinyals"},
                           test_episodes=EpisodeSettings(tasks=3, ways=2, shots=1, queries=4))
    dm.setup("fit")
    assert not dm.has_split("val") and dm.val_dataloader() == []
    assert dm.num_classes == 20
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 1, 28, 28) and images.dtype == torch.float32 and float(images.max()) <= 1.0
    assert len(dm.episodes("test")) == 3


def test_datamodule_reports_a_missing_root() -> None:
    dm = FewShotDataModule("miniimagenet", root=None)
    with pytest.raises(DataError, match="data.root"):
        dm.setup("fit")
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'"):
        FewShotDataModule("imagenet")


def test_real_data_tests_follow_the_documented_environment_variable(tmp_path: Path, monkeypatch) -> None:
    """Kills: the real-Omniglot tests looking only beside the checkout (LIGHTNING_PUTM_OMNIGLOT ignored)."""
    import conftest

    monkeypatch.setenv(conftest.OMNIGLOT_ENV, str(tmp_path / "my-omniglot"))
    assert conftest.real_omniglot_root() == tmp_path / "my-omniglot"
    assert conftest.OMNIGLOT_ENV in conftest.omniglot_skip_reason(tmp_path)
    monkeypatch.delenv(conftest.OMNIGLOT_ENV)
    assert conftest.real_omniglot_root() == conftest.SHARED_DATA / "omniglot"
