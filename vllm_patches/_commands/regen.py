"""`vllm-patches regen`: patches/ written again from the overlays, or (--check) compared."""

from __future__ import annotations

import argparse

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
    for number, release in enumerate(releases, start=1):
        with _progress.step(f"regen v{release} ({number}/{len(releases)})"):
            files = _patch_writer.render(series, release, _releases.fetch(release))
        existing = _patchset.committed(release)
        if files == existing:
            print(f"v{release}: up to date ({count(_patch_count(files), 'patch', 'patches')})")
            continue
        if args.check:
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
    if stale:
        raise Refused("patches/ is stale, run `vllm-patches regen`: " + "; ".join(stale))
    return EXIT_OK


def _patch_count(files: dict[str, str]) -> int:
    return sum(name.endswith(".patch") for name in files)
