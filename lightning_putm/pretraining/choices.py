"""The stages and the speed options a pretraining run may name, and their checks (``train_backbone.py`` reads them
before anything is built; :mod:`~lightning_putm.pretraining.module` applies them). Imports no torch.
"""

from __future__ import annotations

from typing import Any

from lightning_putm.errors import ConfigError

STAGES = ("classifier", "rotation", "s2m2r")
NCM_NORMALISATIONS = ("none", "l2")
#: ``scheduler``: none = constant learning rate (S2M2), cosine = decay to 0 over the stage.
SCHEDULERS = ("none", "cosine")
#: ``compile=true`` means this torch.compile backend; a string names another (e.g. ``eager`` to debug tracing).
DEFAULT_COMPILE_BACKEND = "inductor"


def check_channels_last(value: Any, key: str = "channels_last") -> bool | str:
    """``true``, ``false`` or ``"auto"`` (on when training on CUDA); anything else is a one-line ConfigError."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise ConfigError(f"`{key}` must be true, false or auto (auto = on when training on CUDA), got {value!r}")


def check_compile(value: Any, key: str = "compile") -> str | None:
    """The torch.compile backend for ``compile=value``: ``false`` → None, ``true`` → inductor, or a backend name
    that torch knows (``eager`` and ``aot_eager`` trace without generating code: useful to debug)."""
    if value is False or value is None:
        return None
    if value is True:
        return DEFAULT_COMPILE_BACKEND
    if isinstance(value, str) and value:
        from torch._dynamo import list_backends

        if value in set(list_backends(exclude_tags=())) | {"eager", "aot_eager", DEFAULT_COMPILE_BACKEND}:
            return value
        raise ConfigError(f"`{key}` must be true, false or a torch.compile backend name (e.g. inductor, eager, "
                          f"aot_eager; torch._dynamo.list_backends() lists them), got {value!r}")
    raise ConfigError(f"`{key}` must be true or false (true = torch.compile the backbone), got {value!r}")
