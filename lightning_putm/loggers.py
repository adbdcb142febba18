"""Logger choice for both jobs: W&B (online or offline) or none, with start-up problems as clear errors.

Default ``logger=auto`` means W&B when the ``wandb`` package imports. Its mode comes from ``wandb.mode``, else
``$WANDB_MODE``; when neither is set and no W&B credentials are configured (``$WANDB_API_KEY`` or a netrc entry),
the run is logged offline with one notice instead of blocking on a login prompt. The key itself is never read
into our logs.
"""

from __future__ import annotations

import json
import netrc
import os
import shlex
from pathlib import Path
from typing import Any, Callable

from lightning_putm.atomic import atomic_write_text
from lightning_putm.errors import ConfigError

#: The loggers every job takes (``logger=<name>``; evaluate.py and train_backbone.py check against this one table),
#: each with what it does; :func:`build_logger` builds them.
LOGGERS: dict[str, str] = {
    "auto": "wandb when the wandb package is installed, else none",
    "wandb": "a W&B run (online with credentials, else offline; wandb.* settings)",
    "csv": "Lightning's CSV logger in the run folder",
    "none": "no logger",
}
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run")


def wandb_available() -> bool:
    try:
        import wandb  # noqa: F401
    except Exception:
        return False
    return True


def wandb_credentials_configured() -> bool:
    """Whether a W&B API key is configured (environment or netrc); the key's value is not kept."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(os.environ.get("WANDB_BASE_HOST", "api.wandb.ai")) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def configured_wandb_mode(configured: Any) -> str | None:
    """``wandb.mode``, else ``$WANDB_MODE``; a value W&B does not know is a :class:`ConfigError`.

    The jobs call it while they validate their settings (through :func:`check_wandb_mode`), so a typo stops the
    run before its folder or W&B run exists."""
    mode = configured or os.environ.get("WANDB_MODE")
    if mode and mode not in WANDB_MODES:
        where = "wandb.mode" if configured else "$WANDB_MODE"
        raise ConfigError(f"{where} must be online, offline or disabled, got {mode!r}")
    return str(mode) if mode else None


def check_wandb_mode(configured: Any, kind: str) -> None:
    """Settings-time check of the W&B mode for ``logger=kind``: only a logger that may use W&B reads it."""
    if kind in ("auto", "wandb"):
        configured_wandb_mode(configured)


def resolve_wandb_mode(configured: str | None, log: Callable[[str], None] = print) -> str:
    mode = configured_wandb_mode(configured)
    if mode:
        return mode
    if wandb_credentials_configured():
        return "online"
    log("notice: no W&B credentials found, so the run is logged offline (upload later with `wandb sync "
        "<run folder>`; set WANDB_MODE=online after `wandb login`, or logger=none to skip W&B)")
    return "offline"


def build_logger(kind: str, save_dir: Path, options: dict[str, Any], run_name: str,
                 log: Callable[[str], None] = print, csv_name: str = "csv_logs", csv_version: str | int | None = None,
                 job_type: str | None = None, group: str | None = None, config: dict[str, Any] | None = None,
                 run_file: Path | None = None, resume: bool = False) -> Any:
    """A Lightning logger (or ``False``) for either job: ``auto`` (W&B when installed), ``wandb``, ``csv``, ``none``.

    CSV logs go to ``save_dir/csv_name/csv_version``. A W&B run is started at once, so a missing key or an
    unreachable server is a :class:`ConfigError` before any work. W&B conventions: the run folder is
    ``<wandb.dir>/wandb`` (else ``$WANDB_DIR/wandb``, else ``./wandb``, where a bare ``wandb sync`` looks); W&B's
    banner is silenced (``$WANDB_SILENT`` decides when set) and one line says where the run is; the run is named
    ``run_name`` unless ``wandb.name`` is set, ``group``/``job_type`` put the runs of one pretraining or study
    together, and the full resolved ``config`` is the run's config (filter and group runs by any key).

    ``run_file`` (``wandb_run.json`` in a run folder) keeps the W&B run's id and name: with ``resume`` the run
    recorded there is continued (W&B's ``id=<saved id>, resume="allow"``), so a resumed job logs into the same run
    instead of a new one with the same name; a run started afresh overwrites the record. ``$WANDB_RUN_ID`` (set by
    ``wandb agent``) wins over the record.
    """
    if kind not in LOGGERS:
        raise ConfigError(f"logger must be one of {', '.join(LOGGERS)}, got {kind!r}")  # the jobs checked it
    if kind == "auto":
        kind = "wandb" if wandb_available() else "none"
    if kind == "none":
        return False
    save_dir.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        from lightning_putm.csv_logger import ResumableCSVLogger  # Lightning: only when a logger is built

        return ResumableCSVLogger(save_dir=str(save_dir), name=csv_name, version=csv_version)
    if not wandb_available():
        raise ConfigError("logger=wandb but the wandb package cannot be imported; `pip install wandb` or use logger=none")
    from pytorch_lightning.loggers import WandbLogger

    wandb_dir = wandb_root(options.get("dir"))
    wandb_dir.mkdir(parents=True, exist_ok=True)
    recorded = read_wandb_run(run_file) if run_file is not None and resume and not os.environ.get("WANDB_RUN_ID") \
        else None
    kwargs: dict[str, Any] = {"project": options.get("project") or "lightning-putm",
                              "name": options.get("name") or (recorded or {}).get("name") or run_name,
                              # absolute: W&B's service process, started once, resolves it against its own cwd
                              "save_dir": os.path.abspath(wandb_dir),
                              "mode": resolve_wandb_mode(options.get("mode"), log)}
    if quiet_wandb():
        import wandb

        kwargs["settings"] = wandb.Settings(silent=True)  # its banner at start and end of every run; ours: one line
    for key, value in (("entity", options.get("entity")), ("group", options.get("group") or group),
                       ("job_type", job_type), ("config", config), ("id", (recorded or {}).get("id"))):
        if value:
            kwargs[key] = value
    logger = WandbLogger(**kwargs)
    # Lightning passes anonymous=None, which W&B answers with a deprecation warning on every run
    getattr(logger, "_wandb_init", {}).pop("anonymous", None)
    try:
        logger.experiment  # noqa: B018 - start the run now so problems surface before any work
    except Exception as exc:
        raise ConfigError(f"W&B could not start a run ({type(exc).__name__}: {exc}). Log offline with "
                          "WANDB_MODE=offline (or wandb.mode=offline), run `wandb login`, or use logger=none") from exc
    if run_file is not None:
        record_wandb_run(run_file, logger.experiment)
    if (line := wandb_run_line(logger.experiment)) is not None:
        log(line)
    return logger


#: The file in an evaluation's ``output_dir`` that keeps the id and name of the folder's W&B run, so that a re-run
#: into the folder continues that run (a pretraining run keeps ``wandb_run-<stage>.json`` in its run folder).
WANDB_RUN_FILE = "wandb_run.json"


def read_wandb_run(path: Path) -> dict[str, str] | None:
    """The ``{"id", "name"}`` recorded in ``path``; ``None`` when there is none (or it is unreadable: a new run)."""
    try:
        recorded = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("id"), str) or not recorded["id"]:
        return None
    return {"id": recorded["id"], "name": str(recorded.get("name") or "")}


def record_wandb_run(path: Path, run: Any) -> None:
    """Write the started run's id and name to ``path`` (atomically; rank zero only; not for a disabled run)."""
    from pytorch_lightning.utilities import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0 or getattr(getattr(run, "settings", None), "mode", None) == "disabled":
        return
    atomic_write_text(path, json.dumps({"id": run.id, "name": run.name or ""}, indent=1) + "\n")


def wandb_root(configured: Any) -> Path:
    """The folder W&B puts its ``wandb/`` run folders in: ``wandb.dir``, else ``$WANDB_DIR`` (W&B's own variable,
    which clusters and CI set), else the working directory."""
    return Path(str(configured or os.environ.get("WANDB_DIR") or "."))


def quiet_wandb() -> bool:
    """W&B's console banner is silenced unless the user chose otherwise with ``$WANDB_SILENT``."""
    return "WANDB_SILENT" not in os.environ


#: How the one line about a W&B run starts (a study passes on these lines of its runs, and nothing else).
WANDB_LINE = "W&B run:"


def wandb_run_line(run: Any) -> str | None:
    """Where the run is and, offline, how to upload it, in one line; ``None`` for a disabled run."""
    settings = getattr(run, "settings", None)
    if settings is None or getattr(settings, "mode", None) == "disabled":
        return None
    if getattr(settings, "_offline", False) or getattr(settings, "mode", None) in ("offline", "dryrun"):
        folder = Path(str(settings.sync_dir))
        try:
            shown = folder.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            shown = folder
        return f"{WANDB_LINE} offline in {shown} (upload with `wandb sync {shlex.quote(str(shown))}`)"
    url = getattr(run, "url", None)
    return f"{WANDB_LINE} {url}" if url else None


def console(log: Callable[[str], None]) -> Callable[[str], None]:
    """``print`` that does not glue its line onto an active progress bar (``tqdm.write``); other sinks as they are."""
    if log is print:
        from tqdm.auto import tqdm

        return lambda text: tqdm.write(text)
    return log


def finish_logger(logger: Any, rank_zero: bool = True) -> None:
    """Close a W&B run (a run left open would swallow the next run's logs in this process)."""
    if rank_zero and type(logger).__name__ == "WandbLogger":
        logger.experiment.finish()
