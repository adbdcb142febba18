"""W&B runs that behave like W&B (issue 43): real offline runs, read back from their ``.wandb`` files.

* ``train_backbone.py logger=wandb`` exits 0 and its final test score is in the last stage's run (and in the CSV
  log with ``logger=csv``);
* a resumed job continues the same W&B run id: training ``resume=true`` (each stage its own run), ``evaluate.py``
  into the same ``output_dir``, a study's interrupted run when the study is run again; a new folder is a new run;
* an evaluation's ``results.csv`` and ``per_task.csv`` are an artifact of its run, and the evaluations of one
  checkpoint share a W&B group.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from helpers.cli import FAST_EVAL, FAST_TRAIN, run_in_process
from lightning_putm.evaluation.settings import checkpoint_run_name
from lightning_putm.jobs.evaluate import run_evaluate
from lightning_putm.jobs.study import run_study
from lightning_putm.loggers import WANDB_RUN_FILE
from wandb_records import artifacts, history, records, run_record

pytest.importorskip("wandb")
pytestmark = pytest.mark.usefixtures("single_thread")

#: Two stages (the digits recipe: rotation, then s2m2r), one batch each, a 5-task test.
TRAIN = [a for a in FAST_TRAIN if a not in ("logger=none", "run_test=false")] + ["logger=wandb"]
#: One evaluation setting on two tasks, logged to W&B.
EVAL = [a for a in FAST_EVAL if a != "logger=none"] + ["logger=wandb"]


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline and quiet; its artifact staging and cache in the test's folder, no run id from outside."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    for name in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)


def offline_runs(save_dir: Path) -> list[Path]:
    """Every offline run under ``save_dir/wandb``, oldest first (a resumed run is a second folder, same id). By the
    run's recorded start time: the folders' names hold whole seconds, and two runs of these small jobs often start
    in the same second (the names then sort by run id, at random)."""
    return sorted((save_dir / "wandb").glob("offline-run-*"), key=lambda run: run_record(run)["start_time"])


def logged(run: Path, key: str) -> list[float]:
    return [row[key] for row in history(run) if key in row]


def md5(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


# ------------------------------------------------------------------------------------------- pretraining
def test_pretraining_with_wandb_exits_0_with_the_test_score_in_the_last_stages_run(tmp_path: Path) -> None:
    """Kills: the last stage's W&B run finished before ``trainer.test`` (W&B's ``UsageError: Run is finished``,
    exit status 1, no test score); the test logged into a run of its own or into the first stage's run; the
    printed score not the logged one."""
    outcome = run_in_process("train_backbone", [*TRAIN, f"checkpoint_dir={tmp_path / 'ck'}",
                                                f"log_dir={tmp_path / 'logs'}", f"wandb.dir={tmp_path}"])
    assert outcome.returncode == 0, outcome.stderr
    runs = {run_record(run)["job_type"]: run for run in offline_runs(tmp_path)}
    assert sorted(runs) == ["train-rotation", "train-s2m2r"]  # one run per stage, none for the test
    assert logged(runs["train-rotation"], "test/acc") == []
    [accuracy], [ci95] = logged(runs["train-s2m2r"], "test/acc"), logged(runs["train-s2m2r"], "test/ci95")
    printed = re.search(r"nearest class mean: ([\d.]+) ± ([\d.]+)%", outcome.stdout)
    assert printed is not None, outcome.stdout
    assert (round(accuracy, 2), round(ci95, 2)) == (float(printed[1]), float(printed[2]))
    for run in runs.values():  # finished runs: W&B wrote their exit record
        assert any(r.WhichOneof("record_type") == "exit" for r in records(run))


def test_pretraining_with_csv_writes_the_test_score_into_the_last_stages_log(tmp_path: Path) -> None:
    """Kills: the last stage's CSV logger closed or replaced before the test (the score printed, not logged)."""
    outcome = run_in_process("train_backbone", [*[a for a in TRAIN if a != "logger=wandb"], "logger=csv",
                                                "stages=[classifier]", f"checkpoint_dir={tmp_path / 'ck'}",
                                                f"log_dir={tmp_path / 'logs'}"])
    assert outcome.returncode == 0, outcome.stderr
    [metrics] = (tmp_path / "logs").glob("digits/conv4/*/classifier/metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("test/acc")]
    assert len(rows) == 1 and float(rows[0]["test/ci95"]) > 0


def test_resumed_pretraining_continues_each_stages_wandb_run_and_a_fresh_start_is_a_new_run(tmp_path: Path) -> None:
    """``resume=true`` logs each stage into the W&B run it had (its id kept in the run folder), the test score
    into the resumed last stage; a stage started afresh in the same folder (no ``resume=true``) is a new run.

    Kills: a resumed stage started as a new W&B run (a new id: duplicates in the project); the stages' ids
    swapped or shared; the id file ignored or written only at the end; a fresh start continuing the old runs."""
    common = [*TRAIN, f"checkpoint_dir={tmp_path / 'ck'}", f"log_dir={tmp_path / 'logs'}", f"wandb.dir={tmp_path}",
              "run=mine"]
    assert run_in_process("train_backbone", [*common, "run_test=false"]).returncode == 0
    first = {run_record(run)["job_type"]: run_record(run) for run in offline_runs(tmp_path)}
    folder = tmp_path / "ck" / "digits" / "conv4" / "mine"
    for stage in ("rotation", "s2m2r"):
        assert json.loads((folder / f"wandb_run-{stage}.json").read_text())["id"] == first[f"train-{stage}"]["id"]
    assert first["train-rotation"]["id"] != first["train-s2m2r"]["id"]

    resumed = run_in_process("train_backbone", [*common, "resume=true", "trainer.max_epochs=2"])
    assert resumed.returncode == 0, resumed.stderr
    later = offline_runs(tmp_path)[2:]  # W&B writes a resumed run offline as a second folder with the same id
    again = {run_record(run)["job_type"]: (run_record(run), run) for run in later}
    assert sorted(again) == ["train-rotation", "train-s2m2r"]
    for job, (record, run) in again.items():
        assert record["id"] == first[job]["id"] and record["display_name"] == first[job]["display_name"]
        assert 1 in logged(run, "epoch")  # the second epoch went to the same run
    assert len(logged(again["train-s2m2r"][1], "test/acc")) == 1

    # the folder as a run killed before its first checkpoint leaves it: started again without resume=true
    for stage in ("rotation", "s2m2r"):
        shutil.rmtree(folder / stage)
    fresh = run_in_process("train_backbone", [*common, "stages=[rotation]", "run_test=false"])
    assert fresh.returncode == 0, fresh.stderr
    [new] = offline_runs(tmp_path)[4:]
    assert run_record(new)["id"] not in {first["train-rotation"]["id"], first["train-s2m2r"]["id"]}
    assert json.loads((folder / "wandb_run-rotation.json").read_text())["id"] == run_record(new)["id"]


# ------------------------------------------------------------------------------------------- evaluation
def test_evaluate_into_the_same_output_dir_continues_its_wandb_run_and_a_new_folder_is_a_new_run(tmp_path):
    """Kills: a re-run into the same ``output_dir`` (a resume: every setting read back) started as a new W&B
    run, or renamed (a named folder's W&B name carries the time of its first run); the id kept anywhere but the
    folder (another folder's run continued)."""
    wandb_dir = tmp_path / "w"
    for folder in ("same", "same", "other"):
        run_evaluate([*EVAL, f"output_dir={tmp_path / folder}", f"wandb.dir={wandb_dir}"], log=lambda _: None)
    first, second, other = (run_record(run) for run in offline_runs(wandb_dir))
    assert first["id"] == second["id"] and first["display_name"] == second["display_name"]
    assert other["id"] != first["id"]
    assert second["config"]["output_dir"] == str(tmp_path / "same")
    assert (tmp_path / "same" / WANDB_RUN_FILE).is_file() and (tmp_path / "other" / WANDB_RUN_FILE).is_file()


def test_evaluation_results_are_an_artifact_and_evaluations_of_one_checkpoint_share_a_group(tiny_checkpoint,
                                                                                           tmp_path):
    """Kills: the CSVs not logged (or logged before they were written: an old or empty file), a missing one,
    the artifact named after the display name (shared by runs); no group, or a group per run; ``wandb.group``
    not winning."""
    base = [*EVAL, f"checkpoint={tiny_checkpoint}", "data=digits", "base_features=null",
            f"feature_cache_dir={tmp_path / 'cache'}", f"wandb.dir={tmp_path / 'w'}"]
    for folder, extra in (("a", []), ("b", []), ("c", ["wandb.group=mine"])):
        run_evaluate([*base, f"output_dir={tmp_path / folder}", *extra], log=lambda _: None)
    runs = offline_runs(tmp_path / "w")
    a, b, c = (run_record(run) for run in runs)
    assert a["group"] == b["group"] == checkpoint_run_name(tiny_checkpoint) and a["id"] != b["id"]
    assert c["group"] == "mine"
    [artifact] = [x for x in artifacts(runs[0]) if x["type"] == "evaluation-results"]  # W&B tables are ones too
    assert artifact["name"] == f"results-{a['id']}"
    out = tmp_path / "a"
    assert artifact["files"] == {"results.csv": md5(out / "results.csv"), "per_task.csv": md5(out / "per_task.csv")}


# ------------------------------------------------------------------------------------------- studies
SWEEP = {
    "program": "evaluate.py", "name": "wb", "method": "grid",
    "metric": {"name": "fewshot/simpleshot/acc", "goal": "maximize"},
    "parameters": {
        "alphas": {"values": [2]}, "methods": {"value": "[simpleshot]"}, "shots": {"value": 1},
        "tasks": {"value": 2}, "logger": {"value": "wandb"}, "plots": {"value": False},
        "progress": {"value": False},
    },
}


def test_a_study_run_again_after_an_interruption_continues_the_runs_wandb_run(tmp_path):
    """A study stopped in the middle of a run (Ctrl-C after its results were written): run again, it solves that
    point again in the same run folder and logs into the same W&B run.

    Kills: the re-run of the point as a new W&B run (a new id: two runs of one point in the study's group)."""
    sweep = tmp_path / "wb.yaml"
    sweep.write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    argv = [str(sweep), "--dir", str(tmp_path / "study"), f"wandb.dir={tmp_path / 'w'}"]

    def interrupted(args: list[str]):
        def log(line: str) -> None:
            if line.startswith("wrote results"):
                raise KeyboardInterrupt
        return run_evaluate(args, log=log)

    with pytest.raises(KeyboardInterrupt, match="re-run the same command to resume"):
        run_study(argv, log=lambda _: None, run=interrupted)
    run_study(argv, log=lambda _: None)
    first, second = (run_record(run) for run in offline_runs(tmp_path / "w"))
    assert first["id"] == second["id"] and first["group"] == second["group"] == "wb"
