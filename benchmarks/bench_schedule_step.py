"""What the fixes cost a decoder's scheduler: ``Scheduler.schedule()`` per step with a
full batch of decoding requests, patched (every fix of the release) vs stock, as a ratio
measured in one run.

``schedule()`` calls ``allocate_slots`` for every running request in every step: F1
changes that method, and F25 redirects the call that admits a waiting request (a call
pattern; before, every call, which cost 10 %: benchmarks/README.md). The workload:
``--batch`` requests (64-token prompts) with a NIXL connector (as on a P/D decoder),
prefilled, then decoding one token a step; only ``schedule()`` is timed, with
the model runner's output fed back each step. Stock and patched trees of one release
(default v0.21.0, where F1 and F25 apply) are built like a lane (tools/lanes.py); each
measurement is a fresh subprocess of the lane's venv, stock and patched alternating.

Usage: python benchmarks/bench_schedule_step.py [--release v0.21.0] [--rounds 5] [--batch 64]
                                               [--fix ID[,ID...]]
``--fix``: the patched tree takes only those fixes (``vllm-patches apply --fix``), to
tell what each costs. Goal: patched/stock <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

STEPS = 1000
PROMPT_TOKENS = 64


def measure(batch: int) -> dict:
    """Runs inside the lane venv with a vLLM tree on PYTHONPATH (its upstream tests)."""
    from tests.v1.kv_connector.unit.utils import (
        create_model_runner_output,
        create_request,
        create_scheduler,
        create_vllm_config,
    )

    config = create_vllm_config(max_num_seqs=batch,
                                max_num_batched_tokens=batch * PROMPT_TOKENS)
    scheduler = create_scheduler(config, num_blocks=1 + batch * (PROMPT_TOKENS + STEPS) // 16 + batch)
    for i in range(batch):
        scheduler.add_request(create_request(request_id=i, num_tokens=PROMPT_TOKENS,
                                             max_tokens=STEPS + 10))
    timings = []
    for _ in range(STEPS):
        started = time.perf_counter_ns()
        output = scheduler.schedule()
        timings.append(time.perf_counter_ns() - started)
        running = [scheduler.requests[req_id] for req_id in output.num_scheduled_tokens]
        scheduler.update_from_output(output, create_model_runner_output(running))
    assert len(scheduler.running) == batch, "every request decodes to the last step"
    decode = sorted(timings[1:])  # the first step schedules the prefills
    return {"median_ns": decode[len(decode) // 2], "mean_ns": statistics.fmean(decode)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="v0.21.0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--fix", help="only these fixes in the patched tree (ID[,ID...])")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: run in a lane venv
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(int(args.measure))))
        return 0

    from _trees import stock_and_patched

    bench = stock_and_patched(args.release, args.fix)
    results = bench.alternate(__file__, str(args.batch), args.rounds)
    stock = statistics.median(results["stock"])
    patched = statistics.median(results["patched"])
    rounds = " ".join(f"{p / s:.3f}" for s, p in zip(results["stock"], results["patched"],
                                                      strict=True))
    print(f"vLLM v{bench.release}, {args.batch} requests decoding, NIXL connector, "
          f"{STEPS} steps x {args.rounds} rounds, patched: {args.fix or 'every fix'}")
    print(f"schedule() median: stock {stock / 1000:.1f} us, patched {patched / 1000:.1f} us")
    print(f"patched/stock = {patched / stock:.3f} (goal <= 1.03; rounds {rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
