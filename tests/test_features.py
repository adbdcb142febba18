"""Feature files: safe format round trip, atomic writes, pickle only on opt-in, bad content refused."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from lightning_putm.data.digits import digits_feature_set
from lightning_putm.errors import FeatureError
from lightning_putm.features.files import FeatureSet, load_features, save_features


def small_set() -> FeatureSet:
    return FeatureSet(torch.rand(12, 4), torch.arange(3).repeat_interleave(4), ["a", "b", "c"], {"backbone": "x"})


def test_round_trip_and_safe_loading(tmp_path):
    original = small_set()
    path = save_features(original, tmp_path / "sub" / "novel.pt")
    loaded = load_features(path)
    assert torch.equal(loaded.features, original.features)
    assert torch.equal(loaded.labels, original.labels)
    assert loaded.class_names == ["a", "b", "c"] and loaded.metadata["backbone"] == "x"
    # our format loads with weights_only=True, i.e. without executing any pickled code
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == "lightning-putm-features"
    assert [p.name for p in path.parent.iterdir()] == ["novel.pt"]  # no temporary file left behind


def test_atomic_write_keeps_previous_file_when_interrupted(tmp_path, monkeypatch):
    path = save_features(small_set(), tmp_path / "f.pt")
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_features(FeatureSet(torch.zeros(3, 2), torch.zeros(3, dtype=torch.long), ["z"]), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pt"]


def write_label_dict_pickle(path, dim=5, vector_shape=None):
    rng = np.random.default_rng(0)
    data = {7: [rng.random(vector_shape or dim) for _ in range(3)], 2: [rng.random(vector_shape or dim) for _ in range(4)]}
    with open(path, "wb") as handle:
        pickle.dump(data, handle)
    return data


def test_pickle_needs_explicit_opt_in(tmp_path):
    path = tmp_path / "novel.plk"
    write_label_dict_pickle(path)
    with pytest.raises(FeatureError, match="allow_pickle=true"):
        load_features(path)
    loaded = load_features(path, allow_pickle=True)
    assert loaded.features.shape == (7, 5)
    assert loaded.class_names == ["2", "7"]  # sorted labels become classes 0, 1
    assert torch.bincount(loaded.labels).tolist() == [4, 3]


def test_pickle_with_row_vectors(tmp_path):
    path = tmp_path / "novel.pkl"
    write_label_dict_pickle(path, vector_shape=(1, 6))
    assert load_features(path, allow_pickle=True).features.shape == (7, 6)


class WritesAFile:
    """A pickle payload that would create a file when unpickled."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_malicious_pickle_is_not_executed_without_opt_in(tmp_path):
    marker = tmp_path / "pwned.txt"
    for name in ("evil.plk", "evil.pt"):
        path = tmp_path / name
        with open(path, "wb") as handle:
            pickle.dump({"format": "lightning-putm-features", "x": WritesAFile(str(marker))}, handle)
        with pytest.raises(FeatureError):
            load_features(path)
        assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"not a torch file at all", os.urandom(256)])
def test_corrupt_files_give_clear_errors(tmp_path, content):
    path = tmp_path / "broken.pt"
    path.write_bytes(content)
    with pytest.raises(FeatureError, match="broken.pt"):
        load_features(path)


def test_truncated_file_gives_clear_error(tmp_path):
    path = save_features(small_set(), tmp_path / "f.pt")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(FeatureError):
        load_features(path)


def test_missing_file_and_foreign_torch_file(tmp_path):
    with pytest.raises(FeatureError, match="not found"):
        load_features(tmp_path / "nope.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(FeatureError, match="not a lightning-putm feature file"):
        load_features(tmp_path / "other.pt")


def test_invalid_feature_sets_are_refused():
    with pytest.raises(FeatureError, match="integers"):
        FeatureSet(torch.rand(4, 2), torch.tensor([0.0, 1.0, 0.0, 1.0]), ["a", "b"])
    with pytest.raises(FeatureError, match="4 feature rows but 3 labels"):
        FeatureSet(torch.rand(4, 2), torch.tensor([0, 1, 0]), ["a", "b"])
    with pytest.raises(FeatureError, match="labels must lie in 0..1"):
        FeatureSet(torch.rand(3, 2), torch.tensor([0, 1, 2]), ["a", "b"])
    bad = FeatureSet(torch.rand(4, 2), torch.tensor([0, 1, 0, 1]), ["a", "b"])
    bad.features[2, 1] = float("inf")
    with pytest.raises(FeatureError, match=r"NaN or Inf in 1 row\(s\) \(first rows: \[2\]\)"):
        bad.check_finite()


def test_digits_demo_data():
    digits = digits_feature_set()
    assert digits.features.shape == (1797, 64) and digits.num_classes == 10
    assert float(digits.features.min()) >= 0 and float(digits.features.max()) == 16
    novel = digits_feature_set([5, 6, 7, 8, 9])
    assert novel.class_names == ["digit_5", "digit_6", "digit_7", "digit_8", "digit_9"]
    assert sorted(novel.labels.unique().tolist()) == [0, 1, 2, 3, 4]


def test_a_cache_of_a_split_whose_files_changed_is_not_reused(tmp_path):
    """Kills: a cache hit trusted by its key alone. The key names the data's root and split, not the files in it:
    a class added to the folder was left out of every task, evaluated with the old features."""
    from lightning_putm.data.imagesplit import ImageSplit
    from lightning_putm.evaluation.sources import fresh_cache
    from lightning_putm.features.cache import FeatureCache, FeatureCacheKey

    def split(classes: int) -> ImageSplit:
        return ImageSplit("tiered", "test", torch.arange(classes).repeat_interleave(2),
                          [f"n{c}" for c in range(classes)], channels=3,
                          images=torch.zeros(2 * classes, 3, 4, 4, dtype=torch.uint8))

    cache = FeatureCache(tmp_path, FeatureCacheKey("sha", "tieredimagenet", "/data", "{}", "test", "Resize(4)"))
    before = split(2)
    cache.store(FeatureSet(torch.rand(4, 8), before.labels, list(before.class_names)))
    lines: list[str] = []
    assert fresh_cache(cache, before, lines.append) is not None and lines == []
    assert fresh_cache(cache, split(3), lines.append) is None  # a class added
    assert lines == [f"features: the cache {cache.path} no longer matches the split (4 images of 2 classes cached, "
                     "6 of 3 now): extracting again"]
    renamed = split(2)
    renamed.class_names = ["n0", "other"]
    assert fresh_cache(cache, renamed, lines.append) is None
