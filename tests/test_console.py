"""What evaluate.py and a study print: bars only on a terminal, plain progress lines in a pipe, a short "wrote" line,
W&B's banner silenced but for one line saying where the run is, and a study's ``run i/N ... elapsed, ETA``."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lightning_putm.evaluation.runner as runner
from lightning_putm.evaluation.progress import Eta, format_duration
from lightning_putm.evaluation.report import wrote_line
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.study import run_study
from lightning_putm.loggers import WANDB_LINE, console

#: Two settings on the demo features; progress left at its default (true).
EVAL = ["methods=[simpleshot]", "shots=[1]", "alphas=[2,balanced]", "tasks=3", "logger=none"]


def evaluate_captured(args: list[str]) -> tuple[str, str]:
    """``run_evaluate`` printing the way the script does, with stdout and stderr captured (not terminals)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        run_evaluate(args, log=print)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    return tmp_path


def test_piped_output_has_no_bar_fragments_but_a_line_per_setting_and_a_short_wrote_line(workdir):
    stdout, stderr = evaluate_captured([*EVAL, "output_dir=out"])
    both = stdout + stderr
    assert "\r" not in both and "\x1b[" not in both  # no redraws, no cursor movement
    assert "Testing" not in both and "tasks:" not in both  # neither Lightning's test-loop bar nor ours
    lines = stdout.splitlines()
    settings = [line for line in lines if line.startswith("setting ")]
    assert len(settings) == 2, lines
    assert re.fullmatch(r"setting 1/2 simpleshot 1-shot alpha=2: \d+\.\d\d% \(3 tasks, \d+\.\d s\); "
                        r"elapsed \d+:\d\d, ETA \d+:\d\d", settings[0]), settings[0]
    assert settings[1].startswith("setting 2/2 simpleshot 1-shot alpha=balanced: ")
    table = lines.index(next(line for line in lines if line.startswith("method ")))
    assert table > lines.index(settings[1])  # the table comes after the progress, in one piece
    wrote = [line for line in lines if line.startswith("wrote ")]
    assert wrote == ["wrote results to out/ (results.csv, per_task.csv, config.yaml, 1 figure in plots/)"]


def test_on_a_terminal_the_tasks_bar_shows_the_time_left_and_no_plain_lines(workdir, monkeypatch):
    monkeypatch.setattr(runner, "on_terminal", lambda stream=None: True)
    stdout, stderr = evaluate_captured([*EVAL, "output_dir=out", "plots=false"])
    assert "tasks: 100%" in stderr and "6/6" in stderr
    # the time left is ours, paced by method, in the postfix beside the setting; tqdm's one-rate estimate is gone
    assert re.search(r"simpleshot 1-shot alpha=balanced, ETA \d+:\d\d\]", stderr), stderr[-500:]
    assert "<" not in stderr
    # each setting is named as it starts, before its first chunk ends (a GPU may solve it in one): the first
    # before anything is timed, the second at the first's tasks
    assert re.search(r"0/6 \[[^\]]*simpleshot 1-shot alpha=2, ETA unknown\]", stderr), stderr[-800:]
    assert re.search(r"3/6 \[[^\]]*simpleshot 1-shot alpha=balanced, ETA \d+:\d\d\]", stderr), stderr[-800:]
    assert not [line for line in stdout.splitlines() if line.startswith("setting ")]
    assert "Testing" not in stdout + stderr


def test_progress_false_prints_neither_bar_nor_lines(workdir):
    stdout, stderr = evaluate_captured([*EVAL, "output_dir=out", "plots=false", "progress=false"])
    assert "tasks:" not in stderr and not [line for line in stdout.splitlines() if line.startswith("setting ")]


def test_the_eta_comes_from_the_settings_solved_not_from_those_read_back():
    now = [0.0]
    eta = Eta(4, clock=lambda: now[0])
    assert eta.text() == "elapsed 0:00, ETA unknown"
    eta.advance(1, solved=False)  # a resumed setting: instant
    now[0] = 10.0
    eta.advance(1)  # one solved in 10 s, two left
    assert eta.left == pytest.approx(20.0)
    assert eta.text() == "elapsed 0:10, ETA 0:20"
    assert format_duration(3725) == "1:02:05" and format_duration(59.6) == "1:00"


def test_each_setting_left_is_paced_by_its_own_method():
    """One slow method and one fast one, alternating: right after the slow one, only one slow setting is left.
    Kills one pace for all kinds (it says 20 s there, twice the time left) and a kind's time taken from the wrong
    interval."""
    now = [0.0]
    eta = Eta(6, clock=lambda: now[0], kinds=["putm", "simpleshot"] * 3)
    now[0] = 10.0
    eta.advance(1)  # putm: 10 s; simpleshot not seen yet, so paced like everything so far
    assert eta.left == pytest.approx(10.0 + 10.0 + 10.0 + 10.0 + 10.0)
    eta.advance(1)  # simpleshot: 0 s
    assert eta.left == pytest.approx(20.0)
    now[0] = 20.0
    eta.advance(1)  # putm again: one putm and two simpleshot settings left
    assert eta.left == pytest.approx(10.0)
    with pytest.raises(ValueError, match="3 kinds for 2 units"):
        Eta(2, kinds=["a", "b", "c"])


def test_within_a_setting_the_bar_paces_its_rest_by_itself_and_the_settings_after_by_their_methods():
    """Kills: the current setting paced by its method's mean instead of its own progress, the settings after it
    paced by one rate, a setting at its start not paced by its method."""
    now = [0.0]
    eta = Eta(4, clock=lambda: now[0], kinds=["putm", "simpleshot", "putm", "simpleshot"])
    assert eta.left_in_unit(0.0) is None  # nothing to time yet
    now[0] = 5.0
    assert eta.left_in_unit(0.5) == pytest.approx(5.0 + 3 * 10.0)  # this setting's own pace for all, before any
    now[0] = 10.0
    eta.advance(1)
    eta.advance(1)  # simpleshot: 0 s
    assert eta.left_in_unit(0.0) == pytest.approx(10.0)  # a putm setting starts: putm's pace, then simpleshot's 0
    now[0] = 15.0
    assert eta.left_in_unit(0.25) == pytest.approx(15.0)  # a slower putm setting: its own pace decides


def test_a_resumed_setting_gives_its_kind_no_pace():
    """A setting read back from disk takes no time: its method's later settings are paced like all the others,
    not as free. Kills a resumed unit counted in its kind's pace."""
    now = [0.0]
    eta = Eta(4, clock=lambda: now[0], kinds=["putm", "simpleshot", "putm", "simpleshot"])
    eta.advance(1, solved=False)  # putm read back
    now[0] = 4.0
    eta.advance(1)  # simpleshot: 4 s
    assert eta.left == pytest.approx(4.0 + 4.0)


def test_settings_stored_on_disk_count_as_no_time_left():
    """A resumed run with most settings stored: only the ones still to solve are paced. Kills every setting left
    paced as if solved (here 40 s instead of 10 s; within the first setting 45 s instead of 15 s), and a stored
    flag taken from the wrong unit."""
    now = [0.0]
    eta = Eta(5, clock=lambda: now[0], kinds=["putm", "simpleshot"] * 2 + ["putm"],
              stored=[False, True, True, True, False])
    now[0] = 5.0
    assert eta.left_in_unit(0.5) == pytest.approx(5.0 + 10.0)  # its rest, then the last putm setting only
    now[0] = 10.0
    eta.advance(1)  # putm solved in 10 s; then three stored settings and one putm setting to solve
    assert eta.left == pytest.approx(10.0)
    for _ in range(3):
        eta.advance(1, solved=False)
    now[0] = 15.0
    assert eta.left_in_unit(0.5) == pytest.approx(5.0)  # the last one, half done at its own pace
    with pytest.raises(ValueError, match="1 stored flags for 2 units"):
        Eta(2, stored=[True])


@pytest.fixture
def made_etas(monkeypatch) -> list[Eta]:
    """Every Eta the evaluation runner makes, in order (to read the kinds and stored flags it was handed)."""
    made: list[Eta] = []

    class Recording(Eta):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(runner, "Eta", Recording)
    return made


def test_the_evaluation_tells_the_eta_which_settings_it_will_read_back(workdir, made_etas):
    """Run again into the same folder with one more method: the settings flagged stored are exactly the ones the
    run then reads back. Kills: no flags (every setting paced), flags in another order than the settings."""
    common = ["shots=[1,5]", "alphas=[2,balanced]", "tasks=3", "logger=none", "output_dir=out", "plots=false"]
    evaluate_captured(["methods=[simpleshot]", *common])
    stdout, _ = evaluate_captured(["methods=[protonet,simpleshot]", *common])
    read_back = ["read back" in line for line in stdout.splitlines() if line.startswith("setting ")]
    assert read_back == [False, True] * 4 and made_etas[1].stored == read_back


def test_the_evaluation_tells_the_eta_its_settings_in_the_order_it_solves_them(workdir, made_etas):
    """The kinds the runner hands over are the methods of its setting lines, in order (a wrong order paces every
    setting by another method's time)."""
    stdout, _ = evaluate_captured(["methods=[simpleshot,protonet]", "shots=[1,5]", "alphas=[2,balanced]", "tasks=3",
                                   "logger=none", "output_dir=out", "plots=false"])
    solved = [line.split()[2] for line in stdout.splitlines() if line.startswith("setting ")]
    assert len(solved) == 8 and made_etas[0].kinds == solved


def test_wrote_line_names_the_folder_once_and_counts_figures():
    folder = Path("outputs/evaluate/2026-01-01/10-00-00-demo")
    paths = {"results": folder / "results.csv", "per_task": folder / "per_task.csv", "config": folder / "config.yaml",
             "plot_accuracy_vs_alpha": folder / "plots/accuracy_vs_alpha.png",
             "plot_accuracy_vs_alpha_pdf": folder / "plots/accuracy_vs_alpha.pdf",
             "plot_putm_tsne": folder / "plots/putm_tsne.png", "plot_putm_tsne_pdf": folder / "plots/putm_tsne.pdf"}
    assert wrote_line(paths, folder) == (f"wrote results to {folder}/ (results.csv, per_task.csv, config.yaml, "
                                         "2 figures in plots/)")


def test_wandb_banner_is_silenced_and_one_line_says_where_the_offline_run_is(workdir, capfd):
    lines: list[str] = []
    run_evaluate([*EVAL, "output_dir=out", "plots=false", "progress=false", "logger=wandb"],
                 log=console(lambda line: (lines.append(line), print(line))))
    printed = capfd.readouterr()
    assert not [line for line in (printed.out + printed.err).splitlines() if line.startswith("wandb:")], printed.err
    [line] = [line for line in lines if line.startswith(WANDB_LINE)]
    run = re.fullmatch(rf"{re.escape(WANDB_LINE)} offline in (\S+) \(upload with `wandb sync (\S+)`\)", line)
    assert run and run.group(1) == run.group(2), line
    assert Path(run.group(1)).parent == Path("wandb") and (workdir / run.group(1)).is_dir()


def test_wandb_silent_false_keeps_wandbs_own_output(workdir):
    """Kills: silencing W&B whatever ``$WANDB_SILENT`` says. Run as the script, in a fresh process: W&B keeps
    process-wide state (its terminal streams, its settings singleton) that an earlier in-process run would set."""
    arguments = [a for a in EVAL if a != "logger=none"] + ["output_dir=out", "plots=false", "progress=false",
                                                          "logger=wandb"]
    script = Path(__file__).resolve().parents[1] / "evaluate.py"
    done = subprocess.run([sys.executable, str(script), *arguments], cwd=workdir, capture_output=True, text=True,
                          env={**os.environ, "WANDB_SILENT": "false", "WANDB_MODE": "offline"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wandb:" in done.stdout + done.stderr


def test_a_study_prints_run_i_of_n_with_elapsed_time_and_eta_and_where_each_wandb_run_is(workdir):
    fixed = [a for a in EVAL if a != "logger=none"] + ["plots=false", "logger=wandb"]
    spec = {"program": "evaluate.py", "name": "console", "method": "grid",
            "metric": {"name": "fewshot/simpleshot/acc", "goal": "maximize"},
            "parameters": {"seed": {"values": [0, 1, 2]},
                           **{k: {"value": v} for k, v in (a.split("=", 1) for a in fixed)}}}
    sweep = workdir / "console.yaml"
    sweep.write_text(yaml.safe_dump(spec, sort_keys=False))
    lines: list[str] = []
    run_study([str(sweep), "--dir", str(workdir / "study")], log=lines.append)
    done = [line for line in lines if " done in " in line]
    assert [line.split(" done")[0] for line in done] == [f"[console] run {i}/3" for i in (1, 2, 3)], lines
    for line in done:
        assert re.search(r"fewshot/simpleshot/acc = \d+\.\d\d; elapsed \d+:\d\d, ETA \d+:\d\d$", line), line
    assert done[-1].endswith("ETA 0:00")
    started = [line for line in lines if re.fullmatch(r"\[console\] run \d/3 seed-\d-\w+", line)]
    assert len(started) == 3
    # of each run's own output only the line telling where its W&B run is (W&B's banner is silenced)
    runs = [line for line in lines if line.startswith(WANDB_LINE)]
    assert len(runs) == 3 and len({line.split()[4] for line in runs}) == 3, runs
    assert all(line.startswith(("[console] ", "study console: ", WANDB_LINE)) for line in lines), lines


class _Probe:
    """A tiny test loop (``batches`` batches) run with :class:`ExtractionBar`; records whether the bar was still
    open when the epoch ended (where the few-shot evaluation runs and prints)."""

    def __init__(self, batches: int) -> None:
        import pytorch_lightning as pl
        import torch

        from lightning_putm.evaluation.progress import extraction_bar

        class Module(pl.LightningModule):
            def test_step(self, batch, batch_idx):
                return None

        probe = self

        class AtEpochEnd(pl.Callback):
            def on_test_epoch_end(self, trainer, pl_module):
                probe.open_at_epoch_end = not bar.test_progress_bar.disable

        [bar] = extraction_bar(True)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(batches, 1)), batch_size=1)
        self.err = io.StringIO()
        trainer = pl.Trainer(accelerator="cpu", logger=False, callbacks=[AtEpochEnd(), bar], enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir=".")
        with contextlib.redirect_stderr(self.err), contextlib.redirect_stdout(io.StringIO()):
            trainer.test(Module(), dataloaders=loader, verbose=False)


def test_extraction_bar_counts_batches_on_a_terminal_and_is_gone_before_the_evaluation(workdir, monkeypatch):
    import lightning_putm.evaluation.progress as progress

    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: True)
    probe = _Probe(batches=3)
    assert "extracting features" in probe.err.getvalue() and "3/3" in probe.err.getvalue()
    assert re.search(r"\d+ images/s", probe.err.getvalue())  # the backbone's throughput
    assert "Testing" not in probe.err.getvalue()
    assert probe.open_at_epoch_end is False
    assert _Probe(batches=1).err.getvalue() == ""  # a feature file replayed as one batch: no bar at all
    monkeypatch.setattr(progress, "on_terminal", lambda stream=None: False)
    assert _Probe(batches=3).err.getvalue() == ""  # in a pipe: no bar
