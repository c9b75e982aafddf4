"""F2: requests a NIXL producer still holds after a best_of burst, stock vs patched.

A simulated prefill producer (the real worker, fake NIXL agent and clock) gets
100 prompts with best_of = 8: 800 sibling requests ``f"{i}_{parent}"`` are
scheduled and finished. The decoder reads the shared prompt KV of each parent
through the one sibling the response names, once per child, as a real decode
engine does: 8 READs per prompt, whose notifications arrive here one child per
step. Counted: requests released while READs of their parent's prompt were
still outstanding (the corruption hazard), requests (each holding its KV
blocks) still held right after the burst, and after the expiry (480 s timeout
up to v0.21, lease from v0.22).

Usage: python benchmarks/bench_f2_best_of_release.py --stock TREE --patched TREE
       python benchmarks/bench_f2_best_of_release.py --release v0.21.0
Goal: patched releases nothing under outstanding READs and holds 0 after the
burst; stock releases 100 under READs and holds 700 until expiry.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _nixl_producer

PROMPTS = 100
BEST_OF = 8


def measure(payload: dict) -> dict:
    """Runs in a child process with one vLLM tree on sys.path."""
    producer = _nixl_producer.producer()
    # The expiry the scheduler stamps: VLLM_NIXL_ABORT_REQUEST_TIMEOUT up to
    # v0.21, the lease (kv_lease_duration, 30 s) from v0.22.
    ttl = 30.0 if producer.has_heartbeats else 480.0
    parents = [f"cmpl-{k:08x}" for k in range(payload["prompts"])]
    siblings = [f"{i}_{p}" for p in parents for i in range(payload["best_of"])]
    producer.step(in_batch=siblings, ttl=ttl)
    producer.step(to_send=siblings, ttl=ttl)
    read = [f"{payload['best_of'] - 1}_{parent}" for parent in parents]
    released: set[str] = set()
    released_under_reads = 0
    for child in range(payload["best_of"]):
        for req_id in read:
            producer.notify(req_id)
        now = producer.finished_sending()
        if child < payload["best_of"] - 1:
            released_under_reads += len(now)
        released |= now
    held_after_burst = len(producer.held())
    producer.advance(ttl + 1)
    released |= producer.finished_sending()
    return {
        "requests": len(siblings),
        "pulled": len(parents),
        "released_under_reads": released_under_reads,
        "released_at_pull": len(siblings) - held_after_burst,
        "held_after_burst": held_after_burst,
        "held_after_expiry": len(producer.held()),
        "released_total": len(released),
        "ttl_s": ttl,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _nixl_producer.add_tree_arguments(parser)
    args = parser.parse_args()
    if args.measure:
        return _nixl_producer.child_main(measure, args.measure)
    python, trees, release = _nixl_producer.trees_from_args(args)
    payload = {"prompts": PROMPTS, "best_of": BEST_OF}
    results = _nixl_producer.run_children(__file__, python, trees, release, payload, 1)
    print(f"vLLM v{release}: {PROMPTS} prompts x best_of={BEST_OF}, each of the decoder's "
          f"{BEST_OF} children reads the sibling the response names")
    print(f"{'tree':8} {'requests':>8} {'read':>6} {'released under READs':>20} "
          f"{'released at pull':>16} {'held after burst':>16} {'held after expiry':>17} "
          f"{'expiry s':>8}")
    for name, (row,) in results.items():
        print(f"{name:8} {row['requests']:>8} {row['pulled']:>6} "
              f"{row['released_under_reads']:>20} {row['released_at_pull']:>16} "
              f"{row['held_after_burst']:>16} {row['held_after_expiry']:>17} "
              f"{row['ttl_s']:>8.0f}")
    stock, patched = results["stock"][0], results["patched"][0]
    print(f"released under outstanding READs: stock {stock['released_under_reads']}, patched "
          f"{patched['released_under_reads']} (goal: 0 patched)")
    print(f"held after burst: stock {stock['held_after_burst']}, patched "
          f"{patched['held_after_burst']} (goal: 0 patched, "
          f"{PROMPTS * (BEST_OF - 1)} stock until expiry)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
