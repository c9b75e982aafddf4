"""The docs stay guides a maintainer can take over: short where they are read first, and
citing upstream issues and PRs rather than this project's own tracker or work log, which
no reader can see.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_patches._catalog import series as _series

REPO = _series.REPO_DIR
SERIES = _series.load()
# Project files a reader meets; patches/ is generated from the overlays' metadata.
CHECKED = ["README.md", "CONTRIBUTING.md", "docs", "tests", "tools", "benchmarks", ".ci",
           "vllm_patches"]
SUFFIXES = {".md", ".py", ".sh", ".toml", ".txt", ""}
# This project's tracker and work log. An upstream reference names its repository or a
# link ("vllm#33775", "upstream issue #58222", ".../issues/42632") and is not matched.
TRACKER = re.compile(
    r"(?<![\w#/])(?:issue|stop|item)s? \d+"  # "issue 27", "stop 40", "item 7"
    r"|\bwork session\b|\bthis session\b|\bthe sessions?\b(?! of its own)"
    r"|\bissues ci\b",
    re.IGNORECASE)
UPSTREAM = re.compile(r"upstream issues? \d+|vllm(?:-project/vllm)? issues? \d+", re.IGNORECASE)
MOST_LINES = {"CONTRIBUTING.md": 300, "docs/ci.md": 80}


def checked_files() -> list[Path]:
    files = []
    for name in CHECKED:
        path = REPO / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*"))
                      if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return [p for p in files if p != Path(__file__).resolve()]  # its examples cite on purpose


def tracker_citations(text: str) -> list[str]:
    return [m.group(0) for m in TRACKER.finditer(text)
            if not UPSTREAM.search(text[max(0, m.start() - 20):m.end()])]


def test_the_pattern_tells_a_tracker_from_upstream():
    assert tracker_citations("fixed at stop 40 (issue 27, item 4) in this session") == [
        "stop 40", "issue 27", "item 4", "this session"]
    assert tracker_citations("vllm#33775, upstream issue 58222, issues/42632, "
                             "a session of its own, scope='session'") == []


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_tracker_citations(path: Path):
    """Cite vllm-project/vllm issues and PRs, or say the reason in words."""
    assert tracker_citations(path.read_text(errors="replace")) == []


@pytest.mark.parametrize("name", sorted(MOST_LINES))
def test_short_guides(name: str):
    assert len((REPO / name).read_text().splitlines()) < MOST_LINES[name]


def readme_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| F") and len(cells) == 4:
            rows[cells[0].split()[0]] = cells
    return rows


def test_readme_lists_each_fix_as_list_does():
    """One row per fix: its id and slug, and an upstream column that agrees with the
    fix's metadata (`vllm-patches list`): the release it is upstream since, or "no" with
    the open PR when the fix names one."""
    rows = readme_rows()
    assert sorted(rows) == sorted(fix.id for fix in SERIES.fixes)
    for fix in SERIES.fixes:
        _, _, _, upstream = rows[fix.id]
        assert f"`{fix.slug}`" in rows[fix.id][0]
        number = fix.pr.rstrip("/").rsplit("/", 1)[-1] if fix.pr else None
        if fix.upstream_since:
            assert upstream.startswith(f"v{fix.upstream_since}"), (fix.id, upstream)
        else:
            assert upstream.startswith("no"), (fix.id, upstream)
        if number:
            assert f"PR {number}" in upstream, (fix.id, upstream)
