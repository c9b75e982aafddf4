"""The sweep of upstream between consecutive covered releases (``upstream_sweep.toml``):
each upstream change that fixed a KV-path bug some covered release still has, and what
the series does about it. ``load`` checks it against the series; ``render`` writes
docs/upstream-sweep.md (``tools/upstream_sweep.py``), kept fresh by tests/tool.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier
from packaging.version import Version

from vllm_patches._catalog.series import PACKAGE_DIR, REPO_DIR, Series, specifier_set

DATA = PACKAGE_DIR / "upstream_sweep.toml"
DOC = REPO_DIR / "docs" / "upstream-sweep.md"

# What the series does about a change: backports it (``fix``, or owed where no fix
# is written yet), has a fix that it interacts with (``fix``, and how in ``note``), or
# nothing, for the reason in ``note``.
KINDS = {"backport": "backport", "interacts": "interacts with", "unrelated": "not relevant"}


@dataclass(frozen=True)
class Change:
    upstream: str  # the upstream PR (or commit) that fixed it
    since: Version  # the first covered release that has it
    bug: str
    affected: str  # PEP 440: the covered releases that still have the bug
    kind: str
    fix: str  # the series fix that backports it or interacts with it; "" for none
    note: str  # how it interacts, or why there is no fix

    def releases(self, series: Series) -> list[Version]:
        return [r for r in series.covered if r in specifier_set(self.affected)]


@dataclass(frozen=True)
class Sweep:
    changes: tuple[Change, ...]
    coverage: str  # what the sweep read, and what it did not


def _check(change: Change, series: Series) -> None:
    where = f"{DATA.name}: {change.upstream}"
    if change.kind not in KINDS:
        raise ValueError(f"{where}: kind is one of {', '.join(KINDS)}, not {change.kind!r}")
    try:
        affected = change.releases(series)
    except InvalidSpecifier as exc:
        raise ValueError(f"{where}: affected is no PEP 440 specifier ({exc})") from None
    if not affected:
        raise ValueError(f"{where}: affected {change.affected!r} holds no covered release")
    if change.since not in series.covered or max(affected) >= change.since:
        raise ValueError(f"{where}: since must be a covered release after every affected one")
    if change.fix and change.fix not in series.ids:
        raise ValueError(f"{where}: fix {change.fix} is not in the series")
    if not change.fix and not change.note:
        raise ValueError(f"{where}: a change needs a series fix or a note saying why none")
    if change.kind == "interacts" and not (change.fix and change.note):
        raise ValueError(f"{where}: an interaction names the fix and says how (note)")
    if change.kind == "unrelated" and change.fix:
        raise ValueError(f"{where}: a change not relevant to the series names no fix")
    if change.kind == "backport" and change.fix in series.ids:
        fix = series.fix(change.fix)
        if (fix.pr, fix.upstream_since) != (change.upstream, change.since):
            raise ValueError(f"{where}: {fix.id} backports {fix.pr or 'nothing'} (upstream "
                             f"since {fix.upstream_since}), not this change")
        if not all(fix.on(r).needed for r in affected):
            raise ValueError(f"{where}: {fix.id} is not needed on every affected release")


def load(series: Series) -> Sweep:
    """The sweep, every change checked against ``series`` (ValueError says which and why)."""
    data = tomllib.loads(DATA.read_text())
    changes = tuple(Change(upstream=c["upstream"], since=Version(c["since"]), bug=c["bug"].strip(),
                           affected=c["affected"], kind=c["kind"], fix=c.get("fix", ""),
                           note=c.get("note", "").strip())
                    for c in data["change"])
    for change in changes:
        _check(change, series)
    return Sweep(changes, data["coverage"].strip())


def _link(url: str) -> str:
    kind, number = url.rstrip("/").rsplit("/", 2)[-2:]
    return f"[{'PR' if kind == 'pull' else kind} {number}]({url})"


def _releases(change: Change, series: Series) -> str:
    affected = change.releases(series)
    span = f"v{affected[0]}" if len(affected) == 1 else f"v{affected[0]} – v{affected[-1]}"
    return f"{span} ({len(affected)}; fixed in v{change.since})"


def _series_column(change: Change, series: Series) -> str:
    if change.fix:
        named = f"{change.fix} `{series.fix(change.fix).slug}`"
    else:
        named = "owed, not written" if change.kind == "backport" else ""
    kind = KINDS[change.kind]
    text = f"{kind}: {named}" if named else kind
    return f"{text}. {change.note}" if change.note else text


def render(series: Series, sweep: Sweep) -> str:
    """docs/upstream-sweep.md: the changes, oldest fix first, and what was read."""
    rows = sorted(sweep.changes, key=lambda c: (c.since, c.upstream))
    owed = [c for c in rows if c.kind == "backport" and not c.fix]
    lines = [
        "# Upstream fixes that older covered releases lack",
        "",
        ("<!-- generated from vllm_patches/upstream_sweep.toml by tools/upstream_sweep.py; "
        "do not edit -->"),
        "",
        (f"Upstream vLLM between every pair of consecutive covered releases "
        f"({series.describe_covered()}), over the KV path the series touches: each change "
        "that fixed a KV-path bug an older covered release still has, and what the series "
        "does about it: a backport (a fix of the series, or owed where none is written), "
        "a fix of the series it interacts with, or why it is not relevant. "
        f"{len(rows)} changes, {len(owed)} backports owed."),
        "",
        "| upstream | the bug | affected covered releases | series fix or reason |",
        "|---|---|---|---|",
    ]
    lines += [f"| {_link(c.upstream)} | {' '.join(c.bug.split())} | "
              f"{_releases(c, series)} | "
              f"{' '.join(_series_column(c, series).split())} |" for c in rows]
    lines += ["", "## What the sweep read", "", sweep.coverage]
    return "\n".join(lines) + "\n"
