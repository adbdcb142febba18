"""``evaluate.py predict``: labels for a user's own image folders, tested on real Omniglot PNGs.

A Conv-4 of width 8 is trained for one epoch on 8 real Omniglot characters (a tiny root built in tmp from the
shared copy, in seconds); the support and query folders hold real drawings of 4 other characters.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import omniglot_skip_reason, real_omniglot_root
from lightning_putm.data.omniglot import load_character
from lightning_putm.errors import ConfigError, DataError
from lightning_putm.methods.calibration import scale_probabilities, soft_counts
from lightning_putm.prediction.images import checkpoint_image_reader, omniglot_pixels, read_folders
from lightning_putm.pretraining.checkpoints import load_checkpoint_backbone

REPO_ROOT = Path(__file__).resolve().parents[1]
OMNIGLOT = real_omniglot_root() / "omniglot-py"
TRAIN_CHARACTERS = [f"images_background/Alphabet_of_the_Magi/character{i:02d}" for i in range(1, 9)]
NOVEL_CHARACTERS = [f"images_evaluation/Angelic/character{i:02d}" for i in range(1, 5)]
VAL_CHARACTERS = [f"images_background/Alphabet_of_the_Magi/character{i:02d}" for i in range(9, 15)]
SHOTS = {0: 1, 1: 2, 2: 1, 3: 3}  # unequal shots per class on purpose
QUERIES_PER_CLASS = {0: 6, 1: 2, 2: 4, 3: 3}  # imbalanced queries


def _skip_without_omniglot() -> None:
    if not OMNIGLOT.is_dir():
        pytest.skip(omniglot_skip_reason(OMNIGLOT.parent))


@pytest.fixture(scope="session")
def omniglot_checkpoint(tmp_path_factory) -> Path:
    """A width-8 Conv-4 trained one epoch (classifier stage) on 8 real Omniglot characters, rotation 0 only; 6 more
    characters are its validation split (for calibration)."""
    _skip_without_omniglot()
    from lightning_putm.jobs.train import run_train_backbone

    root = tmp_path_factory.mktemp("omniglot_root")
    for character in TRAIN_CHARACTERS + VAL_CHARACTERS + NOVEL_CHARACTERS:
        shutil.copytree(OMNIGLOT / character, root / "omniglot-py" / character)
    for name in ("images_background", "images_evaluation"):
        (root / "omniglot-py" / name).mkdir(parents=True, exist_ok=True)
    splits = root / "splits" / "tiny"
    splits.mkdir(parents=True)
    (splits / "train.txt").write_text("\n".join(TRAIN_CHARACTERS) + "\n")
    (splits / "val.txt").write_text("\n".join(VAL_CHARACTERS) + "\n")  # for calibration
    (splits / "test.txt").write_text("\n".join(NOVEL_CHARACTERS) + "\n")
    folder = tmp_path_factory.mktemp("omniglot_checkpoint")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train_backbone(["data=omniglot", f"data.root={root}", "data.options.scheme=tiny",
                            "data.options.rotations=[0]", "data.batch_size=32", "logger=none",
                            "trainer.enable_progress_bar=false", "trainer.accelerator=cpu", "backbone.width=8",
                            "stages=[classifier]", "trainer.max_epochs=1", "run_test=false", "val_episodes.tasks=5",
                            f"checkpoint_dir={folder}"], log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    return folder / "omniglot" / "conv4" / "latest" / "classifier" / "last.ckpt"


def _drawings(character: str) -> list[Path]:
    return sorted((OMNIGLOT / character).glob("*.png"))


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """support/<class>/ and query/ from real drawings of 4 novel characters; returns the truth per query file."""
    _skip_without_omniglot()
    support, query = tmp_path / "support", tmp_path / "query"
    truth: dict[str, str] = {}
    for label, character in enumerate(NOVEL_CHARACTERS):
        name = f"angelic_{label + 1:02d}"
        files = _drawings(character)
        (support / name).mkdir(parents=True)
        for path in files[:SHOTS[label]]:
            shutil.copy(path, support / name / path.name)
        for path in files[SHOTS[label]:SHOTS[label] + QUERIES_PER_CLASS[label]]:
            target = query / ("sub" if label == 3 else "") / path.name  # a nested query folder is searched too
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
            truth[target.relative_to(query).as_posix()] = name
    (query / ".DS_Store").write_bytes(b"\x00hidden")  # hidden files are ignored silently
    (query / "notes.txt").write_text("not an image")  # other files are ignored with a notice
    return support, query, truth


def _predict(checkpoint: Path, support: Path, query: Path, tmp_path: Path, *extra: str):
    from lightning_putm.jobs.predict import run_predict

    lines: list[str] = []
    result = run_predict([f"checkpoint={checkpoint}", f"support={support}", f"query={query}",
                          f"output={tmp_path / 'out' / 'predictions.csv'}", f"feature_cache_dir={tmp_path / 'cache'}",
                          "device=cpu", "method.putm.em_steps=5", "method.putm.inner_steps=5", "calibration_tasks=40",
                          *extra],
                         log=lines.append)
    return result, lines


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_every_query_gets_a_row_with_a_support_class_and_probabilities_summing_to_one(
        omniglot_checkpoint: Path, folders, tmp_path: Path, single_thread) -> None:
    support, query, truth = folders
    result, lines = _predict(omniglot_checkpoint, support, query, tmp_path)
    rows = _rows(result.output)
    classes = sorted(p.name for p in support.iterdir())
    assert sorted(r["file"] for r in rows) == sorted(truth)  # every query once, paths relative to query/
    assert {r["predicted_class"] for r in rows} <= set(classes)
    for row in rows:
        per_class = {c: float(row[f"prob_{c}"]) for c in classes}
        assert sum(per_class.values()) == pytest.approx(1.0, abs=1e-4)
        assert max(per_class, key=per_class.get) == row["predicted_class"]
        assert float(row["probability"]) == pytest.approx(max(per_class.values()), abs=1e-6)
    counts = _rows(result.counts_output)
    assert [c["class"] for c in counts] == classes
    assert [int(c["support_images"]) for c in counts] == [SHOTS[i] for i in range(4)]
    assert sum(float(c["estimated_queries"]) for c in counts) == pytest.approx(len(truth), abs=1e-2)
    assert sum(int(c["predicted_queries"]) for c in counts) == len(truth)
    predicted = {c: sum(r["predicted_class"] == c for r in rows) for c in classes}
    assert predicted == {c["class"]: int(c["predicted_queries"]) for c in counts}
    assert any("forward navigator" in line for line in lines)  # says what the estimate is
    assert any(line.startswith("notice: ignored 1 file(s)") and "notes.txt" in line for line in lines)
    again, _ = _predict(omniglot_checkpoint, support, query, tmp_path)  # same inputs and seed: same predictions
    assert torch.equal(again.probabilities, result.probabilities)


def test_copies_of_support_images_are_predicted_as_their_class(omniglot_checkpoint: Path, tmp_path: Path,
                                                                single_thread) -> None:
    """The easy case: each query is a renamed copy of a class's one support image, so its features are that
    class's prototype exactly; every method must label it so (PUTM with the full default EM schedule too)."""
    _skip_without_omniglot()
    support, query = tmp_path / "support", tmp_path / "copies"
    query.mkdir()
    expected = {}
    for label, character in enumerate(NOVEL_CHARACTERS):
        name = f"angelic_{label + 1:02d}"
        (support / name).mkdir(parents=True)
        original = _drawings(character)[0]
        shutil.copy(original, support / name / original.name)
        for copy in range(label + 1):  # imbalanced: 1, 2, 3, 4 copies
            shutil.copy(original, query / f"copy{copy}_of_{name}.png")
            expected[f"copy{copy}_of_{name}.png"] = name
    for method, extra in (("putm", ("method.putm.em_steps=50", "method.putm.inner_steps=30")),
                          ("simpleshot", ()), ("ptmap", ())):
        # calibration=null: the navigator's own estimate (a temperature fitted on this weak backbone's validation
        # tasks flattens every row, these exact copies too)
        result, _ = _predict(omniglot_checkpoint, support, query, tmp_path, f"method={method}", "calibration=null",
                             *extra)
        assert {r["file"]: r["predicted_class"] for r in _rows(result.output)} == expected, method
        if method == "putm":  # its count estimate is right too: 1, 2, 3, 4
            assert result.counts.tolist() == pytest.approx([1, 2, 3, 4], abs=0.5)


def test_an_rgb_resized_query_is_read_like_its_grayscale_original(omniglot_checkpoint: Path, folders,
                                                                   tmp_path: Path, single_thread) -> None:
    """An RGB JPEG-free copy at another size goes through the checkpoint's reader to (nearly) the same tensor."""
    support, query, truth = folders
    original = query / sorted(truth)[0]
    rgb = query / "rgb_big.png"
    Image.open(original).convert("RGB").resize((210, 210), Image.Resampling.NEAREST).save(rgb)
    _, hparams = load_checkpoint_backbone(omniglot_checkpoint)
    reader = checkpoint_image_reader(hparams)
    a, b = reader(original), reader(rgb)
    assert a.shape == b.shape == (1, 28, 28)
    assert (a - b).abs().max() < 0.1  # Lanczos from 210 vs 105 pixels: close, not equal
    result, _ = _predict(omniglot_checkpoint, support, query, tmp_path)
    assert "rgb_big.png" in {r["file"] for r in _rows(result.output)}


def test_the_reader_decodes_omniglot_files_as_the_dataset_reader_does(tmp_path: Path) -> None:
    """Drift guard: predict's Omniglot decoding equals ``load_character`` (the reader of the training data)."""
    _skip_without_omniglot()
    character = OMNIGLOT / NOVEL_CHARACTERS[0]
    stored = torch.from_numpy(load_character(character, 28)).float() / 255.0
    ours = torch.stack([omniglot_pixels(p, 28)[0] for p in _drawings(NOVEL_CHARACTERS[0])])
    assert torch.equal(stored, ours)


def test_a_corrupt_file_is_named_and_nothing_is_written(omniglot_checkpoint: Path, folders, tmp_path: Path) -> None:
    support, query, _ = folders
    (query / "broken.png").write_bytes(b"not a png at all")
    (query / "notes.jpg").write_text("a text file with an image extension")
    with pytest.raises(DataError, match=r"2 file\(s\) cannot be read.*broken\.png.*notes\.jpg"):
        _predict(omniglot_checkpoint, support, query, tmp_path, "method=simpleshot")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "cache").exists()  # failed before the base-class features were extracted and cached


def test_cl2n_uses_the_checkpoints_base_classes_or_says_it_falls_back(omniglot_checkpoint: Path, folders,
                                                                     tmp_path: Path, single_thread) -> None:
    """SimpleShot's base mean: the 8 training characters × 20 drawings the checkpoint records (auto), or L2N with a
    notice when that data is not where data_root says; the two give different probabilities."""
    support, query, _ = folders
    cl2n, _ = _predict(omniglot_checkpoint, support, query, tmp_path, "method=simpleshot")
    assert cl2n.normalisation.startswith("CL2N (mean of 160 base-class rows")
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    l2n, lines = _predict(omniglot_checkpoint, support, query, tmp_path, "method=simpleshot", f"data_root={empty}")
    assert l2n.normalisation == "L2N (training data not found)"
    assert any(line.startswith("notice: simpleshot uses plain L2 normalisation") for line in lines)
    assert not torch.allclose(cl2n.probabilities, l2n.probabilities)
    with pytest.raises(DataError, match="omniglot"):  # split:train insists
        _predict(omniglot_checkpoint, support, query, tmp_path, "method=simpleshot", f"data_root={empty}",
                 "base_features=split:train")


def test_probabilities_are_calibrated_on_the_checkpoints_validation_classes(omniglot_checkpoint: Path, folders,
                                                                           tmp_path: Path, single_thread) -> None:
    """auto: a temperature fitted on tasks from the 6 validation characters (cached), applied to every query; the
    predicted classes stay the method's own; the counts are soft sums with a 95% interval."""
    support, query, truth = folders
    result, lines = _predict(omniglot_checkpoint, support, query, tmp_path, "method=protonet")
    fitted = result.calibration
    assert fitted is not None and fitted.tasks == 40 and fitted.temperature != 1.0
    assert any(line.startswith("calibration features: extracting the val split of omniglot (120 images)")
               for line in lines)
    assert any(line.startswith("probabilities: calibrated, temperature") for line in lines)
    assert torch.allclose(result.probabilities, scale_probabilities(result.raw_probabilities, fitted.temperature))
    rows = _rows(result.output)
    classes = sorted(p.name for p in support.iterdir())
    raw_predicted = result.raw_probabilities.argmax(1)
    by_file = dict(zip(result.images.query_names(), raw_predicted.tolist()))
    for row in rows:
        assert row["predicted_class"] == classes[by_file[row["file"]]]
        assert float(row["probability"]) == pytest.approx(
            float(result.probabilities[result.images.query_names().index(row["file"])].max()), abs=1e-6)
    counts = _rows(result.counts_output)
    expected = soft_counts(result.probabilities)
    for k, row in enumerate(counts):
        low, estimate, high = (float(row[c]) for c in ("estimated_low", "estimated_queries", "estimated_high"))
        assert low <= estimate <= high and 0 <= low and high <= len(truth)
        assert (low, estimate, high) == pytest.approx((float(expected.low[k]), float(expected.estimate[k]),
                                                       float(expected.high[k])), abs=1e-3)
    again, lines = _predict(omniglot_checkpoint, support, query, tmp_path, "method=protonet")
    assert any(line.startswith("calibration: reusing") for line in lines)
    assert again.calibration == fitted and torch.equal(again.probabilities, result.probabilities)
    other, lines = _predict(omniglot_checkpoint, support, query, tmp_path, "method=putm")  # another method: refitted
    assert not any(line.startswith("calibration: reusing") for line in lines)
    assert other.calibration is not None and other.calibration.temperature != fitted.temperature


def test_calibration_can_be_given_turned_off_or_fall_back_with_a_notice(omniglot_checkpoint: Path, folders,
                                                                       tmp_path: Path, single_thread) -> None:
    support, query, _ = folders
    raw, _ = _predict(omniglot_checkpoint, support, query, tmp_path, "method=protonet", "calibration=null")
    assert raw.calibration is None and torch.equal(raw.probabilities, raw.raw_probabilities)
    given, lines = _predict(omniglot_checkpoint, support, query, tmp_path, "method=protonet", "calibration=2.5")
    assert torch.allclose(given.probabilities, scale_probabilities(raw.raw_probabilities, 2.5))
    assert any("scaled by the given temperature 2.5" in line for line in lines)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    missing, lines = _predict(omniglot_checkpoint, support, query, tmp_path, "method=protonet", f"data_root={empty}")
    assert missing.calibration is None and torch.equal(missing.probabilities, missing.raw_probabilities)
    assert any(line.startswith("notice: probabilities are the method's own (uncalibrated): the checkpoint's val split")
               for line in lines)
    with pytest.raises(DataError, match="omniglot"):  # split:val insists
        _predict(omniglot_checkpoint, support, query, tmp_path, "method=protonet", f"data_root={empty}",
                 "calibration=split:val")


def test_unem_fits_its_default_on_the_checkpoints_validation_classes(omniglot_checkpoint: Path, folders,
                                                                     tmp_path: Path, single_thread) -> None:
    """``learned=auto`` in predict: fitted (cached) for the user's task shape (4 classes, 1 shot at the smallest)
    on the 6 validation characters, else the untrained start with one notice. Kills: predict's UNEM left at the
    untrained start (or the published values) where validation classes exist, a fit of another task shape, the
    fitted file not the one used, no notice (or a fit) where the validation split cannot be read."""
    support, query, _ = folders
    options = ("method=unem", "method.unem.fit_tasks=5", "calibration=null")
    fitted, lines = _predict(omniglot_checkpoint, support, query, tmp_path, *options)
    assert any(line.startswith("validation features: extracting the val split of omniglot (120 images)")
               for line in lines), lines
    [file] = (tmp_path / "cache" / "unem").glob("auto-*-1shot.json")
    meta = json.loads(file.read_text())["meta"]
    assert meta["fit"]["ways"] == 4 and meta["shots"] == 1 and meta["fit"]["tasks"] == 5
    given, _ = _predict(omniglot_checkpoint, support, query, tmp_path, "method=unem", f"method.unem.params_file={file}",
                        "calibration=null")
    assert torch.equal(given.raw_probabilities, fitted.raw_probabilities)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    untrained, lines = _predict(omniglot_checkpoint, support, query, tmp_path, *options, f"data_root={empty}")
    assert [line for line in lines if line.startswith("notice: unem uses its untrained start")], lines
    initial, _ = _predict(omniglot_checkpoint, support, query, tmp_path, "method=unem", "method.unem.learned=initial",
                          "calibration=null")
    assert torch.equal(untrained.raw_probabilities, initial.raw_probabilities)


@pytest.mark.parametrize(("value", "message"), [
    ("0", r"calibration=0: a temperature must be a number > 0"),
    ("-2", r"calibration=-2: a temperature must be a number > 0"),
    ("true", r"calibration=True: give auto"),
    ("nowhere.pt", r"calibration: file not found: nowhere.pt"),
    ("-1x", r"calibration: file not found: -1x"),
])
def test_bad_calibration_values_stop_before_anything_is_written(tmp_path: Path, value: str, message: str) -> None:
    from lightning_putm.jobs.predict import run_predict

    with pytest.raises(ConfigError, match=message):
        run_predict([f"checkpoint={tmp_path / 'x.ckpt'}", f"support={tmp_path}", f"query={tmp_path}",
                     f"output={tmp_path / 'out' / 'p.csv'}", f"calibration={value}"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("change", "message"), [
    ("empty_class", r"support class folder\(s\) with no images.*angelic_02"),
    ("empty_query", r"query=.* holds no images"),
    ("one_class", r"at least 2 class sub-folders"),
    ("loose_support", r"images outside class sub-folders \(loose\.png\)"),
    ("query_in_support", r"is both a support and a query image"),
])
def test_folder_problems_are_named(folders, change: str, message: str) -> None:
    support, query, _ = folders
    if change == "empty_class":
        for path in (support / "angelic_02").iterdir():
            path.unlink()
        (support / "angelic_02" / "readme.txt").write_text("not an image")
    elif change == "empty_query":
        shutil.rmtree(query)
        query.mkdir()
    elif change == "one_class":
        for folder in sorted(support.iterdir())[1:]:
            shutil.rmtree(folder)
    elif change == "loose_support":
        shutil.copy(next((support / "angelic_01").iterdir()), support / "loose.png")
    else:
        query = support / "angelic_04"
    with pytest.raises(DataError, match=message):
        read_folders(support, query)


def test_config_errors_come_before_anything_is_read(tmp_path: Path) -> None:
    from lightning_putm.jobs.predict import run_predict

    args = [f"checkpoint={tmp_path / 'x.ckpt'}", f"support={tmp_path}", f"query={tmp_path}",
            f"output={tmp_path / 'p.csv'}"]
    with pytest.raises(ConfigError, match=r"unknown method 'nope'; available methods: .*putm"):
        run_predict(args + ["method=nope"])
    with pytest.raises(ConfigError, match=r"unknown config key 'method.putm.rhoo'"):
        run_predict(args + ["method.putm.rhoo=0.5"])
    with pytest.raises(ConfigError, match=r"unknown config key 'shots'"):
        run_predict(args + ["shots=[1]"])
    with pytest.raises(ConfigError, match=r"`support` is required"):
        run_predict([a for a in args if not a.startswith("support=")])
    with pytest.raises(ConfigError, match=r"putm.rho must lie in \[0, 1\]"):
        run_predict(args + ["method.putm.rho=2.0"])
    assert not (tmp_path / "p.csv").exists()


def test_the_command_line_mode_prints_one_line_errors_and_its_help(tmp_path: Path, capsys) -> None:
    """``evaluate.py predict`` through the script's own dispatch (in process: a subprocess costs half a minute)."""
    spec = importlib.util.spec_from_file_location("_predict_evaluate_script", REPO_ROOT / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.cli(["predict", f"support={tmp_path}", f"query={tmp_path}"]) == 2
    assert capsys.readouterr().err.strip() == "error: `checkpoint` is required: pass checkpoint=<path> (a .ckpt " \
                                              "written by train_backbone.py)"
    assert script.cli(["predict", "--help"]) == 0
    shown = capsys.readouterr().out
    for key in ("checkpoint", "support", "query", "method", "output", "counts_output", "base_features"):
        assert f"\n  {key} " in shown
    assert "Keys of conf/predict.yaml" in shown and "Keys of conf/evaluate.yaml" not in shown
    assert script.cli(["predict", "shots=[1]"]) == 2  # evaluate's keys are unknown here: strict
    assert "unknown config key 'shots'" in capsys.readouterr().err


def test_a_checkpoint_that_is_not_one_is_refused_before_anything_is_written(folders, tmp_path: Path) -> None:
    """The checkpoint goes through the weights-only loader: a foreign file is a one-line error, no CSV."""
    support, query, _ = folders
    fake = tmp_path / "fake.ckpt"
    fake.write_text("not a checkpoint")
    with pytest.raises(DataError, match=r"cannot read checkpoint .*fake\.ckpt: it is not a complete PyTorch checkpoint"):
        _predict(fake, support, query, tmp_path)
    assert not (tmp_path / "out").exists()
