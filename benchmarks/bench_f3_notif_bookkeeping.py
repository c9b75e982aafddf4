"""F3: per-step cost of the NIXL producer's release bookkeeping, patched/stock ratio.

A simulated prefill producer (the real worker, fake NIXL agent) first receives
notifications for 8192 requests that never register, which fills the patched
worker's staging to its limit (stock drops them). Then each step registers a
batch of 256 finished requests (``start_load_kv``) and receives the pull
notifications of the previous batch, which ``get_finished`` /
``get_transfer_results`` releases (``_get_new_notifs`` plus the expiry scan).
Timed: ``start_load_kv`` + the release call, per step. Stock and patched trees
alternate for several rounds in one run.

Usage: python benchmarks/bench_f3_notif_bookkeeping.py --stock TREE --patched TREE
       python benchmarks/bench_f3_notif_bookkeeping.py --release v0.21.0
Goal: patched/stock <= 1.10.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nixl_producer

STAGED = 8192
BATCH = 256
STEPS = 400
WARMUP = 20


def measure(payload: dict) -> dict:
    """Runs in a child process with one vLLM tree on sys.path."""
    producer = _nixl_producer.producer()
    batch, steps = payload["batch"], payload["steps"]
    for k in range(payload["staged"]):
        producer.notify(f"never-registered-{k}")
    producer.finished_sending()
    timings = []
    previous: list[str] = []
    for step in range(steps + WARMUP):
        current = [f"req-{step}-{i}" for i in range(batch)]
        for req_id in previous:
            producer.notify(req_id)
        # The worker gets the scheduler's metadata deserialized: its request ids
        # are string objects of its own, freed when the worker's bookkeeping
        # drops them (this loop's lists must not keep them alive).
        in_batch = [f"req-{step}-{i}" for i in range(batch)]
        to_send = [f"req-{step}-{i}" for i in range(batch)]
        started = time.perf_counter_ns()
        producer.step(in_batch=in_batch, to_send=to_send)
        producer.finished_sending()
        elapsed = time.perf_counter_ns() - started
        del in_batch, to_send
        if step >= WARMUP:
            timings.append(elapsed)
        previous = current
    assert not producer.held() - set(previous), "requests left behind"
    return {"median_ns": statistics.median(timings)}


def main() -> int:
    # The goal's case, then staging empty (the usual one).
    cases = {staged: {"staged": staged, "batch": BATCH, "steps": STEPS}
             for staged in (STAGED, 0)}
    return _nixl_producer.compare(__file__, __doc__, measure, f"batch {BATCH}, {STEPS} steps",
                                  "start_load_kv + release", "staged", cases,
                                  goal="goal: patched/stock <= 1.10 with 8192 staged")


if __name__ == "__main__":
    sys.exit(main())
