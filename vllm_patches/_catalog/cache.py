"""The cache `fetch` fills: what it holds, how big it is, and removing parts of it.

Under ``$VLLM_PATCHES_CACHE`` (default ``~/.cache/vllm-patches``): ``src/vX.Y.Z/``, one
git checkout per fetched release (about 150 MB each: the files and their git objects),
and ``sdist/vllm-X.Y.Z.tar.gz``, the downloaded archive it was made from (about 40 MB,
only needed to make the checkout again without the network). Every covered release
fetched is about 4.5 GB. Only entries of these shapes are ever removed, so a cache
directory shared with other files keeps them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog.series import Series

CHECKOUT, ARCHIVE, LEFTOVER = "checkout", "archive", "interrupted fetch"


@dataclass(frozen=True)
class Entry:
    kind: str
    release: Version | None
    path: Path
    size: int  # bytes on disk


def root() -> Path:
    return _releases.cache_root()


def _disk_usage(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_blocks * 512
    total = 0
    for folder, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _release(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def entries() -> list[Entry]:
    """Everything the tool keeps in the cache, releases oldest first."""
    found = []
    src, sdist = _releases.checkouts_dir(), _releases.sdists_dir()
    for path in sorted(src.iterdir()) if src.is_dir() else ():
        release = _release(path.name.removeprefix("v")) if path.name.startswith("v") else None
        if release is not None and path.is_dir():
            found.append(Entry(CHECKOUT, release, path, _disk_usage(path)))
        elif path.name.startswith((".fetch-", "tmp")) and path.is_dir():
            found.append(Entry(LEFTOVER, None, path, _disk_usage(path)))
    for path in sorted(sdist.iterdir()) if sdist.is_dir() else ():
        name = path.name
        if name.startswith("vllm-") and name.endswith((".tar.gz", ".part")):
            version = name.removeprefix("vllm-").removesuffix(".tar.gz").removesuffix(".part")
            kind = LEFTOVER if name.endswith(".part") else ARCHIVE
            found.append(Entry(kind, _release(version), path, _disk_usage(path)))
    return sorted(found, key=lambda e: (e.release or Version("0"), e.kind))


def of_releases(releases: list[Version]) -> list[Entry]:
    return [entry for entry in entries() if entry.release in releases]


def prunable(series: Series) -> list[Entry]:
    """Archives (their checkout holds the same files), releases the series does not
    cover, and what interrupted fetches left."""
    return [entry for entry in entries() if entry.kind != CHECKOUT
            or entry.release not in series.covered]


def remove(chosen: list[Entry]) -> list[Entry]:
    for entry in chosen:
        if entry.path.is_dir():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink(missing_ok=True)
    return chosen


def human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def report(series: Series) -> list[str]:
    """The cache, one line per entry, with totals and how to reclaim."""
    found = entries()
    lines = [f"cache: {root()} ($VLLM_PATCHES_CACHE)"]
    for entry in found:
        label = f"v{entry.release}" if entry.release else entry.path.name
        note = "" if entry.release in series.covered or entry.kind == LEFTOVER else \
            " (not covered by the series)"
        lines.append(f"  {label:<10} {entry.kind:<18} {human(entry.size):>9}{note}")
    total = sum(entry.size for entry in found)
    pruned = sum(entry.size for entry in prunable(series))
    lines.append(f"total {human(total)}; `vllm-patches cache --prune` frees {human(pruned)}, "
                 "`--remove vX.Y.Z` one release, `--clear` all (fetch brings them back)")
    return lines
