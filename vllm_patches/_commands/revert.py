"""`vllm-patches revert`: undo the applied fixes (or the chosen ones), all or nothing."""

from __future__ import annotations

import argparse

from vllm_patches._checkout import apply_revert as _apply_revert
from vllm_patches._commands.on_checkout import chosen, make_plan, opened, report


def run(args: argparse.Namespace) -> int:
    chosen(args)
    with opened(args, "revert", writes=True) as checkout:
        plan = make_plan(checkout, args, "revert")
        done, after = _apply_revert.revert(plan, commit=not args.no_commit, check=args.check)
        return report(after, done, args.check, "reverts", "revert")
