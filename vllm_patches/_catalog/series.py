"""The series: the ordered fixes, their metadata, the releases it covers and its lanes.

Data lives in ``series.toml`` (order, covered releases, lanes) and ``fixes/<id>.toml``
(one fix each, vllm-ascend's patch registry fields: What, Why, How, Related PR, Future
plan). This module only loads and interprets it; tests validate it against the overlays.
"""

from __future__ import annotations

import enum
import tomllib
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import Version

from vllm_patches._errors import UserError

if TYPE_CHECKING:
    from packaging.specifiers import SpecifierSet

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # vllm_patches/, above _catalog/
REPO_DIR = PACKAGE_DIR.parent
PATCHES_DIR = REPO_DIR / "patches"
UPSTREAM_PACKAGE = "vllm"


def describe_releases(releases: SpecifierSet | str) -> str:
    """A range as people write it, lower bound first: ``>=0.18.0,<0.24.0`` (packaging's own
    ``str`` sorts the clauses as text: ``<0.24.0,>=0.18.0``). Every range the tool prints
    goes through here."""
    clauses = filter(None, (clause.strip() for clause in str(releases).split(",")))
    return ",".join(sorted(clauses, key=lambda spec: (spec.startswith("<"), spec)))


def specifier_set(text: str) -> SpecifierSet:
    """A PEP 440 range. packaging.specifiers is imported when a range is first compared, not at
    start-up (a few ms that `status` and `apply` rarely need)."""
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(text)


class Need(enum.Enum):
    """What a fix is on a release: the one vocabulary of ``status``, ``list``, ``matrix``,
    the patches' series files and the plugin's log line."""

    NEEDED = "needed"
    UPSTREAM = "upstream"
    NOT_APPLICABLE = "not applicable"


@dataclass(frozen=True)
class PullRequestText:
    """What the pull request `export` sends says of a fix on a base from ``since`` on
    (``None``: the fix's first release): its purpose in one or two sentences and its
    root cause and design in a few. Words that hold on some releases only (a timeout up
    to v0.21, a lease from v0.22) are a variant that starts where they become true."""

    since: Version | None
    purpose: str
    details: str


@dataclass(frozen=True)
class Verdict:
    """``Fix.on``'s answer: the need, and for a fix not needed why (``since v0.24.0``,
    ``needed on vLLM >=0.19.0, not on v0.18.0``); for a needed fix, what its pull
    request says on that release (``words``)."""

    need: Need
    detail: str = ""
    words: PullRequestText | None = field(default=None, compare=False)

    @property
    def needed(self) -> bool:
        return self.need is Need.NEEDED

    def __str__(self) -> str:
        """As the patches' series files write it: ``upstream since v0.24.0``,
        ``not applicable: needed on ...``."""
        if self.need is Need.NOT_APPLICABLE:
            return f"{self.need.value}: {self.detail}"
        return f"{self.need.value} {self.detail}".strip()


@dataclass(frozen=True)
class UpstreamTestNote:
    """A test a fix's metadata names for some releases, and why: an upstream test in
    ``[[deselect]]`` (left out of the lane runs: the CPU, offline environment fails
    it) or ``[[timing_sensitive]]`` (rerun alone when it fails in a lane; see
    tools/lanes.py), or a fix test in ``[[fails_on_stock]]`` (it fails on stock of
    those releases only: another fix's bug, or a form of its own bug, is there). An
    upstream test whose expectation the fix changes is no note: the fix amends it
    (``test_overlays``)."""

    node: str
    releases_text: str  # PEP 440 specifier; "" for every release
    why: str

    @classmethod
    def load_all(cls, entries: object, path: Path, table: str) -> tuple[UpstreamTestNote, ...]:
        """``[[table]]`` tables: ``node``, ``why``, optional ``releases`` (a PEP 440
        specifier; every release when absent)."""
        keys = {"node", "releases", "why"}
        if not isinstance(entries, list):
            raise TypeError(f"{path}: {table} must be an array of tables ([[{table}]])")
        result = []
        for entry in entries:
            if not isinstance(entry, dict) or entry.keys() - keys:
                raise ValueError(f"{path}: {table} entry {entry!r}: keys are "
                                 f"{', '.join(sorted(keys))}")
            result.append(cls(node=entry["node"], releases_text=entry.get("releases", ""),
                              why=entry["why"].strip()))
        return tuple(result)

    @cached_property
    def releases(self) -> SpecifierSet:
        return specifier_set(self.releases_text)

    def applies(self, release: Version) -> bool:
        return release in self.releases

    def names(self, node: str) -> bool:
        """Whether ``node`` is this test: the node itself, or one of its parameters
        when the note names the test function."""
        return node == self.node or ("[" not in self.node and node.startswith(self.node + "["))


def is_pull_request(url: str) -> bool:
    """Whether an upstream link names a pull request (``.../pull/N``), not an issue: a
    PR description says ``Fixes #N`` only of issues (GitHub closes them on merge)."""
    return "/pull/" in url


def _pull_request_fields(data: dict, path: Path) -> dict[str, object]:
    """The ``export`` keys of a fix's metadata, checked: ``purpose`` and ``details``
    always; ``title`` exactly when the fix requires others (a series of several commits
    needs a title of its own; one commit's is its subject); ``relation`` exactly when
    ``pr`` names an upstream PR that is still open (no ``upstream_since``) or ``bug``
    names a PR rather than an issue (a PR is related to, never fixed). ``from``
    holds variants for bases from a release on: ``export.from."0.22.0".purpose``
    replaces ``purpose`` on v0.22.0 and later (until a later ``from``)."""
    export = data.get("export", {})
    unknown = export.keys() - {"title", "purpose", "details", "relation", "from"}
    if unknown:
        raise ValueError(f"{path}: export keys are details, from, purpose, relation, "
                         f"title; not {', '.join(sorted(unknown))}")
    for key, what in (("purpose", "the PR's purpose, one or two sentences"),
                      ("details", "root cause and design, a few sentences")):
        if key not in export:
            raise ValueError(f"{path}: export.{key} ({what}) is missing")
    if bool(export.get("title")) != bool(data.get("requires")):
        raise ValueError(f"{path}: export.title is required exactly when the fix requires "
                         "others (the title of their series)")
    open_pr = bool(data["pr"] and not data["upstream_since"]) or is_pull_request(data["bug"])
    if bool(export.get("relation")) != open_pr:
        raise ValueError(f"{path}: export.relation (one line: does the series supersede or "
                         "complement the open PR `pr` or `bug` names?) is required exactly "
                         "when `pr` names an open upstream PR or `bug` names a PR")
    texts = [PullRequestText(None, export["purpose"].strip(), export["details"].strip())]
    for since, variant in sorted(export.get("from", {}).items(), key=lambda i: Version(i[0])):
        if not variant or variant.keys() - {"purpose", "details"}:
            raise ValueError(f"{path}: export.from.\"{since}\" replaces purpose or details, "
                             f"not {', '.join(sorted(variant)) or 'nothing'}")
        texts.append(PullRequestText(Version(since),
                                     variant.get("purpose", texts[-1].purpose).strip(),
                                     variant.get("details", texts[-1].details).strip()))
    return {"pr_title": export.get("title", ""), "pr_texts": tuple(texts),
            "pr_relation": export.get("relation", "").strip()}


def _requirements_from(data: dict, path: Path) -> tuple[tuple[str, Version], ...]:
    """``requires_from``: for some of ``requires``, the release the requirement starts at."""
    starts = data.get("requires_from", {})
    stray = set(starts) - set(data.get("requires", ()))
    if stray:
        raise ValueError(f"{path}: requires_from names {', '.join(sorted(stray))}, "
                         "which requires does not")
    return tuple((fix_id, Version(since)) for fix_id, since in sorted(starts.items()))


def _run_time_requirements(data: dict, path: Path) -> tuple[str, ...]:
    """``requires_at_run_time``: a part of ``requires``."""
    at_run_time = tuple(data.get("requires_at_run_time", ()))
    stray = set(at_run_time) - set(data.get("requires", ()))
    if stray:
        raise ValueError(f"{path}: requires_at_run_time names {', '.join(sorted(stray))}, "
                         "which requires does not")
    return at_run_time


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
    # Where the fix is needed from (PEP 440 lower bounds only, see ``releases``): where it
    # ends is ``upstream_since``, and how far it is verified is the series' (``covered``).
    releases_text: str
    upstream_since: Version | None
    future: str
    overlays: tuple[str, ...]
    tests: tuple[str, ...]
    stock_fails: tuple[str, ...]
    upstream_tests: tuple[str, ...]
    deselect: tuple[UpstreamTestNote, ...]
    timing_sensitive: tuple[UpstreamTestNote, ...] = ()
    # Fix tests that pass on stock of some releases but fail on others, for another
    # fix's bug there or a form of the fix's own bug that only those releases have
    # (``[[fails_on_stock]]``): on those releases the lanes
    # expect them to fail on stock, as ``stock_fails``, and where the fix is upstream
    # they do not take them as proof of it (``upstream_proof_on``).
    fails_on_stock: tuple[UpstreamTestNote, ...] = ()
    # Upstream test modules whose tests the fix changes, amended by overlays at their
    # upstream paths in this repository (``tests/v1/...``, markers as in the overlays
    # under vllm_patches/): the fix's patch carries the amended tests.
    test_overlays: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()  # ids of the fixes this one is built on, applied before it
    # Of ``requires``, those the fix needs only when it runs, not for its patch to apply
    # (tests/tool/test_dependencies.py proves the others on the patches; the fix's own
    # tests prove these, failing without them).
    requires_at_run_time: tuple[str, ...] = ()
    # Of ``requires``, those that hold only from a release on (fix id, release): where
    # the two fixes' patches first touch the same lines (CONTRIBUTING.md, Overlays).
    requires_from: tuple[tuple[str, Version], ...] = ()
    # The pull request `export` sends for this fix and what it requires (``export.*``):
    # its title when that is a series of several commits, its purpose and details per
    # base (``on(release).words``), and how it relates to the open upstream PR ``pr``
    # names, if any.
    pr_title: str = ""
    pr_texts: tuple[PullRequestText, ...] = ()
    pr_relation: str = ""

    @classmethod
    def load(cls, path: Path) -> Fix:
        data = tomllib.loads(path.read_text())
        upper = [clause.strip() for clause in data["releases"].split(",")
                 if not clause.strip().startswith(">=")]
        if upper:
            raise ValueError(f"{path}: releases {data['releases']!r} says where the fix is needed "
                             f"from (>= only), not {', '.join(upper)}: its end is upstream_since, "
                             "and the newest release it is verified on is series.toml's covered")
        pull_request = _pull_request_fields(data, path)
        return cls(
            id=data["id"],
            slug=data["slug"],
            title=data["title"],
            what=data["what"].strip(),
            why=data["why"].strip(),
            how=data["how"].strip(),
            bug=data["bug"],
            pr=data["pr"],
            releases_text=data["releases"],
            upstream_since=Version(data["upstream_since"]) if data["upstream_since"] else None,
            future=data["future"],
            requires=tuple(data.get("requires", ())),
            requires_at_run_time=_run_time_requirements(data, path),
            requires_from=_requirements_from(data, path),
            overlays=tuple(data["overlays"]),
            tests=tuple(data["tests"]),
            stock_fails=tuple(data["stock_fails"]),
            upstream_tests=tuple(data.get("upstream_tests", ())),
            deselect=UpstreamTestNote.load_all(data.get("deselect", []), path, "deselect"),
            timing_sensitive=UpstreamTestNote.load_all(data.get("timing_sensitive", []), path,
                                                       "timing_sensitive"),
            fails_on_stock=UpstreamTestNote.load_all(data.get("fails_on_stock", []), path,
                                                     "fails_on_stock"),
            test_overlays=tuple(data.get("test_overlays", ())),
            **pull_request,
        )

    @cached_property
    def releases(self) -> SpecifierSet:
        return specifier_set(self.releases_text)

    @property
    def series_title(self) -> str:
        """The title of the pull request `export` sends for this fix: its commit subject,
        or, when it sends the fixes it requires too, the title that covers them all."""
        return self.pr_title or self.title

    @property
    def name(self) -> str:
        return f"{self.id}-{self.slug}"

    def requires_on(self, release: Version) -> tuple[str, ...]:
        """The ids of the fixes this one requires on ``release``: ``requires``, less
        those whose ``requires_from`` is a later release."""
        starts = dict(self.requires_from)
        return tuple(f for f in self.requires if f not in starts or release >= starts[f])

    def overlay_path(self, overlay: str) -> Path:
        return PACKAGE_DIR / overlay

    @staticmethod
    def upstream_path(overlay: str) -> str:
        """The upstream file an overlay mirrors, relative to a vLLM checkout."""
        return f"{UPSTREAM_PACKAGE}/{overlay}"

    def deselected(self, release: Version) -> list[str]:
        """The upstream test node ids left out of ``release``'s lane run."""
        return [entry.node for entry in self.deselect if entry.applies(release)]

    def timing_sensitive_on(self, release: Version) -> list[UpstreamTestNote]:
        """The upstream tests of ``release`` whose time limits a loaded machine can miss."""
        return [entry for entry in self.timing_sensitive if entry.applies(release)]

    def stock_fails_on(self, release: Version) -> tuple[str, ...]:
        """The fix tests that must fail on stock ``release``: ``stock_fails``, and those
        ``fails_on_stock`` names for it."""
        return self.stock_fails + self._failing_for_another_bug_on(release)

    def upstream_proof_on(self, release: Version) -> tuple[str, ...]:
        """Where upstream fixed the bug: the reproductions that must pass on stock
        ``release``, ``stock_fails`` less those ``fails_on_stock`` names for it (another
        fix's bug there)."""
        other_bug = set(self._failing_for_another_bug_on(release))
        return tuple(node for node in self.stock_fails if node not in other_bug)

    def _failing_for_another_bug_on(self, release: Version) -> tuple[str, ...]:
        """The fix tests ``fails_on_stock`` names for ``release``."""
        return tuple(entry.node for entry in self.fails_on_stock if entry.applies(release))

    @property
    def backport(self) -> str:
        """The upstream PR this fix backports (``#44409``) when it is needed on releases
        before ``upstream_since``; "" for a fix upstream has not merged."""
        if self.upstream_since is None or not self.pr:
            return ""
        starts = [Version(clause.strip()[2:]) for clause in self.releases_text.split(",")]
        return "#" + self.pr.rsplit("/", 1)[1] if min(starts) < self.upstream_since else ""

    def describe_needed(self) -> str:
        """Where the fix is needed: ``releases`` up to ``upstream_since`` (``>=0.18.0,<0.24.0``)."""
        end = f",<{self.upstream_since}" if self.upstream_since else ""
        return describe_releases(self.releases_text + end)

    def on(self, release: Version) -> Verdict:
        """What the fix is on ``release``: every command and the runtime ask this, and only
        this. Needed from ``releases`` on until ``upstream_since``; whether ``release`` is
        one the series is verified on is the series' question (``Series.supported``).
        A needed fix's verdict carries what its pull request says on that release."""
        if self.upstream_since is not None and release >= self.upstream_since:
            return Verdict(Need.UPSTREAM, f"since v{self.upstream_since}")
        if release not in self.releases:
            return Verdict(Need.NOT_APPLICABLE,
                           f"needed on vLLM {self.describe_needed()}, not on v{release}")
        words = [t for t in self.pr_texts if t.since is None or release >= t.since]
        return Verdict(Need.NEEDED, words=words[-1] if words else None)


@dataclass(frozen=True)
class SeriesTests:
    """Tests that no single fix makes pass: a protocol several fixes keep together (the
    NIXL release protocol: F2 on the producer, F6 on the decoder). The lanes run them
    as they run a fix's tests on the releases in ``releases_text`` (``stock_fails`` fail
    on stock; every test passes patched and through the runtime plugin); ``export``
    never sends them, since a fix exported alone could not pass them."""

    tests: tuple[str, ...] = ()
    stock_fails: tuple[str, ...] = ()
    releases_text: str = ""

    def applies(self, release: Version) -> bool:
        return bool(self.tests) and release in specifier_set(self.releases_text)

    def stock_fails_on(self, release: Version) -> tuple[str, ...]:
        """The tests that must fail on stock ``release`` (as ``Fix.stock_fails_on``)."""
        return self.stock_fails


@dataclass(frozen=True)
class Series:
    fixes: tuple[Fix, ...]
    # Covered releases whose tests CI runs (tools/lanes.py); the first is the default.
    # ``load`` appends the newest covered release: it is always a lane.
    lanes: tuple[Version, ...]
    # Every release patches/ holds a directory for, oldest first (lanes included). Its
    # last entry is the newest release the series is verified on, written only there.
    covered: tuple[Version, ...] = ()
    # Tests of the series as a whole (``[series_tests]`` in series.toml).
    series_tests: SeriesTests = SeriesTests()
    # Lanes that run upstream's suites only for the fixes that start at their release
    # (``narrow_lanes`` in series.toml); every lane runs every fix test.
    narrow_lanes: frozenset[Version] = frozenset()

    @property
    def default_release(self) -> Version:
        return self.lanes[0]

    @property
    def ids(self) -> list[str]:
        return [fix.id for fix in self.fixes]

    def fix(self, fix_id: str) -> Fix:
        for fix in self.fixes:
            if fix.id == fix_id:
                return fix
        known = ", ".join(f.id for f in self.fixes)
        raise UserError(f"unknown fix {fix_id!r} (the series has {known})")

    def with_requirements(self, fix: Fix, release: Version) -> list[Fix]:
        """``fix`` and every fix it requires on ``release``, directly or not, in series
        order (``Fix.requires_on``)."""
        wanted = {fix.id}
        pending = [fix]
        while pending:
            for required in pending.pop().requires_on(release):
                if required not in wanted:
                    wanted.add(required)
                    pending.append(self.fix(required))
        return [f for f in self.fixes if f.id in wanted]

    def applicable(self, release: Version) -> list[Fix]:
        """The fixes ``release`` needs, in series order."""
        return [fix for fix in self.fixes if fix.on(release).needed]

    def suites_run_on(self, release: Version) -> list[Fix]:
        """The fixes whose upstream suites the lane of ``release`` runs: every fix the
        release needs, or on a narrow lane those it needs and the covered release
        before it does not (the fixes that start there; the others' suites run on
        the lanes around it)."""
        fixes = self.applicable(release)
        earlier = [r for r in self.covered if r < release]
        if release not in self.narrow_lanes or not earlier:
            return fixes
        return [fix for fix in fixes if not fix.on(earlier[-1]).needed]

    @property
    def newest(self) -> Version:
        """The newest release the series is verified on: the one upper bound of the
        series (``covered``'s last entry). Fixes and overlay markers say where they start;
        how far they hold is this."""
        return self.covered[-1]

    @property
    def supported(self) -> SpecifierSet:
        """The releases the series is verified on: the oldest covered one's minor series
        (X.Y.0) through ``newest``. Runtime activation and ``matrix`` take this range."""
        oldest = self.covered[0]
        return specifier_set(f">={oldest.major}.{oldest.minor}.0,<={self.newest}")

    def describe_covered(self) -> str:
        return f"v{self.covered[0]} .. v{self.newest}" if self.covered else "none"

    def require_covered(self, release: Version) -> None:
        """Refuse a release that patches/ has no directory for (``--release`` of regen, export)."""
        if release not in self.covered:
            raise UserError(f"vLLM v{release} is not a release the series covers "
                            f"({self.describe_covered()}; see series.toml)")


@cache
def load() -> Series:
    """The series as ``series.toml`` and ``fixes/*.toml`` declare it."""
    data = tomllib.loads((PACKAGE_DIR / "series.toml").read_text())
    fixes = tuple(Fix.load(PACKAGE_DIR / "fixes" / f"{fix_id}.toml") for fix_id in data["order"])
    covered = tuple(Version(r) for r in data["covered"])
    lanes = tuple(Version(r) for r in data["lanes"])
    if covered and covered[-1] not in lanes:
        lanes += (covered[-1],)
    whole = data.get("series_tests", {})
    series_tests = SeriesTests(tests=tuple(whole.get("tests", ())),
                               stock_fails=tuple(whole.get("stock_fails", ())),
                               releases_text=whole.get("releases", ""))
    narrow = frozenset(Version(r) for r in data.get("narrow_lanes", ()))
    if not narrow <= set(lanes):
        raise ValueError("series.toml: narrow_lanes names a release that lanes does not")
    return Series(fixes=fixes, lanes=lanes, covered=covered, series_tests=series_tests,
                  narrow_lanes=narrow)
