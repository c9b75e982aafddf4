"""`vllm-patches cache`: the cache of fetched releases, and reclaiming its space."""

from __future__ import annotations

import argparse

from vllm_patches._catalog import cache as _cache
from vllm_patches._catalog import series as _series
from vllm_patches._errors import EXIT_OK
from vllm_patches._plural import count


def run(args: argparse.Namespace) -> int:
    series = _series.load()
    if args.remove:
        chosen = _cache.of_releases(args.remove)
        absent = [r for r in args.remove if r not in {entry.release for entry in chosen}]
        for release in dict.fromkeys(absent):  # nothing to do: exit 0, as the contract says
            print(f"v{release}: nothing of this release is cached in {_cache.root()}")
        if not chosen:
            return EXIT_OK
        removed = _cache.remove(chosen)
    elif args.prune:
        removed = _cache.remove(_cache.prunable(series))
    elif args.clear:
        removed = _cache.remove(_cache.entries())
    else:
        print("\n".join(_cache.report(series)))
        return EXIT_OK
    print(f"removed {_cache.human(sum(e.size for e in removed))} "
          f"({count(len(removed), 'item')}) from {_cache.root()}")
    return EXIT_OK
