"""The series: the ordered fixes, their metadata, and the pinned release lanes.

Data lives in ``series.toml`` (order and lanes) and ``fixes/<id>.toml`` (one fix
each, vllm-ascend's patch registry fields: What, Why, How, Related PR, Future plan).
This module only loads and interprets it; tests validate it against the overlays.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_patches._errors import UserError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
PATCHES_DIR = REPO_DIR / "patches"
UPSTREAM_PACKAGE = "vllm"


@dataclass(frozen=True)
class UpstreamTestNote:
    """An upstream test a fix's metadata names for some releases, and why:
    ``[[deselect]]`` (left out of the lane runs: the CPU, offline environment fails
    it), ``[[timing_sensitive]]`` (rerun alone when it fails in a lane) or
    ``[[replaces]]`` (its expectation is what the fix changes; ``by`` names the fix
    test that checks the new one; see tools/lanes.py)."""

    node: str
    releases: SpecifierSet
    why: str
    by: str = ""

    @classmethod
    def load_all(cls, entries: object, path: Path, table: str) -> tuple[UpstreamTestNote, ...]:
        """``[[table]]`` tables: ``node``, ``why``, optional ``releases`` (a PEP 440
        specifier; every release when absent), and for ``replaces`` ``by``."""
        keys = {"node", "releases", "why"} | ({"by"} if table == "replaces" else set())
        if not isinstance(entries, list):
            raise TypeError(f"{path}: {table} must be an array of tables ([[{table}]])")
        result = []
        for entry in entries:
            if not isinstance(entry, dict) or entry.keys() - keys or (
                    table == "replaces" and "by" not in entry):
                raise ValueError(f"{path}: {table} entry {entry!r}: keys are "
                                 f"{', '.join(sorted(keys))}")
            result.append(cls(node=entry["node"], releases=SpecifierSet(entry.get("releases", "")),
                              why=entry["why"].strip(), by=entry.get("by", "")))
        return tuple(result)

    def applies(self, release: Version) -> bool:
        return release in self.releases

    def names(self, node: str) -> bool:
        """Whether ``node`` is this test: the node itself, or one of its parameters
        when the note names the test function."""
        return node == self.node or ("[" not in self.node and node.startswith(self.node + "["))


@dataclass(frozen=True)
class Fix:
    """One fix of the series, as its metadata file declares it."""

    id: str
    slug: str
    title: str
    what: str
    why: str
    how: str
    bug: str
    pr: str
    releases: SpecifierSet
    upstream_since: Version | None
    future: str
    overlays: tuple[str, ...]
    tests: tuple[str, ...]
    stock_fails: tuple[str, ...]
    upstream_tests: tuple[str, ...]
    deselect: tuple[UpstreamTestNote, ...]
    timing_sensitive: tuple[UpstreamTestNote, ...] = ()
    replaces: tuple[UpstreamTestNote, ...] = ()
    requires: tuple[str, ...] = ()  # ids of the fixes this one is built on, applied before it

    @classmethod
    def load(cls, path: Path) -> Fix:
        data = tomllib.loads(path.read_text())
        return cls(
            id=data["id"],
            slug=data["slug"],
            title=data["title"],
            what=data["what"].strip(),
            why=data["why"].strip(),
            how=data["how"].strip(),
            bug=data["bug"],
            pr=data["pr"],
            releases=SpecifierSet(data["releases"]),
            upstream_since=Version(data["upstream_since"]) if data["upstream_since"] else None,
            future=data["future"],
            requires=tuple(data.get("requires", ())),
            overlays=tuple(data["overlays"]),
            tests=tuple(data["tests"]),
            stock_fails=tuple(data["stock_fails"]),
            upstream_tests=tuple(data.get("upstream_tests", ())),
            deselect=UpstreamTestNote.load_all(data.get("deselect", []), path, "deselect"),
            timing_sensitive=UpstreamTestNote.load_all(data.get("timing_sensitive", []), path,
                                                       "timing_sensitive"),
            replaces=UpstreamTestNote.load_all(data.get("replaces", []), path, "replaces"),
        )

    @property
    def name(self) -> str:
        return f"{self.id}-{self.slug}"

    def overlay_path(self, overlay: str) -> Path:
        return PACKAGE_DIR / overlay

    @staticmethod
    def upstream_path(overlay: str) -> str:
        """The upstream file an overlay mirrors, relative to a vLLM checkout."""
        return f"{UPSTREAM_PACKAGE}/{overlay}"

    def deselected(self, release: Version) -> list[str]:
        """The upstream test node ids left out of ``release``'s lane run."""
        return [entry.node for entry in self.deselect if entry.applies(release)]

    def replaced(self, release: Version) -> list[str]:
        """The upstream test node ids whose expectation the fix changes on ``release``."""
        return [entry.node for entry in self.replaces if entry.applies(release)]

    def timing_sensitive_on(self, release: Version) -> list[UpstreamTestNote]:
        """The upstream tests of ``release`` whose time limits a loaded machine can miss."""
        return [entry for entry in self.timing_sensitive if entry.applies(release)]

    def is_upstream(self, release: Version) -> bool:
        return self.upstream_since is not None and release >= self.upstream_since

    def verdict(self, release: Version) -> str | None:
        """Why the fix is not applied to ``release`` ("upstream since ...", ...), or None."""
        if self.is_upstream(release):
            return f"upstream since v{self.upstream_since}"
        if release not in self.releases:
            return f"not applicable: needed on vLLM {self.releases}, not on v{release}"
        return None


@dataclass(frozen=True)
class Series:
    fixes: tuple[Fix, ...]
    releases: tuple[Version, ...]

    @property
    def default_release(self) -> Version:
        return self.releases[0]

    def fix(self, fix_id: str) -> Fix:
        for fix in self.fixes:
            if fix.id == fix_id:
                return fix
        known = ", ".join(f.id for f in self.fixes)
        raise UserError(f"unknown fix {fix_id!r} (the series has {known})")

    def with_requirements(self, fix: Fix) -> list[Fix]:
        """``fix`` and every fix it requires, directly or not, in series order."""
        wanted = {fix.id}
        pending = [fix]
        while pending:
            for required in pending.pop().requires:
                if required not in wanted:
                    wanted.add(required)
                    pending.append(self.fix(required))
        return [f for f in self.fixes if f.id in wanted]

    def applicable(self, release: Version) -> list[Fix]:
        """The fixes ``release`` needs, in series order."""
        return [fix for fix in self.fixes if fix.verdict(release) is None]

    def require_supported(self, release: Version) -> None:
        if release not in self.releases:
            lanes = ", ".join(f"v{r}" for r in sorted(self.releases))
            raise UserError(f"vLLM v{release} is not a supported release (supported: {lanes})")


@cache
def load() -> Series:
    """The series as ``series.toml`` and ``fixes/*.toml`` declare it."""
    data = tomllib.loads((PACKAGE_DIR / "series.toml").read_text())
    fixes = tuple(Fix.load(PACKAGE_DIR / "fixes" / f"{fix_id}.toml") for fix_id in data["order"])
    return Series(fixes=fixes, releases=tuple(Version(r) for r in data["releases"]))
