"""`vllm-patches fetch`: a release's source into the cache, as a git checkout."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_patches._catalog import releases as _releases
from vllm_patches._errors import EXIT_OK


def run(args: argparse.Namespace) -> int:
    if args.source:
        print(_releases.fetch_from_checkout(args.release_positional, Path(args.source)))
    else:
        print(_releases.fetch(args.release_positional))
    return EXIT_OK
