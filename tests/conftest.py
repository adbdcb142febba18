"""Shared fixtures: small synthetic feature sets with clear class structure (built in memory, no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_putm.features.files import FeatureSet

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
#: The environment variable that points the real-data tests at an Omniglot copy: the folder you would pass as
#: ``data.root=`` (it holds ``omniglot-py/images_background`` and ``omniglot-py/images_evaluation``).
OMNIGLOT_ENV = "LIGHTNING_PUTM_OMNIGLOT"


def real_omniglot_root() -> Path:
    """``$LIGHTNING_PUTM_OMNIGLOT``, else ``<checkout's parent>/shared/data/omniglot``; tests skip when absent."""
    configured = os.environ.get(OMNIGLOT_ENV)
    return Path(configured).expanduser() if configured else SHARED_DATA / "omniglot"


def omniglot_skip_reason(root: Path) -> str:
    return (f"real Omniglot not found at {root} (optional: set {OMNIGLOT_ENV} to the folder that holds "
            "omniglot-py/, the one you would pass as data.root=)")


def make_clustered_features(classes: int = 10, per_class: int = 40, dim: int = 32, spread: float = 0.15,
                            seed: int = 0) -> FeatureSet:
    """Non-negative (post-ReLU-like) features: one well-separated cluster per class."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.rand(classes, dim, generator=generator) * 2.0
    labels = torch.arange(classes).repeat_interleave(per_class)
    noise = spread * torch.randn(classes * per_class, dim, generator=generator)
    features = (centres[labels] + noise).clamp_min(0.0)
    return FeatureSet(features, labels, [f"class_{c}" for c in range(classes)], {"source": "synthetic"})


#: The integration tier, in one place: modules whose tests run whole jobs (scripts in child processes, a
#: Trainer's fit, studies, kills and resumes) or the Triton interpreter; fixtures that do; and the heavy tests of
#: otherwise quick modules (seconds to minutes each on the 2-core CPU). The README's command runs them with the
#: rest; ``pytest -m "not slow and not integration"`` is the quick tier (docs/development.md, "Test tiers").
INTEGRATION_MODULES = {
    "test_checkpoint_interrupts", "test_console_script", "test_determinism", "test_distributed_evaluation",
    "test_evaluate", "test_evaluate_checkpoint", "test_interruptions", "test_mkl_reproducibility", "test_putm_hopper",
    "test_resume", "test_run_locks", "test_runs", "test_stopping", "test_study", "test_study_postgres",
    "test_sweeps", "test_timm_backbone", "test_unem_default", "test_untrusted_files", "test_wandb_runs",
    "test_without_triton",
}
INTEGRATION_FIXTURES = {"interpreted", "tiny_checkpoint"}
INTEGRATION_TESTS = {
    "test_near_perfect_accuracy_on_separated_data", "test_same_predictions_alone_or_in_a_batch",
    "test_alpha_tim_approaches_tim_as_alpha_tends_to_one", "test_the_scripts_themselves_exit_2_with_one_line",
    "test_no_evaluate_config_value_escapes_as_an_unhandled_exception",
    "test_no_feature_file_content_escapes_as_an_unhandled_exception",
    "test_no_trusted_pickle_content_escapes_as_an_unhandled_exception",
    "test_no_train_backbone_config_value_escapes_as_an_unhandled_exception",
    "test_two_process_cpu_ddp_writes_a_loadable_checkpoint", "test_every_method_runs_with_absent_classes",
    "test_the_python_api_page_runs", "test_the_docs_example_runs_and_logs_during_fit_and_test",
    "test_wandb_silent_false_keeps_wandbs_own_output", "test_high_accuracy_on_clear_imbalanced_problem",
    "test_a_method_in_its_own_module_runs_through_evaluate_py",
}


def in_integration_tier(item: pytest.Item) -> bool:
    module = Path(str(item.fspath)).stem
    name = getattr(item, "originalname", item.name)
    return (module in INTEGRATION_MODULES or name in INTEGRATION_TESTS
            or bool(INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ()))))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The integration tier's marks (before ``-m`` selects), and ``@pytest.mark.cuda`` tests skipped, with the
    reason, where torch sees no CUDA device."""
    for item in items:
        if in_integration_tier(item):
            item.add_marker(pytest.mark.integration)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def clustered() -> FeatureSet:
    return make_clustered_features()


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors: one thread avoids OpenMP spin-waits, which cost seconds on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A Conv-4 of width 8 trained for one epoch (classifier stage) on the base digits: a real checkpoint in seconds."""
    from lightning_putm.jobs.train import run_train_backbone

    folder = tmp_path_factory.mktemp("tiny_checkpoint")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train_backbone(["logger=none", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                            "trainer.accelerator=cpu", "backbone.width=8", "stages=[classifier]", "trainer.max_epochs=1",
                            "val_episodes.tasks=5", "run_test=false", f"checkpoint_dir={folder}"], log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    return folder / "digits" / "conv4" / "latest" / "classifier" / "last.ckpt"
