"""`vllm-patches status`: per chosen fix, its state on the checkout."""

from __future__ import annotations

import argparse

from vllm_patches._checkout.plan import State
from vllm_patches._commands.on_checkout import chosen, make_plan, opened, print_plan
from vllm_patches._errors import EXIT_OK, EXIT_REFUSED


def run(args: argparse.Namespace) -> int:
    chosen(args)
    with opened(args, "status", writes=False) as checkout:
        plan = make_plan(checkout, args, "status", args.three_way)
        print_plan(plan)
    stopped = (State.CONFLICT, State.BLOCKED)
    return EXIT_REFUSED if any(s.state in stopped for s in plan.statuses) else EXIT_OK
