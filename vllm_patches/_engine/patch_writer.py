"""Overlays -> git patches: splice each fix into a release tree, commit, format-patch.

Patch k of a release is the diff between the tree with fixes 1..k spliced in and the
tree with fixes 1..k-1, so a later fix that changes a method an earlier one changed
applies on top of it. Commits are built in a scratch index (no work tree is touched)
with a fixed identity and date, so the same overlays always give the same bytes.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import Version

from vllm_patches import _git
from vllm_patches._catalog import patchset as _patchset
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.patchset import PATCH_AUTHOR
from vllm_patches._catalog.series import Fix, Series
from vllm_patches._engine import fingerprint as _fingerprint
from vllm_patches._engine.splice import Overlay, check_bounds, splice
from vllm_patches._errors import UserError

# A fixed date keeps regenerated patches byte-identical.
PATCH_COMMITS = replace(PATCH_AUTHOR, date="2026-11-22T00:00:00Z")


@dataclass(frozen=True)
class ReleasePatch:
    """The generated patch of one fix for one release."""

    fix: Fix
    number: int  # 1-based position among the patches of this release
    text: str

    @property
    def filename(self) -> str:
        return _patchset.patch_filename(self.number, self.fix)


def commit_message(fix: Fix, release: Version, upstream_commit: str | None) -> str:
    """Subject, Why/How body, DEP-3 trailers and Signed-off-by for ``fix``."""
    origin = f"backport, {fix.pr}" if fix.upstream_since else "vendor, vllm-patches"
    base = f"vLLM v{release}" + (f" ({upstream_commit})" if upstream_commit else "")
    trailers = [
        f"Origin: {origin}",
        f"Bug: {fix.bug}",
        f"Forwarded: {fix.pr or 'no'}",
    ]
    if fix.upstream_since:
        trailers.append(f"Applied-Upstream: v{fix.upstream_since}")
    trailers += [
        f"Base: {base}",
        f"Vllm-Patches-Fix: {fix.id}",
        PATCH_AUTHOR.sign_off,
    ]
    return "\n\n".join(
        [fix.title, f"Why:\n{fix.why}", f"How:\n{fix.how}", "\n".join(trailers)]
    ) + "\n"


def _overlay_files(fixes: list[Fix]) -> dict[str, Path]:
    """Upstream path -> the overlay that amends it: the fixes' code overlays (under
    vllm_patches/) and the upstream tests they change (``test_overlays``, at their own
    paths in this repository)."""
    code = {Fix.upstream_path(o): _series.PACKAGE_DIR / o for f in fixes for o in f.overlays}
    return code | {test: _series.REPO_DIR / test for f in fixes for test in f.test_overlays}


def spliced_sources(tree: Path, base: str, fixes: list[Fix], release: Version,
                    done: dict[tuple, str] | None = None) -> dict[str, str]:
    """Upstream path -> source with ``fixes`` (in series order) spliced in.

    ``done`` keeps each file's splice by the definitions it took: ``generate`` asks for
    fixes[:1], fixes[:2], ... in turn, and a file the next fix does not touch takes the
    same definitions again (without it, regen is quadratic in the series' length)."""
    ids = [fix.id for fix in fixes]
    overlays = _overlay_files(fixes)
    done = {} if done is None else done
    sources: dict[str, str] = {}
    for upstream_path, path in overlays.items():
        parsed = Overlay.parse(path, overlays.values())
        definitions = parsed.select(ids, release)
        if not definitions:
            continue  # an overlay for another layout (e.g. a file older releases had)
        key = (upstream_path, tuple((d.source, d.position) for d in definitions))
        if key not in done:
            overlay = path.relative_to(_series.REPO_DIR)
            upstream = _git.file_at(tree, base, upstream_path)
            if upstream is None:
                raise UserError(f"v{release} has no {upstream_path} (overlay {overlay})")
            spliced = sort_imports(tree, upstream_path, splice(upstream, definitions, parsed))
            done[key] = format_changes(tree, upstream_path, spliced, upstream)
        sources[upstream_path] = done[key]
    return sources


def require_ruff() -> None:
    """Generating patches runs ruff, from the dev extras: ``regen`` and ``matrix`` call
    this before they fetch anything, so that its absence is one line up front."""
    if importlib.util.find_spec("ruff") is None:
        raise UserError("regen and matrix need ruff, from the dev extras: in a vllm-patches "
                        "clone, python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'")


# Regen asks the same of ruff again and again: upstream's own module for every fix that
# changes it, and a spliced file format_changes found formatted when check_formatted
# checks it. A tree is the pristine cache (only ``fetch`` changes it), so the answer
# holds for the run.
@functools.lru_cache(maxsize=64)
def _ruff(tree: Path, upstream_path: str, source: str, *args: str) -> subprocess.CompletedProcess:
    """Run ruff on ``source`` as if it were ``tree``'s file ``upstream_path`` (its config)."""
    require_ruff()
    return subprocess.run(
        # --no-cache: never write .ruff_cache into the tree (the tool's pristine cache).
        [sys.executable, "-m", "ruff", *args, "--no-cache", "--stdin-filename", upstream_path, "-"],
        check=False,  # the callers read the exit code
        cwd=tree,
        input=source,
        capture_output=True,
        text=True,
    )


def sort_imports(tree: Path, upstream_path: str, source: str) -> str:
    """``source`` with its imports sorted by ruff's isort rule (I001) under the release's
    config: the splice adds imports after upstream's last one, and this puts them where
    vLLM's own pre-commit would."""
    proc = _ruff(tree, upstream_path, source, "check", "--select", "I001", "--fix-only",
                 "--exit-zero", "--quiet")
    if proc.returncode != 0:
        raise UserError(f"ruff could not sort the imports of spliced {upstream_path}: "
                        + (proc.stderr or proc.stdout).strip()[-500:])
    return proc.stdout


def format_changes(tree: Path, upstream_path: str, source: str, upstream: str) -> str:
    """``source`` with the upstream lines it rewrites formatted by ruff (``--range``,
    under the release's config), when ruff would change any: a hook wraps an upstream
    expression (``return f(<x>)``) whose lines ruff lays out anew. Upstream's other
    lines keep their layout, formatted or not, and lines an overlay adds are left as
    written (``check_formatted`` holds them to ruff's format)."""
    if not _unformatted(tree, upstream_path, source)[0]:
        return source
    changes = difflib.SequenceMatcher(
        None, upstream.splitlines(), source.splitlines(), autojunk=False).get_opcodes()
    # From the last change up, so that formatting one leaves the lines above in place.
    for _tag, _i1, _i2, first, end in reversed([c for c in changes if c[0] == "replace"]):
        # Lines first+1 .. end, 1-based: from the start of the first to that of the next.
        proc = _ruff(tree, upstream_path, source, "format", "--range", f"{first + 1}-{end + 1}")
        if proc.returncode != 0:
            raise UserError(f"ruff could not format spliced {upstream_path}: "
                            + proc.stderr.strip()[-500:])
        source = proc.stdout
    return source


def _unformatted(tree: Path, upstream_path: str, source: str) -> tuple[set[str], str]:
    """The lines ``ruff format`` would change in ``source`` (``tree``'s config), and its
    report; no lines when it is formatted."""
    proc = _ruff(tree, upstream_path, source, "format", "--diff")
    if proc.returncode == 0:
        return set(), ""
    # --diff prints what ruff would change (on stdout; errors on stderr).
    lines = {line for line in proc.stdout.splitlines()
             if line.startswith("-") and not line.startswith("---")}
    return lines or {proc.stderr}, (proc.stdout + proc.stderr).strip()


def check_formatted(tree: Path, upstream_path: str, source: str, upstream: str) -> None:
    """The spliced file must pass ``ruff format --check`` under the release's own config,
    but for lines of ``upstream`` that fail it already (an upstream test module written
    for another ruff version than the dev extras pin): what the splice wrote is formatted."""
    lines, report = _unformatted(tree, upstream_path, source)
    if lines and lines - _unformatted(tree, upstream_path, upstream)[0]:
        raise UserError(
            f"spliced {upstream_path} is not ruff-formatted under {tree.name}'s config; "
            "format the overlay:\n" + report[-2000:]
        )


def _undefined(tree: Path, upstream_path: str, source: str) -> set[str]:
    """The names ruff finds undefined in ``source`` (F821, ``tree``'s config)."""
    proc = _ruff(tree, upstream_path, source, "check", "--select", "F821", "--exit-zero",
                 "--output-format", "concise", "--quiet")
    return {line.split("`")[1] for line in proc.stdout.splitlines() if line.count("`") >= 2}


def check_names(tree: Path, upstream_path: str, source: str, upstream: str) -> None:
    """Every global name the spliced code uses resolves in the upstream module (overlays
    use upstream's own names unimported: ``_overlay``); names upstream leaves undefined
    already are not the splice's."""
    names = _undefined(tree, upstream_path, source) - _undefined(tree, upstream_path, upstream)
    if names:
        raise UserError(f"spliced {upstream_path} ({tree}) uses {', '.join(sorted(names))}, "
                        "which neither the upstream module nor the overlay's imports define")


def generate(series: Series, release: Version, tree: Path) -> list[ReleasePatch]:
    """The patches of ``release``, generated from the overlays against ``tree``.

    ``tree`` is a git checkout whose HEAD is the pristine release (what ``fetch`` makes).
    The commits are built in a scratch index and a scratch object store (the checkout's
    own objects are read through it as an alternate), so ``tree`` is never written: it
    is the tool's cache, which only ``fetch`` changes. One ``format-patch`` of the whole
    range numbers them ``[PATCH k/n]``.
    """
    base = _git.head(tree)
    upstream_commit = _releases.upstream_commit(tree)
    applicable = series.applicable(release)
    check_bounds(_overlay_files(applicable).values(), {fix.id for fix in applicable})
    splices: dict[tuple, str] = {}
    written: dict[str, str] = {}
    with _git.commits(tree, base, PATCH_COMMITS.env(), isolated=True) as commits:
        for number, fix in enumerate(applicable, start=1):
            sources = spliced_sources(tree, base, applicable[:number], release, splices)
            for upstream_path, source in sources.items():
                if written.get(upstream_path) == source:
                    continue  # checked and written for an earlier fix
                upstream = _git.file_at(tree, base, upstream_path) or ""
                check_formatted(tree, upstream_path, source, upstream)
                check_names(tree, upstream_path, source, upstream)
                commits.write(upstream_path, source)
                written[upstream_path] = source
            if not commits.changed():
                raise UserError(f"{fix.id} changes nothing on v{release}: no overlay variant holds it")
            commits.commit(commit_message(fix, release, upstream_commit))
        texts = [text for _name, text in commits.patches("--full-index")]
    return [ReleasePatch(fix, number, text)
            for number, (fix, text) in enumerate(zip(applicable, texts, strict=True), start=1)]


def series_file(series: Series, release: Version, patches: list[ReleasePatch]) -> str:
    """quilt's series file: the patches in order; fixes not applied are comments saying why."""
    lines = [f"{_patchset.SERIES_HEADER} vLLM v{release}; generated, do not edit."]
    by_fix = {patch.fix.id: patch for patch in patches}
    for fix in series.fixes:
        if fix.id in by_fix:
            lines.append(by_fix[fix.id].filename)
        else:
            lines.append(f"# {fix.name}: {fix.on(release)}")
    return "\n".join(lines) + "\n"


def render(series: Series, release: Version, tree: Path) -> dict[str, str]:
    """File name -> content of ``patches/v<release>/``: the patches, the series file and
    the fingerprints of the fixes' targets."""
    patches = generate(series, release, tree)
    files = {patch.filename: patch.text for patch in patches}
    files[_patchset.SERIES_FILE] = series_file(series, release, patches)
    # What the runtime compares an uncovered release's installed code with (_fingerprint).
    files[_fingerprint.FILE] = _fingerprint.of_tree(series, release, tree, _git.head(tree))
    return files
