"""What status, apply and revert share: the chosen fixes, the checkout opened under its
repository's lock, the plan there, and its printout."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_patches._catalog import series as _series
from vllm_patches._checkout import checkout as _checkout
from vllm_patches._checkout import plan as _plan
from vllm_patches._errors import EXIT_OK, UserError


def chosen(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The fix ids of every ``--fix`` (repeated, or comma lists), in series order; None
    without one. An unknown id is bad input, refused before anything is read."""
    if not args.fix:
        return None
    series = _series.load()
    given = {part.strip() for value in args.fix for part in value.split(",")}
    unknown = sorted(given - set(series.ids))
    if unknown:
        raise UserError(f"unknown fix {', '.join(unknown)} (the series has "
                        f"{', '.join(series.ids)})")
    return tuple(fix_id for fix_id in series.ids if fix_id in given)


def make_plan(checkout, args: argparse.Namespace, verb: str, three_way: bool = False):
    series = _series.load()
    release = _plan.resolve_release(checkout, series, args.release, verb)
    return _plan.make(checkout, series, release, three_way, chosen(args))


def opened(args: argparse.Namespace, verb: str, writes: bool):
    """The checkout under its repository's lock (``_checkout.opened``) for the verb."""
    check = getattr(args, "check", False)
    return _checkout.opened(Path(args.checkout), verb + (" --check" if check else ""),
                            writes=writes and not check)


def print_plan(plan) -> None:
    print(f"{plan.checkout.path}: vLLM v{plan.release}")
    for status in plan.statuses:
        print(f"  {status.line()}")
    busy = plan.checkout.operation_in_progress()
    for note in [*plan.notes(), *([busy] if busy else [])]:
        print(f"  note: {note}")


def report(plan, done, check: bool, verb: str, noun: str) -> int:
    print_plan(plan)
    ids = ", ".join(s.fix.id for s in done)
    if not done:
        print(f"nothing to {noun}")
    elif check:
        print(f"check passed: {ids} {verb} cleanly")
    else:
        print(f"done: {ids}")
    return EXIT_OK
