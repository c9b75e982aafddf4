"""`vllm-patches list`: the series, in order, with its metadata."""

from __future__ import annotations

import argparse

from vllm_patches._catalog import series as _series
from vllm_patches._errors import EXIT_OK


def run(args: argparse.Namespace) -> int:
    series = _series.load()
    for number, fix in enumerate(series.fixes, start=1):
        upstream = f"upstream since v{fix.upstream_since}" if fix.upstream_since else "not upstream"
        if fix.backport:
            upstream = f"backport of PR {fix.backport} ({upstream})"
        print(f"{number}. {fix.id} {fix.slug}: {fix.title}")
        print(f"   needed on vLLM {fix.describe_needed()}; {upstream}")
        print(f"   bug {fix.bug}" + (f"; PR {fix.pr}" if fix.pr else ""))
        if args.verbose:
            for label, text in (("What", fix.what), ("Why", fix.why), ("How", fix.how),
                                ("Future", fix.future)):
                print(f"   {label}: " + "\n     ".join(text.splitlines()))
    lanes = ", ".join(f"v{r}" for r in series.lanes)
    print(f"patches for every release {series.describe_covered()} ({len(series.covered)}); "
          f"tests run on the lanes {lanes} (default v{series.default_release})")
    return EXIT_OK
