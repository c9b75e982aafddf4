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
class Deselect:
    """An upstream test left out of a fix's lane runs, for some releases, and why."""

    node: str
    releases: SpecifierSet
    why: str

    @classmethod
    def load_all(cls, entries: object, path: Path) -> tuple[Deselect, ...]:
        """``[[deselect]]`` tables: ``node``, ``why`` and optional ``releases`` (a PEP 440
        specifier; every release when absent)."""
        if not isinstance(entries, list):
            raise TypeError(f"{path}: deselect must be an array of tables ([[deselect]])")
        result = []
        for entry in entries:
            if not isinstance(entry, dict) or entry.keys() - {"node", "releases", "why"}:
                raise ValueError(f"{path}: deselect entry {entry!r}: keys are node, releases, why")
            result.append(cls(node=entry["node"], releases=SpecifierSet(entry.get("releases", "")),
                              why=entry["why"].strip()))
        return tuple(result)

    def applies(self, release: Version) -> bool:
        return release in self.releases


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
    deselect: tuple[Deselect, ...]
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
            deselect=Deselect.load_all(data.get("deselect", []), path),
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
