"""The compatibility matrix: for every release the series covers, what each fix is there:
``patch`` (it splices and passes regen's checks), ``upstream``, ``not applicable``,
``conflict`` or ``no variant``. A release of the supported range on the index that the
series does not cover is reported.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from vllm_patches import _progress
from vllm_patches._catalog import cache as _cache
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.series import Fix, Series
from vllm_patches._engine import patch_writer as _patch_writer
from vllm_patches._errors import EXIT_OK, EXIT_REFUSED, UserError
from vllm_patches._plural import count

# A fix's cell: ``Need.UPSTREAM`` or ``Need.NOT_APPLICABLE``'s word where ``Fix.on`` says it
# is not needed; where it is, what generating its patch gave.
PATCH = "patch"
CONFLICT = "conflict"
NO_VARIANT = "no variant"
PROBLEMS = (CONFLICT, NO_VARIANT)

# The file that holds the generated section (`matrix --write-readme`), from the repository
# root: README keeps a summary and links to it.
DOC = Path("docs") / "supported-releases.md"
BEGIN = "<!-- matrix:begin -->"
END = "<!-- matrix:end -->"
NO_VARIANT_MESSAGE = "no overlay variant holds it"


@dataclass(frozen=True)
class Cell:
    state: str
    detail: str = ""


@dataclass(frozen=True)
class Row:
    release: Version
    cells: dict[str, Cell]  # fix id -> cell
    lane: bool


def releases_in_range(series: Series, available: list[Version]) -> list[Version]:
    return sorted(release for release in available if release in series.supported)


def _failure(exc: UserError) -> Cell:
    message = str(exc)
    return Cell(NO_VARIANT if NO_VARIANT_MESSAGE in message else CONFLICT, message)


def row(series: Series, release: Version, tree: Path) -> Row:
    """The matrix row of ``release``, its patches generated against ``tree`` (a fetched release)."""
    cells: dict[str, Cell] = {}
    for fix in series.fixes:
        verdict = fix.on(release)
        if not verdict.needed:
            cells[fix.id] = Cell(verdict.need.value, verdict.detail)
    needed = series.applicable(release)
    try:
        _patch_writer.generate(series, release, tree)
        cells.update({fix.id: Cell(PATCH) for fix in needed})
    except UserError:
        # Find the culprit: each fix on top of those before it that went in cleanly.
        clean: list[Fix] = []
        for fix in needed:
            try:
                _patch_writer.generate(Series((*clean, fix), series.lanes, series.covered),
                                       release, tree)
            except UserError as exc:
                cells[fix.id] = _failure(exc)
                continue
            clean.append(fix)
            cells[fix.id] = Cell(PATCH)
    return Row(release, {fix.id: cells[fix.id] for fix in series.fixes},
               release in series.lanes)


def compute(series: Series, releases: list[Version]) -> list[Row]:
    """Rows for ``releases``, fetching (or reusing the cached) source of each."""
    rows = []
    for number, release in enumerate(releases, start=1):
        with _progress.step(f"matrix v{release} ({number}/{len(releases)})"):
            rows.append(row(series, release, _releases.fetch(release)))
    return rows


def render_row(row_: Row) -> str:
    name = f"v{row_.release}" + (" (lane)" if row_.lane else "")
    return "| " + " | ".join([name, *(cell.state for cell in row_.cells.values())]) + " |"


def render_notes(row_: Row) -> list[str]:
    """One line per problem cell of the row (conflict / no variant, with the reason)."""
    return [f"- v{row_.release} {fix_id} {cell.state}: {cell.detail}"
            for fix_id, cell in row_.cells.items() if cell.state in PROBLEMS]


def render(series: Series, rows: list[Row], uncovered: list[Version] = ()) -> str:
    """The matrix as a Markdown table, a legend per fix, and the problems (``uncovered``:
    releases of the range on the index that the series does not cover)."""
    header = "| vLLM | " + " | ".join(f.id for f in series.fixes) + " |"
    lines = [header, "|---" * (len(series.fixes) + 1) + "|"]
    lines += [render_row(r) for r in rows]
    lines.append("")
    for fix in series.fixes:
        upstream = f"; upstream since v{fix.upstream_since}" if fix.upstream_since else ""
        lines.append(f"- {fix.id} `{fix.slug}`: needed on vLLM {fix.describe_needed()}{upstream}")
    notes = [note for r in rows for note in render_notes(r)]
    notes += [f"- v{release} is on the package index but not covered: add it to `covered` in "
              "series.toml and run `vllm-patches regen`" for release in uncovered]
    if notes:
        lines += ["", "Problems:", *notes]
    return "\n".join(lines) + "\n"


def generated_section(series: Series, rows: list[Row]) -> str:
    """The generated section of ``DOC``, markers included."""
    intro = (f"Every release the series covers, {series.describe_covered()}: each with a source "
             "archive on the package index (generated by `vllm-patches matrix --write-readme`; "
             "do not edit). `patch` means the fix's patch is generated from the overlays "
             "against that release, committed in `patches/vX.Y.Z/` and applies cleanly (lanes "
             "also run the tests), `upstream` that the release has the fix, `not applicable` that "
             "it does not need it. `status`, `apply`, `revert` and `export` accept exactly these "
             "releases; runtime activation runs on them, and on a later release of their minor "
             "series or a development build only where its code at every target is verified identical ([runtime "
             "activation](operator-guide.md#runtime-activation)); `vllm-patches matrix` reports "
             "a release of the range that the list lacks.")
    return (f"{BEGIN}\n{textwrap.fill(intro, 92, break_on_hyphens=False)}\n\n"
            f"{render(series, rows)}{END}")


SECTION = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.DOTALL)


def _section(text: str) -> re.Match[str]:
    match = SECTION.search(text)
    if not match:
        raise UserError(f"{DOC} has no {BEGIN} ... {END} section")
    return match


def replace_section(text: str, section: str) -> str:
    """``text`` (``DOC``'s) with its generated section replaced by ``section``."""
    match = _section(text)
    return text[:match.start()] + section + text[match.end():]


def generated_rows(text: str) -> dict[Version, str]:
    """Release -> its table line, from the generated section in ``text``."""
    rows = {}
    for line in _section(text).group(1).splitlines():
        found = re.match(r"^\| v(\d+\.\d+\.\d+)( \(lane\))? \|", line)
        if found:
            rows[Version(found.group(1))] = line
    return rows


def generated_notes(text: str, release: Version) -> list[str]:
    """The problem lines the generated section in ``text`` holds for ``release``."""
    return [line for line in _section(text).group(1).splitlines()
            if line.startswith(f"- v{release} ")]


def run(args: argparse.Namespace) -> int:
    series = _series.load()
    if args.write_readme and args.cached_only:
        raise UserError("--write-readme needs every covered release; drop --cached-only")
    _patch_writer.require_ruff()
    cached = set(_releases.cached_releases())
    if args.cached_only:
        releases, uncovered = [r for r in series.covered if r in cached], []
    else:
        releases = list(series.covered)
        uncovered = [r for r in releases_in_range(series, _releases.sdist_releases())
                     if r not in series.covered]
        missing = [r for r in releases if r not in cached]
        if missing:  # minutes of downloading: say so before the first
            print(f"matrix: fetching {count(len(missing), 'release')} not in the cache "
                  f"({_cache.human(_releases.download_size(missing))} to download; "
                  "`--cached-only` skips them)", file=sys.stderr, flush=True)
    rows = compute(series, releases)
    sys.stdout.write(render(series, rows, uncovered))
    if args.write_readme:
        doc = _series.REPO_DIR / DOC
        if not doc.is_file():
            raise UserError(f"{doc}: no such file (run from a vllm-patches checkout)")
        doc.write_text(replace_section(doc.read_text(),
                                               generated_section(series, rows)))
        print(f"wrote the matrix into {doc}")
    broken = [r for r in rows if any(c.state in PROBLEMS for c in r.cells.values())]
    return EXIT_REFUSED if broken or uncovered else EXIT_OK
