"""The few-shot callback in a user's own Trainer: keyword arguments checked as evaluate.py checks them, any module
whose step returns features and labels (dict or tuple, indices optional, no datamodule), one-line errors at the
first batch, every logger (CSV, W&B offline), and the docs page's example, executed."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO_ROOT, make_clustered_features
from lightning_putm.errors import ConfigError, FeatureError
from lightning_putm.evaluation.callback import FewShotEvaluationCallback
from lightning_putm.evaluation.keywords import CALLBACK_KEYS, NOT_CALLBACK_KEYS
from lightning_putm.evaluation.runner import evaluate_features
from lightning_putm.evaluation.settings import load_evaluate_config, settings_from_config
from lightning_putm.features.extraction import FeatureCollector
from lightning_putm.features.files import FeatureSet

pl = pytest.importorskip("pytorch_lightning")

DOC = REPO_ROOT / "docs" / "callback.md"
#: Small and cheap: SimpleShot only, a few tasks, no figures, no bar.
CHEAP = dict(methods=["simpleshot"], shots=[1], alphas=[2, "balanced"], tasks=4, plots=False, progress=False)


class Rows(pl.LightningModule):
    """A user's module: ``test_step`` returns the batch's features as ``kind`` says (dict / tuple / loss)."""

    def __init__(self, kind: str = "dict") -> None:
        super().__init__()
        self.kind = kind
        self.steps = 0
        self.scale = torch.nn.Parameter(torch.ones(()))  # features carry an autograd graph when grad is on

    def test_step(self, batch, batch_idx):
        self.steps += 1
        features, labels, indices = batch
        features = features * self.scale
        if self.kind == "tuple":
            return features, labels
        if self.kind == "dict":
            return {"features": features, "labels": labels}
        if self.kind == "indexed":
            return {"features": features, "labels": labels, "indices": indices}
        return features.sum()  # a loss: not what the callback can use

    validation_step = test_step


def loader(rows: FeatureSet, shuffle: bool = False, labels: torch.Tensor | None = None) -> DataLoader:
    labels = rows.labels if labels is None else labels
    dataset = TensorDataset(rows.features, labels, torch.arange(len(rows)))
    return DataLoader(dataset, batch_size=64, shuffle=shuffle, generator=torch.Generator().manual_seed(1))


def run_test(module: pl.LightningModule, data: DataLoader, callback: FewShotEvaluationCallback, tmp_path: Path,
             logger=False) -> pl.Trainer:
    trainer = pl.Trainer(logger=logger, callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=str(tmp_path))
    trainer.test(module, data, verbose=False)
    return trainer


def accuracies(callback: FewShotEvaluationCallback) -> list[torch.Tensor]:
    return [result.accuracies for result in callback.results]


def test_a_tuple_or_a_dict_without_indices_and_no_datamodule_give_evaluate_features_results(tmp_path):
    """Labels 5..9 (no datamodule to name them) become classes "5".."9", rows in the loader's order.

    Kills: labels and features swapped in a tuple; labels not mapped to 0..C-1 (FeatureSet refuses 5..9); class
    names other than the label values; rows reordered; a datamodule required (trainer.datamodule is None here)."""
    clustered = make_clustered_features(classes=5, per_class=30, dim=16, spread=0.8)
    labels = clustered.labels + 5
    expected_set = FeatureSet(clustered.features, clustered.labels, ["5", "6", "7", "8", "9"])
    for kind in ("tuple", "dict"):
        callback = FewShotEvaluationCallback(**CHEAP, output_dir=tmp_path / kind)
        run_test(Rows(kind), loader(clustered, labels=labels), callback, tmp_path)
        expected = evaluate_features(expected_set, callback.settings, log=lambda _: None, progress=False)
        assert all(torch.equal(a, b.accuracies) for a, b in zip(accuracies(callback), expected, strict=True)), kind
        assert (tmp_path / kind / "results.csv").is_file() and (tmp_path / kind / "config.yaml").is_file()


def test_indices_place_the_rows_of_a_shuffled_loader_where_they_belong(tmp_path):
    """With indices, a shuffled test loader gives the same table (so the same tasks and accuracies) as an ordered one.

    Kills: indices ignored without a datamodule (the rows would follow the shuffle)."""
    clustered = make_clustered_features(classes=5, per_class=30, dim=16, spread=0.8)
    ordered = FewShotEvaluationCallback(**CHEAP, output_dir=tmp_path / "ordered")
    run_test(Rows("indexed"), loader(clustered), ordered, tmp_path)
    shuffled = FewShotEvaluationCallback(**CHEAP, output_dir=tmp_path / "shuffled")
    run_test(Rows("indexed"), loader(clustered, shuffle=True), shuffled, tmp_path)
    unplaced = FewShotEvaluationCallback(**CHEAP, output_dir=tmp_path / "unplaced")
    run_test(Rows("dict"), loader(clustered, shuffle=True), unplaced, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(accuracies(ordered), accuracies(shuffled), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(accuracies(ordered), accuracies(unplaced), strict=True))


def test_a_step_that_returns_something_else_stops_at_the_first_batch_with_one_line(tmp_path):
    """Kills: the check left to the epoch's end (steps would be 3), or a message that does not say what to return."""
    clustered = make_clustered_features(classes=5, per_class=30, dim=16, spread=0.8)  # 150 rows: 3 batches
    module = Rows("loss")
    with pytest.raises(FeatureError) as error:
        run_test(module, loader(clustered), FewShotEvaluationCallback(**CHEAP, output_dir=tmp_path / "out"), tmp_path)
    message = str(error.value)
    assert module.steps == 1
    assert "\n" not in message
    assert message.startswith("Rows.test_step must return {'features': [B, d] float tensor, 'labels': [B] integer "
                              "tensor}")
    assert "(features, labels) tuple" in message and "returned a float32 tensor of shape []" in message
    assert not (tmp_path / "out").exists()


def test_feature_maps_and_float_labels_are_named():
    """Kills: a 4-D feature map or float labels accepted (they would fail later, far from the cause)."""
    collector, trainer = FeatureCollector(), types.SimpleNamespace(world_size=1)
    module = Rows()
    with pytest.raises(FeatureError, match=r"'features' must be a \[B, d\] float tensor .* features.flatten\(1\)"):
        collector.collect(trainer, module, (torch.rand(4, 1, 8, 8), torch.arange(4)))
    with pytest.raises(FeatureError, match=r"'labels' must be a \[B\] integer tensor"):
        collector.collect(trainer, module, {"features": torch.rand(4, 3), "labels": torch.rand(4)})


def test_collected_rows_hold_no_graph_and_live_on_the_cpu():
    """Kills: a collector that keeps the step's tensors as returned (their autograd graph, their device memory)."""
    collector = FeatureCollector()
    weight = torch.ones(3, requires_grad=True)
    collector.collect(types.SimpleNamespace(world_size=1), Rows(), {"features": torch.rand(4, 3) * weight,
                                                                     "labels": torch.arange(4)})
    [rows] = collector._outputs
    assert not rows.features.requires_grad and rows.features.grad_fn is None
    assert rows.features.device.type == "cpu" and rows.indices is None


def test_several_processes_without_indices_and_mixed_batches_are_refused():
    """Kills: rows of padded DDP shards concatenated in arrival order; batches with and without indices mixed."""
    batch = {"features": torch.rand(4, 3), "labels": torch.arange(4)}
    with pytest.raises(FeatureError, match="returns no 'indices' but runs on 2 processes"):
        FeatureCollector().collect(types.SimpleNamespace(world_size=2), Rows(), batch)
    collector = FeatureCollector()
    collector.collect(types.SimpleNamespace(world_size=1), Rows(), {**batch, "indices": torch.arange(4)})
    with pytest.raises(FeatureError, match="'indices' for some batches and not for others"):
        collector.collect(types.SimpleNamespace(world_size=1), Rows(), batch)


def test_a_bad_keyword_is_a_config_error_naming_it_before_any_folder(tmp_path, monkeypatch):
    """Kills: unknown keywords accepted (a typo silently evaluating 1000 tasks), evaluate.py-only keys accepted
    (ignored), a folder made at construction."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^FewShotEvaluationCallback: unknown argument `taks`; did you mean tasks\?"):
        FewShotEvaluationCallback(taks=3)
    with pytest.raises(ConfigError, match="did you mean every_n_val_epochs"):
        FewShotEvaluationCallback(every_n_val_epoch=1)
    with pytest.raises(ConfigError, match="`logger` is evaluate.py's; the callback logs through your Trainer"):
        FewShotEvaluationCallback(logger="csv")
    with pytest.raises(ConfigError, match=r"`every_n_val_epochs` must be an integer >= 1 \(or None: only at test "
                                          r"time\), got 0"):
        FewShotEvaluationCallback(every_n_val_epochs=0)
    with pytest.raises(ConfigError, match="not both"):
        FewShotEvaluationCallback(settings_from_config(load_evaluate_config([])), tasks=3)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("wrong", [{"tasks": 0}, {"alphas": [0]}, {"shots": [0]}, {"methods": ["ptum"]},
                                   {"ways": 1}, {"plot_task": 9, "tasks": 3}, {"method_params": {"putm": {"rho": "x"}}},
                                   {"method_params": {"putm": {"rhoo": 1}}}, {"memory_budget_mb": -1}])
def test_a_wrong_value_gets_evaluate_pys_own_message(wrong):
    """The callback's checks are evaluate.py's (settings_from_config), word for word.

    Kills: a second copy of the checks that drifts from evaluate.py's, or a value that evaluate.py refuses taken."""
    overrides = [f"{key}={value}".replace("'", "") for key, value in wrong.items() if key != "method_params"]
    overrides += [f"method.{m}.{k}={v}" for m, values in wrong.get("method_params", {}).items()
                  for k, v in values.items()]
    with pytest.raises(ConfigError) as from_evaluate:
        settings_from_config(load_evaluate_config(overrides))
    with pytest.raises(ConfigError) as from_callback:
        FewShotEvaluationCallback(**wrong)
    assert str(from_callback.value) == f"FewShotEvaluationCallback: {from_evaluate.value}"


def test_keywords_cover_evaluate_yaml_and_the_docs_table_has_its_defaults():
    """Every key of conf/evaluate.yaml is an argument or refused with a reason, and docs/callback.md's table lists
    the arguments with evaluate.yaml's defaults.

    Kills: a new evaluate.yaml key that the callback neither takes nor explains; a documented default that is not
    the one the callback uses."""
    yaml_defaults = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf" / "evaluate.yaml"))
    taken = {("method" if key == "method_params" else key) for key in CALLBACK_KEYS}
    assert taken | (set(NOT_CALLBACK_KEYS) - {"method"}) == set(yaml_defaults)
    assert not taken & (set(NOT_CALLBACK_KEYS) - {"method"})
    table = DOC.read_text().split("## Arguments", 1)[1].split("The callback's own arguments", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.MULTILINE)
    assert [name for name, _ in rows] == list(CALLBACK_KEYS)
    for name, default in rows:
        assert ast.literal_eval(default) == yaml_defaults["method" if name == "method_params" else name], name


def test_validation_checks_run_only_at_due_epochs_and_logs_reach_the_csv_logger(tmp_path):
    """every_n_val_epochs=2 over 3 epochs: one check (epoch 2), none in the sanity check; without it the validation
    outputs are never read (this module's validation step returns a loss).

    Kills: checks every epoch or in the sanity check; validation read when not asked (the loss would be an error);
    metrics not reaching the Trainer's logger; the plan and cost lines missing."""
    from pytorch_lightning.loggers import CSVLogger

    clustered = make_clustered_features(classes=5, per_class=30, dim=16, spread=0.8)

    class Trained(Rows):
        def training_step(self, batch, batch_idx):
            return (self.scale * batch[0]).sum() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    lines: list[str] = []
    callback = FewShotEvaluationCallback(**CHEAP, every_n_val_epochs=2, log=lines.append)
    trainer = pl.Trainer(max_epochs=3, logger=CSVLogger(str(tmp_path), name="run"), callbacks=[callback],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", num_sanity_val_steps=2)
    trainer.fit(Trained("indexed"), loader(clustered), loader(clustered))
    folder = tmp_path / "run" / "version_0" / "fewshot"
    assert sorted(p.name for p in folder.iterdir()) == ["val_epoch_0001"]
    metrics = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    column = header.index("val_fewshot/simpleshot/1shot/alpha_2/acc")
    logged = [(row.split(",")[header.index("epoch")], row.split(",")[column]) for row in metrics[1:]
              if row.split(",")[column]]
    assert len(logged) == 1 and logged[0][0] == "1"
    assert float(logged[0][1]) == pytest.approx(callback.results[0].summary().accuracy, abs=1e-3)
    assert lines[0].startswith("few-shot check after the validation of every 2 epochs (epochs 2, 4, ...): "
                               "simpleshot on shots [1] x alphas [2, balanced] x 4 tasks = 8 tasks per method")
    [timing] = [line for line in lines if line.startswith("few-shot check took")]
    assert "simpleshot" in timing and "the epoch before it" in timing

    quiet = FewShotEvaluationCallback(**CHEAP, output_dir=tmp_path / "quiet")
    trainer = pl.Trainer(max_epochs=1, logger=False, callbacks=[quiet], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Trained("loss"), loader(clustered), loader(clustered))
    assert not (tmp_path / "quiet").exists()


def test_a_checks_callback_and_a_test_callback_share_a_trainer_and_a_folder(tmp_path):
    """docs/callback.md's Costs: small validation checks in one callback, the test in another, same output_dir.

    Kills: instances sharing collected rows; the test's clean-up of stale files deleting the checks' folders; the
    checks' callback evaluating the test loop despite run_at_test=False."""
    clustered = make_clustered_features(classes=5, per_class=30, dim=16, spread=0.8)

    class Trained(Rows):
        def training_step(self, batch, batch_idx):
            return (self.scale * batch[0]).sum() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    folder = tmp_path / "fewshot"
    checks = FewShotEvaluationCallback(**{**CHEAP, "tasks": 2}, every_n_val_epochs=1, run_at_test=False,
                                       output_dir=folder)
    final = FewShotEvaluationCallback(**CHEAP, output_dir=folder)
    trainer = pl.Trainer(max_epochs=1, logger=False, callbacks=[checks, final], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    model = Trained("indexed")
    trainer.fit(model, loader(clustered), loader(clustered))
    trainer.test(model, loader(clustered), verbose=False)
    assert [r.accuracies.numel() for r in checks.results] == [2, 2]  # its validation check, not the test
    assert [r.accuracies.numel() for r in final.results] == [4, 4]
    assert (folder / "results.csv").is_file() and (folder / "val_epoch_0000" / "results.csv").is_file()


def test_the_count_of_later_checks_follows_the_validation_schedule():
    """Kills: an off-by-one in the remaining checks the cost line promises (epochs counted from 1)."""
    callback = FewShotEvaluationCallback(**CHEAP, every_n_val_epochs=2)
    trainer = types.SimpleNamespace(max_epochs=10, current_epoch=1, check_val_every_n_epoch=1)
    assert callback._later_checks(trainer) == 4  # epochs 4, 6, 8, 10
    trainer.check_val_every_n_epoch = 4
    assert callback._later_checks(trainer) == 2  # epochs 4, 8


def test_a_users_wandb_logger_receives_the_fewshot_metrics(tmp_path, monkeypatch):
    """The user's own WandbLogger (offline): the run's history holds every (method, shot, α) accuracy.

    Kills: metrics sent only to evaluate.py's own logger, or to the CSV logger alone."""
    from pytorch_lightning.loggers import WandbLogger
    from wandb_records import history, offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    clustered = make_clustered_features(classes=5, per_class=30, dim=16, spread=0.8)
    callback = FewShotEvaluationCallback(**CHEAP, output_dir=tmp_path / "out")
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="callback-test")
    try:
        run_test(Rows("tuple"), loader(clustered), callback, tmp_path, logger=logger)
    finally:
        logger.experiment.finish()
    logged = {key: value for row in history(offline_run(tmp_path)) for key, value in row.items()}
    for result in callback.results:
        summary = result.summary()
        key = f"fewshot/simpleshot/1shot/alpha_{summary.alpha_label}/acc"
        assert logged[key] == pytest.approx(summary.accuracy, abs=1e-3)
    assert "fewshot/simpleshot/acc" in logged  # evaluate.py's W&B extras too


def test_the_docs_example_runs_and_logs_during_fit_and_test(tmp_path, monkeypatch):
    """The python block of docs/callback.md, run as written but with EPOCHS, TASKS = 1, 2 and SimpleShot alone.

    Kills: a docs example that no longer runs; val_fewshot/... missing from the CSVLogger during fit; fewshot/...
    missing at test; files not where the page says."""
    [code] = [block for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
              if "EPOCHS, TASKS =" in block]
    code, count = re.subn(r"^EPOCHS, TASKS = \d+, \d+", "EPOCHS, TASKS = 1, 2", code, flags=re.MULTILINE)
    assert count == 1
    code, count = re.subn(r'methods=\["putm", "simpleshot"\]', 'methods=["simpleshot"], plots=False', code)
    assert count == 1  # PUTM is seconds per task on a busy CPU; the page's own run is measured in its Costs
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})
    version = tmp_path / "outputs" / "my_cnn" / "version_0"
    header = (version / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "val_fewshot/simpleshot/5shot/alpha_balanced/acc" in header
    assert "fewshot/simpleshot/1shot/alpha_2/acc" in header
    assert (version / "fewshot" / "results.csv").is_file()
    assert (version / "fewshot" / "val_epoch_0000" / "per_task.csv").is_file()
