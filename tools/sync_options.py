"""Write each built-in method's ``conf/method/<name>.yaml`` options and ``docs/methods/<name>.md`` options table
from its settings dataclass (:mod:`lightning_putm.methods.option_pages`), and each job's ``conf/<job>.yaml`` from its
options dataclass (:mod:`lightning_putm.job_options`).

    python tools/sync_options.py           # rewrite the files
    python tools/sync_options.py --check   # list the files that differ (exit 1), write nothing

Edit an option in its dataclass (``lightning_putm/methods/peer_settings.py``, ``.../putm/settings.py``,
``.../unem.py``...; a job's in ``lightning_putm/evaluation/options.py``, ``.../prediction/options.py``,
``.../pretraining/options.py``), then run this; ``tests/test_option_sources.py`` fails while a file is out of date.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_putm.atomic import atomic_write_text
from lightning_putm.job_options import JOBS, job_schema, job_yaml
from lightning_putm.job_options import yaml_header as job_yaml_header
from lightning_putm.methods.catalog import BUILTIN_SETTINGS
from lightning_putm.methods.option_pages import method_yaml, with_table, yaml_header

ROOT = Path(__file__).resolve().parents[1]


def rendered() -> dict[Path, str]:
    """Each generated file's path and the text it should hold."""
    out: dict[Path, str] = {}
    for settings in BUILTIN_SETTINGS:
        yaml = ROOT / "conf" / "method" / f"{settings.method}.yaml"
        if yaml.is_file():
            out[yaml] = method_yaml(settings, yaml_header(yaml.read_text(), settings))
        page = ROOT / "docs" / "methods" / f"{settings.method}.md"
        if page.is_file():
            out[page] = with_table(page.read_text(), settings)
    for job in JOBS:
        yaml = ROOT / "conf" / f"{job}.yaml"
        out[yaml] = job_yaml(job_schema(job), job_yaml_header(yaml.read_text()))
    return out


def main(argv: list[str]) -> int:
    stale = [path for path, text in rendered().items() if path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run python tools/sync_options.py)")
        return 1 if stale else 0
    for path, text in rendered().items():
        if path in stale:
            atomic_write_text(path, text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
