"""`vllm-patches regen`: patches/ written again from the overlays, or (--check) compared."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from packaging.version import Version

from vllm_patches import _progress
from vllm_patches._catalog import patchset as _patchset
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._engine import patch_writer as _patch_writer
from vllm_patches._errors import EXIT_OK, Refused
from vllm_patches._plural import count


def run(args: argparse.Namespace) -> int:
    series = _series.load()
    for release in args.release or ():
        series.require_covered(release)
    _patch_writer.require_ruff()
    releases = args.release or list(series.covered)
    stale = []
    if not args.release:  # directories of releases the series no longer covers
        for directory in sorted(_patchset.patches_dir().glob("v*")):
            if directory.is_dir() and directory.name not in {f"v{r}" for r in series.covered}:
                if args.check:
                    stale.append(f"{directory.name}: not a covered release")
                    continue
                for path in directory.iterdir():
                    path.unlink()
                directory.rmdir()
                print(f"{directory.name}: removed (not covered)")
    # One release per core at a time: each renders in a scratch index and object store
    # of its own (the cached release is only read), and --check of every covered release
    # took 154 s one at a time on 2 cores (2026-11-29).
    with ProcessPoolExecutor(max_workers=min(len(releases), os.cpu_count() or 1)) as pool:
        rendered = pool.map(_rendered, releases)
        stale += _written_or_compared(args.check, releases, rendered)
    if stale:
        raise Refused("patches/ is stale, run `vllm-patches regen`: " + "; ".join(stale))
    return EXIT_OK


def _rendered(release: Version) -> dict[str, str]:
    """``release``'s files of patches/, rendered in a worker process."""
    return _patch_writer.render(_series.load(), release, _releases.fetch(release))


def _written_or_compared(check: bool, releases: list[Version],
                         rendered: Iterator[dict[str, str]]) -> list[str]:
    """Each release's rendered files written to patches/, or (``check``) compared with
    them; the stale releases, one line each."""
    stale = []
    for number, release in enumerate(releases, start=1):
        with _progress.step(f"regen v{release} ({number}/{len(releases)})"):
            files = next(rendered)
        existing = _patchset.committed(release)
        if files == existing:
            print(f"v{release}: up to date ({count(_patch_count(files), 'patch', 'patches')})")
            continue
        if check:
            changed = sorted(name for name in files.keys() | existing.keys()
                             if files.get(name) != existing.get(name))
            stale.append(f"v{release}: {', '.join(changed)}")
            continue
        directory = _patchset.release_dir(release)
        directory.mkdir(parents=True, exist_ok=True)
        for name in existing.keys() - files.keys():
            (directory / name).unlink()
        for name, text in files.items():
            (directory / name).write_text(text)
        print(f"v{release}: wrote {count(_patch_count(files), 'patch', 'patches')} to {directory}")
    return stale


def _patch_count(files: dict[str, str]) -> int:
    return sum(name.endswith(".patch") for name in files)
