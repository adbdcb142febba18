"""Logger choice for both jobs: W&B (online or offline) or none, with start-up problems as clear errors.

Default ``logger=auto`` means W&B when the ``wandb`` package imports. Its mode comes from ``wandb.mode``, else
``$WANDB_MODE``; when neither is set and no W&B credentials are configured (``$WANDB_API_KEY`` or a netrc entry),
the run is logged offline with one notice instead of blocking on a login prompt. The key itself is never read
into our logs.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any, Callable

from lightning_putm.errors import ConfigError

LOGGERS = ("auto", "wandb", "csv", "none")


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


def resolve_wandb_mode(configured: str | None, log: Callable[[str], None] = print) -> str:
    mode = configured or os.environ.get("WANDB_MODE")
    if mode:
        if mode not in ("online", "offline", "disabled", "dryrun", "run"):
            raise ConfigError(f"wandb.mode must be online, offline or disabled, got {mode!r}")
        return mode
    if wandb_credentials_configured():
        return "online"
    log("notice: no W&B credentials found, so the run is logged offline (upload later with `wandb sync "
        "<run folder>`; set WANDB_MODE=online after `wandb login`, or logger=none to skip W&B)")
    return "offline"


def build_logger(kind: str, save_dir: Path, options: dict[str, Any], run_name: str,
                 log: Callable[[str], None] = print, csv_name: str = "csv_logs") -> Any:
    """A Lightning logger (or ``False``) for either job: ``auto`` (W&B when installed), ``wandb``, ``csv``, ``none``.

    A W&B run is started at once, so a missing key or an unreachable server is a :class:`ConfigError` before any
    work; ``options`` holds ``project``, ``entity``, ``name`` (default ``run_name``) and ``mode``.
    """
    if kind not in LOGGERS:
        raise ConfigError(f"logger must be one of {', '.join(LOGGERS)}, got {kind!r}")
    if kind == "auto":
        kind = "wandb" if wandb_available() else "none"
    if kind == "none":
        return False
    save_dir.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        from pytorch_lightning.loggers import CSVLogger

        return CSVLogger(save_dir=str(save_dir), name=csv_name)
    if not wandb_available():
        raise ConfigError("logger=wandb but the wandb package cannot be imported; `pip install wandb` or use logger=none")
    from pytorch_lightning.loggers import WandbLogger

    kwargs: dict[str, Any] = {"project": options.get("project") or "lightning-putm", "name": options.get("name") or run_name,
                              "save_dir": str(save_dir), "mode": resolve_wandb_mode(options.get("mode"), log)}
    if options.get("entity"):
        kwargs["entity"] = options["entity"]
    logger = WandbLogger(**kwargs)
    try:
        logger.experiment  # noqa: B018 - start the run now so problems surface before any work
    except Exception as exc:
        raise ConfigError(f"W&B could not start a run ({type(exc).__name__}: {exc}). Log offline with "
                          "WANDB_MODE=offline (or wandb.mode=offline), run `wandb login`, or use logger=none") from exc
    return logger


def finish_logger(logger: Any, rank_zero: bool = True) -> None:
    """Close a W&B run (a run left open would swallow the next run's logs in this process)."""
    if rank_zero and type(logger).__name__ == "WandbLogger":
        logger.experiment.finish()
