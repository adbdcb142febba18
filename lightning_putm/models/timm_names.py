"""``checkpoint=timm:<model name>``: the name read from the setting and checked against timm's list.

Apart from :mod:`~lightning_putm.models.timm_pretrained` (which loads the weights, with torch) so that the jobs'
settings read and check the name without importing torch; timm itself is imported only to check a name given.

* :func:`check_model_name` — the name must be a timm architecture (``resnet50``) or a pretrained tag of one
  (``resnet50.a1_in1k``); a misspelling gets the closest names of ``timm.list_models``.
"""

from __future__ import annotations

from typing import Any

from lightning_putm.errors import ConfigError
from lightning_putm.validators import did_you_mean

#: ``checkpoint=timm:<model name>`` selects a timm model instead of a ``train_backbone.py`` checkpoint.
TIMM_PREFIX = "timm:"


def timm_model_name(checkpoint: Any) -> str | None:
    """The model name of ``checkpoint=timm:<name>``, or ``None`` for any other checkpoint value."""
    text = "" if checkpoint is None else str(checkpoint).strip()
    return text[len(TIMM_PREFIX):].strip() if text.startswith(TIMM_PREFIX) else None


def check_model_name(name: str) -> str:
    """``name`` when timm knows it (an architecture, or ``<architecture>.<pretrained tag>``), else a ConfigError
    with the closest names."""
    import timm

    if not name:
        raise ConfigError("checkpoint=timm: needs a model name, e.g. checkpoint=timm:resnet50.a1_in1k")
    arch, _, tag = name.partition(".")
    if not timm.is_model(arch):
        raise ConfigError(f"checkpoint=timm:{name}: timm has no model {arch!r}; "
                          f"{did_you_mean(arch, timm.list_models(), prefix='timm:')}see timm.list_models() for "
                          "every name (timm.list_pretrained() for those with weights)")
    if tag:
        tags = timm.list_pretrained(f"{arch}.*")
        if name not in tags:
            listed = ", ".join(tags[:8]) + (" …" if len(tags) > 8 else "") if tags else "(none)"
            raise ConfigError(f"checkpoint=timm:{name}: {arch} has no pretrained tag {tag!r}; "
                              f"{did_you_mean(name, tags, prefix='timm:')}its tags: {listed}")
    return name
