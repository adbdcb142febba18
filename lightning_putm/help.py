"""``--help`` of the scripts, generated from the config files themselves so it cannot drift from them.

Every key of ``conf/<job>.yaml`` and of the config groups (``conf/method/*.yaml`` as ``method.<name>.<key>``,
``conf/data/*.yaml`` as ``data.<key>``, ``conf/backbone/*.yaml`` as ``backbone.<key>``) is listed with its type,
its default and the comment written beside it (which names the allowed values).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_putm.config import conf_dir, group_options

KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w]*):(?P<rest>.*)$")
COMMENT_LINE = re.compile(r"^\s*#\s?(?P<text>.*)$")


def yaml_comments(path: Path, prefix: str = "") -> dict[str, str]:
    """``{dotted key: comment}`` from a YAML file's inline comments and the comment lines that continue them."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last: str | None = None
    for line in path.read_text().splitlines():
        match = KEY_LINE.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            dotted = prefix + ".".join([k for _, k in stack] + [match["key"]])
            stack.append((indent, match["key"]))
            rest = match["rest"]
            comment = rest.split(" #", 1)[1].strip() if " #" in rest else ""
            comments[dotted] = comment.lstrip("# ").strip()
            last = dotted if comment else None
            continue
        continuation = COMMENT_LINE.match(line)
        if continuation and last is not None and line.startswith(" "):
            comments[last] = f"{comments[last]} {continuation['text'].strip()}".strip()
        else:
            last = None
    return comments


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (ListConfig, list)):
        return "list"
    return type(value).__name__


def rows(cfg: DictConfig, comments: dict[str, str], prefix: str = "") -> list[tuple[str, str, str, str]]:
    table = []
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if dotted == "method":  # filled from the method group: listed below
            continue
        if isinstance(value, DictConfig) and len(value):
            table += rows(value, comments, dotted + ".")
        else:
            shown = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
            table.append((dotted, type_name(value), "null" if shown is None else str(shown), comments.get(dotted, "")))
    return table


def format_rows(table: list[tuple[str, str, str, str]]) -> str:
    key_width = min(36, max(len(r[0]) for r in table))
    default_width = min(24, max(len(r[2]) for r in table))
    lines = []
    for key, kind, default, comment in table:
        default = default if len(default) <= default_width else default[: default_width - 1] + "…"
        lines.append(f"  {key.ljust(key_width)}  {kind.ljust(5)}  {default.ljust(default_width)}  {comment}".rstrip())
    return "\n".join(lines)


def job_help(job: str, summary: str) -> str:
    """The full ``--help`` of ``evaluate`` or ``train_backbone``."""
    folder = conf_dir()
    main = OmegaConf.load(folder / f"{job}.yaml")
    comments = yaml_comments(folder / f"{job}.yaml")
    groups = {"method": "method"} if job == "evaluate" else {"data": "data", "backbone": "backbone"}
    body = [summary.strip(), "",
            f"Usage: python {job}.py [key=value ...]",
            f"       python {job}.py config=<run folder>/config.yaml [key=value ...]   # re-run a recorded run",
            "", f"Keys of conf/{job}.yaml (key, type, default, meaning):",
            format_rows(rows(main, comments, ""))]
    for group, key in groups.items():
        for name in group_options(group):
            path = folder / group / f"{name}.yaml"
            node = OmegaConf.load(path)
            prefix = f"method.{name}." if group == "method" else f"{key}."
            if group != "method":
                body += ["", f"{key}={name} (conf/{group}/{name}.yaml) sets {key}.<key>:"]
            else:
                body += ["", f"method {name} (conf/method/{name}.yaml), as method.{name}.<key>=value:"]
            body.append(format_rows(rows(node, yaml_comments(path, prefix), prefix)))
    body += ["", "trainer.<name>=value: any pytorch_lightning.Trainer argument except the ones the job sets itself",
             "(devices, strategy, precision, accelerator, max_epochs, ...). Unknown keys are errors that list the valid ones."]
    return "\n".join(body)
