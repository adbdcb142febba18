"""Typed checks of single config values, shared by every job, for the values no job field declares (a backbone's
options, a dataset recipe's epochs, a Trainer option); the keys of ``conf/<job>.yaml`` are checked from their fields
(:func:`lightning_putm.job_options.checked_options`), in the same wording.

Each check returns the value in its Python type or raises :class:`~lightning_putm.errors.ConfigError` with a
message naming the key, so ``evaluate.py`` and ``train_backbone.py`` word the same mistake the same way.
Strings are never coerced (``bool("no")`` is True; ``int("5")`` would hide a quoting mistake).
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Callable, Iterable

from omegaconf import ListConfig, OmegaConf

from lightning_putm.errors import ConfigError

BALANCED = "balanced"
#: The ``alphas`` word of PADDLE's query sampling (Martin et al., NeurIPS 2022: ``sampling: 'uniform'``): a task's
#: queries drawn uniformly at random from the pooled images of the classes present in its query set.
UNIFORM = "uniform"
#: A suggestion scoring this much less than the best one (difflib ratio) is left out: ``em_step`` → ``em_steps``,
#: not also ``inner_steps``.
MATCH_MARGIN = 0.1


def close_matches(word: Any, options: Iterable[Any], limit: int = 3) -> list[str]:
    """The ``options`` nearest to ``word`` (``taks`` → ``tasks``), best first; a misspelling is the usual mistake."""
    names = [str(o) for o in options]
    text = str(word)
    found = difflib.get_close_matches(text, names, n=limit, cutoff=0.6)
    if not found:  # a difference of case only (``TASKS``) scores below the cutoff
        return [n for n in names if n.lower() == text.lower()][:limit]
    score = {name: difflib.SequenceMatcher(None, text, name).ratio() for name in found}
    return [name for name in found if score[name] >= score[found[0]] - MATCH_MARGIN]  # the clearly best, or ties


def did_you_mean(word: Any, options: Iterable[Any], prefix: str = "") -> str:
    """``"did you mean tasks? "`` (``"did you mean tasks or tests? "``), or ``""`` when nothing is close: put it
    before the list of every valid option, so the likely fix is read first."""
    found = close_matches(word, options)
    if not found:
        return ""
    return f"did you mean {alternatives([f'{prefix}{name}' for name in found])}? "


def alternatives(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


def near_paths(missing: str | Path, limit: int = 3) -> list[Path]:
    """Existing files whose path is one misspelling per part away from ``missing`` (``…/s2m2r/bets.ckpt`` →
    ``…/s2m2r/best.ckpt``; ``…/latst/s2m2r/best.ckpt`` → ``…/latest/s2m2r/best.ckpt``), best first.

    The search starts in the deepest folder of ``missing`` that exists and follows each missing part by its close
    matches among that folder's entries (:func:`close_matches`), so it reads a handful of folders, never a tree.
    """
    target = Path(missing).expanduser()
    folder, rest = target.parent, [target.name]
    while not folder.is_dir() and folder != folder.parent:
        folder, rest = folder.parent, [folder.name, *rest]
    if not folder.is_dir() or not target.name:
        return []
    candidates = [folder]
    for index, name in enumerate(rest):
        last = index == len(rest) - 1
        found: list[Path] = []
        for base in candidates:
            try:
                entries = sorted(p.name for p in base.iterdir() if (p.is_file() if last else p.is_dir()))
            except OSError:
                continue
            found += [base / match for match in ([name] if name in entries else close_matches(name, entries, limit))]
        candidates = found[:limit]
    return candidates


def path_hint(missing: str | Path) -> str:
    """``"did you mean …/best.ckpt? "`` for a file that does not exist (:func:`near_paths`); else, when its folder
    exists, the files there with its suffix (``"its folder holds best.ckpt, last.ckpt; "``); else ``""``."""
    found = near_paths(missing)
    if found:
        return f"did you mean {alternatives([str(p) for p in found])}? "
    target = Path(missing).expanduser()
    try:
        siblings = sorted(p.name for p in target.parent.iterdir() if p.is_file() and p.suffix == target.suffix
                          and not p.name.startswith("."))
    except OSError:
        return ""
    if not siblings:
        return ""
    more = f" and {len(siblings) - 5} more" if len(siblings) > 5 else ""
    return f"its folder holds {', '.join(siblings[:5])}{more}; "


def choice(value: Any, key: str, options: Iterable[str]) -> str:
    """One of a fixed set of names (``split=tset`` → "did you mean test?")."""
    names = list(options)
    if not isinstance(value, str) or value not in names:
        hint = did_you_mean(value, names).strip() if isinstance(value, str) else ""
        raise ConfigError(f"`{key}` must be one of {', '.join(names)}, got {value!r}" + (f"; {hint}" if hint else ""))
    return value


def is_number(value: Any) -> bool:
    """A finite int or float, never a bool."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def integer(value: Any, key: str, low: int) -> int:
    """An integer ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"`{key}` must be an integer >= {low}, got {value!r}")
    return value


def positive(value: Any, key: str, integer: bool = False) -> Any:
    """A positive number (or integer)."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0 or not math.isfinite(value):
        raise ConfigError(f"`{key}` must be a positive {'integer' if integer else 'number'}, got {value!r}")
    return value


def number(value: Any, key: str, low: float = 0.0) -> float:
    """A finite number ``>= low``."""
    if not is_number(value) or value < low:
        raise ConfigError(f"`{key}` must be a number >= {low:g}, got {value!r}")
    return float(value)


def flag(value: Any, key: str) -> bool:
    """A true/false setting."""
    if not isinstance(value, bool):
        raise ConfigError(f"`{key}` must be true or false, got {value!r}")
    return value


def mapping(value: Any, key: str, example: str | None = None) -> dict[str, Any]:
    """An optional group of settings (``null`` or a mapping) as a plain dict."""
    if value is None:
        return {}
    if not OmegaConf.is_dict(value) and not isinstance(value, dict):
        hint = example or f"{key}.<name>=value"
        raise ConfigError(f"`{key}` must be a mapping of settings (e.g. {hint}) or null, got {value!r}")
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_dict(value) else dict(value)


def as_list(value: Any) -> list[Any]:
    """A list value, or a single value as a one-element list (``shots=1`` means ``shots=[1]``)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    return [value]


def parse_alpha(value: Any, key: str = "alphas", uniform: bool = False) -> float | str | None:
    """A Dirichlet α (finite, > 0) or ``balanced`` → ``None``; numbers written as text are accepted. With
    ``uniform=True`` (evaluation settings and their result files) the word ``uniform`` is kept as :data:`UNIFORM`."""
    words = f"`{BALANCED}`" + (f" or `{UNIFORM}`" if uniform else "")
    if isinstance(value, str) and value.strip().lower() == BALANCED:
        return None
    if uniform and isinstance(value, str) and value.strip().lower() == UNIFORM:
        return UNIFORM
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is neither a positive number nor {words}")
    if not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {value!r} is neither a positive number nor {words}") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}: Dirichlet alpha must be > 0 (or {words}), got {value!r}")
    return float(value)


def alpha_label(alpha: float | str | None) -> str:
    """How an α is written in tables and files: ``balanced``, ``uniform`` or ``%g``."""
    if alpha is None:
        return BALANCED
    return alpha if isinstance(alpha, str) else f"{alpha:g}"


#: The ``query_classes`` words (and ``null``) for the default protocol: every one of the N classes in the query set.
ALL_CLASSES = "all"


def parse_query_classes(value: Any, ways: int, key: str = "query_classes") -> list[int | None]:
    """The K_eff values of ``query_classes`` (a value or a list; ``null`` = ``[None]``), each once. K_eff, the number
    of a task's N classes present in its query set (PADDLE's protocol), is an integer from 1 to ``ways``; ``null``
    or ``all`` → ``None``, the default protocol (all N classes, counts by ``alphas``)."""
    values = [parse_k_eff(item, ways, key) for item in as_list(value)] or [None]
    distinct(values, key, query_classes_label)
    return values


def parse_k_eff(value: Any, ways: int, key: str = "query_classes") -> int | None:
    """One K_eff (see :func:`parse_query_classes`)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in (ALL_CLASSES, "null", "none")):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= ways:
        raise ConfigError(f"`{key}` must be an integer from 1 to ways={ways} (the classes present in each query set), "
                          f"or null/all for all {ways}; got {value!r}")
    return int(value)


def query_classes_label(query_classes: int | None) -> str:
    """How K_eff is written in tables and files: ``all`` (the default protocol) or the number."""
    return ALL_CLASSES if query_classes is None else str(query_classes)


def is_balanced(alpha: float | str | None, query_classes: int | None, ways: int) -> bool:
    """Whether every one of a task's N classes gets Q/N queries (``balanced``, all N present): the protocol flag
    methods are built with (their public configurations differ between balanced and imbalanced tasks)."""
    return alpha is None and query_classes in (None, ways)


def protocol_flags(alphas: Iterable[float | str | None], query_classes: Iterable[int | None], ways: int) -> list[bool]:
    """The protocol flags of a run's banks (:func:`is_balanced`), each once, False first."""
    return sorted({is_balanced(alpha, keff, ways) for alpha in alphas for keff in query_classes})


def distinct(values: list[Any], key: str, label: Callable[[Any], str] = str) -> None:
    """Each item of the list ``key`` once, as results are filed by ``label(item)``: a repeat, or two values with one
    label (α 2 and 2.0000001 are both ``2``), would file two settings under one name."""
    seen: dict[str, Any] = {}
    for value in values:
        name = label(value)
        if name in seen:
            if seen[name] == value:
                raise ConfigError(f"`{key}` lists {name} twice; give each value once")
            raise ConfigError(f"`{key}`: {seen[name]!r} and {value!r} are both written {name} in tables and result "
                              "files; give values that differ in the first 6 significant digits")
        seen[name] = value
