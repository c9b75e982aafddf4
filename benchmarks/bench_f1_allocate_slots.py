"""F1: cost of KVCacheManager.allocate_slots on a 3-group hybrid workload with prefix
hits and external tokens, patched vs stock, as a ratio measured in one run.

Stock and patched trees of one release (default v0.21.0) are built like a lane
(tools/lanes.py); each measurement runs in a fresh subprocess of the lane's venv,
alternating stock and patched for several rounds so drift affects both alike.
The workload: requests share one of 8 cached prefixes (4 blocks), carry 2 blocks
of external tokens and a unique tail; finished requests are freed so the pool
keeps turning over. Only the allocate_slots call is timed.

Usage: python benchmarks/bench_f1_allocate_slots.py [--release v0.21.0] [--rounds 5]
Goal: patched/stock <= 1.03.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STEPS = 4000


def measure(steps: int) -> dict:
    """Runs inside the lane venv with a vLLM tree on PYTHONPATH."""
    spec = importlib.util.spec_from_file_location(
        "two_phase_tests", REPO / "tests/v1/core/test_two_phase_allocation.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    block = helpers.BLOCK_SIZE
    manager = helpers.make_manager(helpers.make_hybrid_config(3, num_blocks=1 + 3 * 400))
    for prefix in range(8):  # warm the prefix cache
        owner = helpers.make_request(f"warm{prefix}", helpers.tokens(prefix, 4 * block + 1))
        helpers.compute(manager, owner, owner.num_tokens)
        manager.free(owner)
    live: list = []
    timings = []
    for step in range(steps):
        prompt = helpers.tokens(step % 8, 4 * block) + helpers.tokens(100 + step, 3 * block + 5)
        request = helpers.make_request(f"r{step}", prompt)
        hit_blocks, num_local = manager.get_computed_blocks(request)[:2]
        num_external = 2 * block
        started = time.perf_counter_ns()
        allocated = manager.allocate_slots(
            request, request.num_tokens - num_local - num_external, num_local, hit_blocks,
            num_external_computed_tokens=num_external)
        timings.append(time.perf_counter_ns() - started)
        assert allocated is not None
        live.append(request)
        if len(live) > 16:
            manager.free(live.pop(0))
    timings.sort()
    return {"median_ns": timings[len(timings) // 2], "mean_ns": statistics.fmean(timings)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="v0.21.0")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: run in a lane venv
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(int(args.measure))))
        return 0

    from _trees import stock_and_patched

    bench = stock_and_patched(args.release)
    results = bench.alternate(__file__, str(STEPS), args.rounds)
    stock = statistics.median(results["stock"])
    patched = statistics.median(results["patched"])
    print(f"vLLM v{bench.release}, 3 groups (full + 2 sliding window), 4-block hits + 2 external "
          f"blocks, {STEPS} steps x {args.rounds} rounds")
    print(f"allocate_slots median: stock {stock / 1000:.1f} us, patched {patched / 1000:.1f} us")
    print(f"patched/stock = {patched / stock:.3f} (goal <= 1.03)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
