"""F17: per-step cost of the NIXL producer's lease expiry with many leases held.

A simulated prefill producer (the real worker, fake NIXL agent and clock) holds
``leases`` requests whose leases are live, the first renewed by a heartbeat each
step (the case F17 is for: a renewed lease ahead of the others). Timed: one
``get_finished`` / ``get_transfer_results`` per step, in which nothing expires
(the usual step: upstream's loop stops at the first lease; F17 adds a ``min``
over all of them). Stock and patched trees alternate for several rounds.

Usage: python benchmarks/bench_f17_lease_reaper.py --stock TREE --patched TREE
       python benchmarks/bench_f17_lease_reaper.py --release v0.30.0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nixl_producer  # noqa: E402

STEPS = 400
WARMUP = 20


def measure(payload: dict) -> dict:
    """Runs in a child process with one vLLM tree on sys.path."""
    producer = _nixl_producer.producer()
    held = [f"req-{i}" for i in range(payload["leases"])]
    producer.register(*held)
    timings = []
    for step in range(STEPS + WARMUP):
        producer.heartbeat(held[0])
        started = time.perf_counter_ns()
        producer.finished_sending()
        elapsed = time.perf_counter_ns() - started
        if step >= WARMUP:
            timings.append(elapsed)
    assert producer.held() == set(held), "a live lease was released"
    return {"median_ns": statistics.median(timings)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _nixl_producer.add_tree_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.measure:
        return _nixl_producer.child_main(measure, args.measure)
    python, trees, release = _nixl_producer.trees_from_args(args)
    print(f"vLLM v{release}: {STEPS} steps x {args.rounds} rounds; "
          "median us per step (the release call, nothing expires)")
    print(f"{'leases':>6} {'stock':>8} {'patched':>8} {'patched/stock':>13}")
    for leases in (256, 4096):
        results = _nixl_producer.run_children(__file__, python, trees, release,
                                              {"leases": leases}, args.rounds)
        medians = {name: statistics.median(r["median_ns"] for r in rows)
                   for name, rows in results.items()}
        ratio = medians["patched"] / medians["stock"]
        print(f"{leases:>6} {medians['stock'] / 1000:>8.1f} {medians['patched'] / 1000:>8.1f} "
              f"{ratio:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
