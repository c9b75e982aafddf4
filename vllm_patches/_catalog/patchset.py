"""The committed patches of one release, read from the files alone (no git, no libcst),
so that `status` and `apply` start fast and work offline: their order (quilt's
``series``) and, from the ``--full-index`` blob ids, each touched file's content after
0 .. n patches (``PatchSet.positions``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from vllm_patches._catalog import series as _series
from vllm_patches._catalog.series import Fix, Series
from vllm_patches._errors import UserError
from vllm_patches._git import Identity

SERIES_FILE = "series"
SERIES_HEADER = "# vllm-patches series for"  # the series file's first line
# The author of every committed patch (and the committer `apply` falls back to where the
# user has no git identity).
PATCH_AUTHOR = Identity("vllm-patches maintainers", "vllm-patches@users.noreply.github.com")
# git's id of "no file" on either side of a diff (file created or deleted).
NO_BLOB = "0" * 40

# Blob ids of the touched files at one position of a series: path -> blob id, or None
# where the file does not exist.
Blobs = dict[str, str | None]

_DIFF = re.compile(r"^diff --git a/(\S+) b/(\S+)$")
_INDEX = re.compile(r"^index ([0-9a-f]{40})\.\.([0-9a-f]{40})(?: (\d{6}))?$")
_NEW_MODE = re.compile(r"^(?:new|deleted) file mode (\d{6})$")


def patches_dir() -> Path:
    """Where the committed patches are: inside the package when installed from a wheel."""
    bundled = _series.PACKAGE_DIR / "patches"
    return bundled if bundled.is_dir() else _series.PATCHES_DIR


def release_dir(release: Version) -> Path:
    return patches_dir() / f"v{release}"


def patch_filename(number: int, fix: Fix) -> str:
    """``0001-F1-two-phase-computed-block-allocation.patch``: position, id, slug."""
    return f"{number:04d}-{fix.name}.patch"


def committed(release: Version) -> dict[str, str]:
    """File name -> text of every file in ``patches/v<release>/`` ({} when absent)."""
    directory = release_dir(release)
    if not directory.is_dir():
        return {}
    return {path.name: path.read_text() for path in sorted(directory.iterdir())}


@dataclass(frozen=True)
class FileChange:
    """One file a patch changes: its blob id (None: absent) and mode, before and after."""

    before: str | None
    after: str | None
    mode: str


@dataclass(frozen=True)
class Patch:
    """The committed patch of one fix for one release."""

    fix: Fix
    path: Path
    changes: dict[str, FileChange]  # upstream path -> change

    @classmethod
    def read(cls, fix: Fix, path: Path) -> Patch:
        changes: dict[str, FileChange] = {}
        current = mode = None
        for line in path.read_text().splitlines():
            if match := _DIFF.match(line):
                old, new = match.groups()
                if old != new:
                    raise UserError(f"{path}: renames {old} to {new}; regenerate it")
                current, mode = new, None
            elif current and (match := _NEW_MODE.match(line)):
                mode = match.group(1)
            elif current and (match := _INDEX.match(line)):
                before, after, index_mode = match.groups()
                changes[current] = FileChange(None if before == NO_BLOB else before,
                                              None if after == NO_BLOB else after,
                                              index_mode or mode or "100644")
                current = None
        if not changes:
            raise UserError(f"{path}: not a `git format-patch --full-index` patch; "
                            "run `vllm-patches regen`")
        return cls(fix, path, changes)


@dataclass(frozen=True)
class PatchSet:
    """The release's patches in series order, one per fix the release needs."""

    release: Version
    patches: tuple[Patch, ...]

    @classmethod
    def load(cls, series: Series, release: Version) -> PatchSet:
        """The committed patches of ``release``, as its series file lists them.

        The series file names every fix of the series once, in order: its patch, or a
        comment saying why the release does not take it. Only that shape is checked here;
        that the patches are the ones the metadata's ranges call for is what `regen --check`
        (CI) and tests/tool/test_series.py prove, so reading them compares no range.
        """
        directory = release_dir(release)
        series_file = directory / SERIES_FILE
        if not series_file.is_file():
            raise UserError(f"no patches for vLLM v{release} in {directory.parent} "
                            f"(run `vllm-patches regen --release v{release}`)")
        lines = [line for line in series_file.read_text().splitlines()
                 if line and not line.startswith(SERIES_HEADER)]
        patches = []
        for fix, line in zip(series.fixes, lines):
            if line == patch_filename(len(patches) + 1, fix):
                patches.append(Patch.read(fix, directory / line))
            elif not line.startswith(f"# {fix.name}: "):
                break
        else:
            if len(lines) == len(series.fixes):
                return cls(release, tuple(patches))
        raise UserError(f"{series_file} does not match the series ({', '.join(series.ids)}); "
                        f"run `vllm-patches regen --release v{release}`")

    def paths(self) -> list[str]:
        """Every file the patches touch, sorted."""
        return sorted({path for patch in self.patches for path in patch.changes})

    def blobs_of(self, numbers: frozenset[int]) -> Blobs | None:
        """The touched files' blob ids with exactly the patches ``numbers`` (1-based)
        applied, where the patch ids say it: each file's patches among ``numbers`` must
        be the first of those that change it (patch k's ids are those of the tree with
        patches 1..k-1). None where they do not (another order, or a file whose earlier
        patch is missing: only git can tell what that file is then)."""
        blobs: Blobs = {}
        for path in self.paths():
            touching = [n for n, p in enumerate(self.patches, start=1) if path in p.changes]
            held = [n for n in touching if n in numbers]
            if held != touching[:len(held)]:
                return None
            change = self.patches[(held or touching)[-1 if held else 0] - 1].changes[path]
            blobs[path] = change.after if held else change.before
        return blobs

    def recognize(self, blobs: Blobs) -> frozenset[int] | None:
        """The patches (numbers) a tree whose touched files have ``blobs`` holds, when
        the patch ids alone say it (``blobs_of``); None otherwise."""
        count = len(self.patches)
        for mask in range(1 << count):
            numbers = frozenset(n for n in range(1, count + 1) if mask >> (n - 1) & 1)
            if self.blobs_of(numbers) == blobs:
                return numbers
        return None

    def positions(self) -> list[Blobs]:
        """The touched files' blob ids after 0 (the release), 1, .. n patches."""
        paths = self.paths()
        current: Blobs = {}
        for path in paths:
            first = next(p.changes[path] for p in self.patches if path in p.changes)
            current[path] = first.before
        result = [dict(current)]
        for patch in self.patches:
            current.update({path: change.after for path, change in patch.changes.items()})
            result.append(dict(current))
        return result
