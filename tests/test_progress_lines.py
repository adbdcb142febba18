"""A long feature extraction is never silent in a log file (issue 43): where no bar is drawn, a line every 30 s
(``$LIGHTNING_PUTM_PROGRESS_SECONDS``) with images done/total, rate and ETA, and a closing line; nothing extra for a
short one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_putm.evaluation import progress
from lightning_putm.evaluation.progress import ProgressLines
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.prediction.images import extract_features


class Clock:
    """A clock the test moves by hand: the lines depend on it, never on real time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_every_interval_with_done_total_rate_and_eta_then_a_closing_line() -> None:
    """Batches of 100 images, 10 s each, 1000 images: lines at 30, 60 and 90 s (not per batch), the figures
    worked out by hand, then one closing line at 100 s instead of a 100% line. Kills: a line per batch (a log flooded), no line at all, a wrong rate or
    ETA, no closing line, a line after the count is complete."""
    clock, lines = Clock(), []
    count = ProgressLines("extracting features", 1000, lines.append, clock=clock)
    for _ in range(10):
        clock.now += 10
        count.update(100)
    count.close()
    assert lines == ["extracting features: 300/1000 images (30%), 10 images/s, elapsed 0:30, ETA 1:10",
                     "extracting features: 600/1000 images (60%), 10 images/s, elapsed 1:00, ETA 0:40",
                     "extracting features: 900/1000 images (90%), 10 images/s, elapsed 1:30, ETA 0:10",
                     "extracting features: 1000 images done in 1:40 (10 images/s)"]


def test_the_interval_is_30_s_unless_the_environment_says_otherwise(monkeypatch) -> None:
    """Kills: another default, the variable ignored, or a bad value accepted (or refused only mid-run, after the run
    folder exists: the jobs' settings read it first)."""
    from lightning_putm.errors import ConfigError
    from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config

    monkeypatch.delenv("LIGHTNING_PUTM_PROGRESS_SECONDS", raising=False)
    assert ProgressLines("x", 10, print).every == 30.0
    monkeypatch.setenv("LIGHTNING_PUTM_PROGRESS_SECONDS", "2.5")
    assert ProgressLines("x", 10, print).every == 2.5 and ProgressLines("x", 10, print, every_seconds=7).every == 7
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("LIGHTNING_PUTM_PROGRESS_SECONDS", bad)
        with pytest.raises(ConfigError, match=rf"^LIGHTNING_PUTM_PROGRESS_SECONDS={bad}: give the seconds between"):
            settings_from_config(load_evaluate_config(["methods=[simpleshot]", "tasks=2"]))


def test_a_count_done_within_the_interval_prints_nothing() -> None:
    """Kills: a closing line (or any line) for every short extraction, cluttering every log."""
    clock, lines = Clock(), []
    count = ProgressLines("extracting features", 64, lines.append, clock=clock)
    clock.now += 2
    count.update(64)
    count.close()
    assert lines == []


def test_evaluate_extraction_prints_progress_lines_when_stdout_is_not_a_terminal(tiny_checkpoint: Path,
                                                                               tmp_path: Path, monkeypatch,
                                                                               single_thread) -> None:
    """``evaluate.py checkpoint=...`` with its output going to a log (pytest captures it: no terminal), the
    interval at 0 s: the test split's extraction prints ``images done/total`` lines that count up to the split's
    size, through the run's own log. Kills: the lines drawn only as a terminal bar (a log silent for the whole
    extraction), lines that bypass the run's log, a total that is not the number of images."""
    monkeypatch.setenv("LIGHTNING_PUTM_PROGRESS_SECONDS", "0")
    lines: list[str] = []
    run_evaluate([f"checkpoint={tiny_checkpoint}", f"output_dir={tmp_path / 'out'}",
                  f"feature_cache_dir={tmp_path / 'cache'}", "methods=[simpleshot]", "tasks=2", "shots=[1]",
                  "alphas=[2]", "logger=none", "plots=false", "base_features=null", "progress=true",
                  "data.eval_batch_size=64"], log=lines.append)
    counts = [line for line in lines if line.startswith("extracting features: ") and "images (" in line]
    assert len(counts) >= 2, lines
    total = int(counts[0].split("/")[1].split()[0])
    done = [int(line.split(": ")[1].split("/")[0]) for line in counts]
    assert done == sorted(done) and done[0] == 64 and total > done[-1]
    assert f"extracting features: {total} images done in " in "\n".join(lines)


def test_predict_reads_its_images_with_a_progress_callback_per_batch(tmp_path: Path) -> None:
    """``extract_features`` reports each batch it read, so predict can print lines in a log file. Kills: no
    report, or reports that do not add up to the files read."""
    paths = [tmp_path / f"{i}.png" for i in range(10)]
    seen: list[int] = []
    features = extract_features(torch.nn.Flatten(), paths, lambda path: torch.zeros(1, 2, 2), torch.device("cpu"),
                                batch_size=4, progress=seen.append)
    assert features.shape == (10, 4) and seen == [4, 4, 2]


@pytest.mark.parametrize("terminal", [True, False])
def test_the_lines_replace_the_bar_only_where_no_bar_is_drawn(monkeypatch, terminal: bool) -> None:
    """On a terminal the extraction bar is drawn and no line printed; elsewhere the other way round. Kills: lines
    printed under a live bar (fragments), or neither."""
    from types import SimpleNamespace

    from lightning_putm.evaluation.progress import ExtractionBar

    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: terminal)
    lines: list[str] = []
    bar = ExtractionBar(lines.append)
    loader = SimpleNamespace(dataset=list(range(8)))
    trainer = SimpleNamespace(num_test_batches=[4], test_dataloaders=loader, is_global_zero=True)
    bar._trainer = trainer
    bar.test_progress_bar = bar.init_test_tqdm()
    monkeypatch.setattr(ExtractionBar, "total_test_batches_current_dataloader", property(lambda self: 4))
    monkeypatch.setenv("LIGHTNING_PUTM_PROGRESS_SECONDS", "0")
    bar.on_test_batch_start(trainer, None, [torch.zeros(2, 1)], 0)
    assert (bar._lines is None) == terminal and bar.test_progress_bar.disable != terminal
    bar.test_progress_bar.close()


def test_predicts_calibration_says_its_cost_before_it_starts_and_reports_progress_in_a_log(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    """Before the fit: how many tasks in how many chunks, that it is paid once, how to make it cheaper or skip it;
    after the first chunk the time all chunks will take; where no bar is drawn, progress lines over the tasks.
    Kills: a fit that starts without a word (the issue's 8 silent minutes), no estimate, an estimate that ignores
    the chunks still to come, a fit silent in a log file."""
    from conftest import make_clustered_features
    from lightning_putm.features.files import save_features
    from lightning_putm.methods import build_method
    from lightning_putm.prediction.checkpoint_splits import resolve_calibration
    from lightning_putm.prediction.settings import load_predict_config, predict_settings

    monkeypatch.setenv("LIGHTNING_PUTM_PROGRESS_SECONDS", "0")
    features = save_features(make_clustered_features(classes=8, per_class=20, dim=8, spread=0.8), tmp_path / "v.pt")
    cfg, name = load_predict_config(["checkpoint=x.ckpt", "support=s", "query=q", "method=simpleshot",
                                     f"calibration={features}", "calibration_tasks=60",
                                     f"feature_cache_dir={tmp_path / 'cache'}", "device=cpu"])
    settings = predict_settings(cfg, name)
    method = build_method("simpleshot", settings.method_params, shots=1, balanced=False)
    lines: list[str] = []
    resolve_calibration(settings, method, 5, 1, 15, "", lines.append)
    cost = next(i for i, line in enumerate(lines) if line.startswith("calibration: simpleshot on 60 labelled tasks"))
    assert "3 chunks of up to 25 tasks" in lines[cost] and "the temperature is cached" in lines[cost]
    assert "fewer calibration_tasks cost less" in lines[cost] and "calibration=null" in lines[cost]
    after = lines[cost + 1:]
    first = next(line for line in after if "the first" in line)
    taken, total = (progress_seconds(t) for t in re.search(r"in (\d+:\d\d): about (\d+:\d\d) in all", first).groups())
    assert first.startswith("calibration tasks: the first 25 of 60 in ") and abs(total - taken * 60 / 25) <= 1
    counted = [line for line in after if line.startswith("calibration tasks: ") and "tasks (" in line]
    assert counted[0].startswith("calibration tasks: 25/60 tasks (42%)")
    assert any(line.startswith("calibration tasks: 60 tasks done in ") for line in after)


def progress_seconds(text: str) -> int:
    minutes, seconds = text.split(":")
    return 60 * int(minutes) + int(seconds)


# ------------------------------------------------------------------------------- a long setting: a heartbeat
def test_a_long_setting_gets_a_line_every_interval_and_none_after_it_ends() -> None:
    """While one setting is solved (one chunk: nothing else reports), a background line every interval names the
    setting, the tasks done so far and the elapsed time; none comes after the work ends. Kills: no heartbeat (a
    log silent for a whole PUTM setting), a thread that outlives the setting (lines in the next one's place), a
    line without the tasks done."""
    import threading

    from lightning_putm.evaluation.progress import Heartbeat

    lines: list[str] = []
    enough = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if len(lines) >= 3:
            enough.set()

    with Heartbeat("setting 2/6 putm 1-shot alpha=2", log, total=1000, done=lambda: 250, every_seconds=0.01):
        assert enough.wait(30), lines  # the work goes on until three lines came
    after = len(lines)
    threading.Event().wait(0.1)
    assert len(lines) == after >= 3
    assert all(re.fullmatch(r"setting 2/6 putm 1-shot alpha=2: solving, 250/1000 tasks done, elapsed \d+:\d\d", line)
               for line in lines), lines


def test_a_setting_done_within_the_interval_gets_no_heartbeat() -> None:
    """Kills: a line at the start or the end of every setting (the finished-setting line says it already)."""
    from lightning_putm.evaluation.progress import Heartbeat

    lines: list[str] = []
    with Heartbeat("setting 1/1 simpleshot 1-shot alpha=2", lines.append, total=10, every_seconds=60):
        pass
    assert lines == []


@pytest.mark.parametrize("progress", [True, False])
def test_evaluate_prints_heartbeat_lines_of_a_long_setting_into_a_log(tmp_path: Path, monkeypatch, progress,
                                                                      single_thread) -> None:
    """``evaluate.py`` into a log (no terminal), the interval at its shortest: PUTM's setting, solved in one chunk,
    prints ``solving, 0/4 tasks done`` lines before its finished-setting line, through the run's own log; with
    ``progress=false`` none. Kills: the heartbeat only on a terminal or never started by the runner, lines that
    bypass the run's log, a heartbeat that ignores ``progress=false``."""
    from conftest import make_clustered_features
    from lightning_putm.features.files import save_features

    monkeypatch.setenv("LIGHTNING_PUTM_PROGRESS_SECONDS", "0")
    features = save_features(make_clustered_features(classes=8, per_class=25, dim=16), tmp_path / "f.pt")
    lines: list[str] = []
    run_evaluate([f"features={features}", f"output_dir={tmp_path / 'out'}", "methods=[putm]", "tasks=4",
                  "shots=[1]", "alphas=[2]", "ways=3", "queries=9", "logger=none", "plots=false",
                  f"progress={str(progress).lower()}", "method.putm.em_steps=10", "method.putm.inner_steps=100"],
                 log=lines.append)
    beats = [i for i, line in enumerate(lines) if line.startswith("setting 1/1 putm 1-shot alpha=2: solving, ")]
    finished = [i for i, line in enumerate(lines) if line.startswith("setting 1/1 putm 1-shot alpha=2: ") and "%" in line]
    if progress:
        assert beats and finished and max(beats) < finished[0], lines
        assert all(", 0/4 tasks done, elapsed " in lines[i] for i in beats)
    else:
        assert beats == [] and finished == [], lines
