"""Every relative link of the README and docs/ leads somewhere: the file exists, and a ``#fragment`` names a heading
of it, slugged as GitHub does (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats).

A heading renamed without its links (as happened to the Omniglot table's five links from choosing.md) breaks
nothing else, so only this test notices.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def slugs(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings."""
    seen: Counter[str] = Counter()
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link in a heading: its text
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return out


def test_the_slugs_follow_githubs_rule(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Measured on one H100\n## `solver=triton`: the kernel (2026-11-27)\n## Notes\n## Notes\n"
                    "```\n# not a heading\n```\n")
    assert slugs(page) == {"measured-on-one-h100", "solvertriton-the-kernel-2026-11-27", "notes", "notes-1"}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_fragment_resolves(page: Path) -> None:
    broken = []
    for match in LINK.finditer(FENCE.sub("", page.read_text())):
        target, fragment = match.group(1), match.group(2)
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in slugs(path):
            broken.append(f"{target}#{fragment} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


#: The user pages that had grown into lab notebooks, and the most lines each may have (the rest goes to docs/lab/).
USER_PAGE_LINES = {"README.md": 120, "docs/studies.md": 250, "docs/gpu.md": 300}


@pytest.mark.parametrize("page,most", sorted(USER_PAGE_LINES.items()))
def test_the_user_pages_stay_short(page: str, most: int) -> None:
    """The README and the studies and GPU pages hold what a user needs; measurements, profiles and research logs go
    to docs/lab/ and benchmarks/results/. Kills: a dated log or a kernel profile growing back into a user page."""
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= most, f"{page} has {lines} lines (at most {most}): move measurements and logs to docs/lab/"
