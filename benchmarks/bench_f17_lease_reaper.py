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

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nixl_producer

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
    cases = {leases: {"leases": leases} for leases in (256, 4096)}
    return _nixl_producer.compare(__file__, __doc__, measure, f"{STEPS} steps",
                                  "the release call, nothing expires", "leases", cases)


if __name__ == "__main__":
    sys.exit(main())
