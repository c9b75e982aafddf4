"""NIXL push mode (``NixlPushConnector``, vLLM v0.24+) in a real pair
(docs/push-mode.md): the CI pair of ``test_nixl_push_pair.py``, stock
and fixed (``scenarios.nixl_push`` runs ``run``).

Push mode turns the transfer around: the decoder registers its freshly allocated blocks
with the producer (a ``PUSH_REG:`` NIXL notification), and the producer WRITEs the
prompt's KV into them once its own request has finished. Its requests go to both engines
at once with one ``X-Request-Id``, as upstream's push proxy example
(``disagg_proxy_pushconnector_demo.py``) sends them: the producer gets ``max_tokens=1``
and ``do_remote_decode``; the decoder gets ``do_remote_prefill`` with the producer's
engine id, side-channel host and port, TP/PP sizes and the shared id, and no block ids.

This module drives one pair through the cases where stock push mode goes wrong
(docs/push-mode.md); it checks nothing (``test_nixl_push_pair.py`` does) and records, per case, the
client calls, the producer's WRITEs (the probe's ``read`` events with ``op`` WRITE;
their notification names the decoder's request), the decoder's registrations and
heartbeats (its ``notif_sent`` events), the producer's NIXL metrics and expiry lines,
and both engines' KV usage. Every client call is bounded (``HANG_LIMIT_S``): a call
without an answer by then counts as hung.

Cases, in the order they run:
- ``warmup``: one prompt with n=1 through the pair (the NIXL handshakes);
- ``writes``: one prompt with n=4, then one with n=8, the same n on both legs, on a
  decoder with seats for all children (they allocate in one step): WRITEs and bytes
  per prompt;
- ``mismatch``: the prefill leg with n=1 and the decode leg with n=4;
- ``late``: a prefill leg with n = ``LATE_N``, then, past the producer's lease, its
  decode leg;
- ``retry``: the client of ``late`` tries again with the same ``X-Request-Id`` once
  its decode leg failed or hung: both legs again (what a gateway that retries
  sends: it keeps the request's id);
- ``busy``: a local request with n = ``DECODER_SEATS`` takes every decoder seat until
  its client leaves, ``BUSY_PAST_LEASE_S`` past prompt B's lease; meanwhile prompt A's
  legs (n=2) come and A's client leaves after ``ABORT_AFTER_S`` (its children aborted
  before they were scheduled), and prompt B's legs (n=2) come and B waits (its decoder
  heartbeats while its children wait for seats);
- ``slow``: one prompt (n=1) whose WRITE the producer's probe reports in flight for
  ``SLOW_WRITE_S``, past the prompt's lease (a slow link, as NIXL would report it).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from e2e_probe import SLOW_WRITE_ENV
from faults import call, tokens_of
from scenarios import (
    DECODER_PHASES,
    Breakdown,
    Server,
    delta,
    log_lines,
    nixl_server,
    poke,
    probe_lines,
    sample,
    settle,
)

# A short lease, so that the lease cases fit in a short run (upstream: 30 s). Heartbeats
# every lease // 6 s.
LEASE_S = 12
# The decoder's watchdog over its registrations (``push_registration_timeout``; upstream
# defaults it to ``decoder_kv_blocks_ttl``, 480 s): short, to see what it does.
REGISTRATION_TIMEOUT_S = 20
PRODUCER_SIDE_PORT = 5600
DECODER_SEATS = 8
# A decode leg with no answer after this long is hung: past the watchdog, with room for
# a slow step (a decoder whose watchdog fails the request answers at about 20 s).
HANG_LIMIT_S = 32
# busy: a bound on the busy request's call and on prompt B's legs, against hangs only.
# Prompt B's client (its children wait for the busy request's seats) leaves
# HANG_LIMIT_S after the busy request ended, if no answer came by then: stock never
# answers B.
WAIT_LIMIT_S = 5 * HANG_LIMIT_S
DECODE_TOKENS = 4
WRITE_NS = (4, 8)
# busy: the busy request's client leaves this long past prompt B's lease (from B's legs),
# which ends the request and frees the seats: the seats are held past B's lease by the
# clock, not by how fast the machine decodes. (Held until the request finished, the case
# took 73 s on a quiet machine and about 200 s in a loaded CI run, and a machine that
# decoded 900 tokens per seat in under 12 s would not have held them past the lease.)
BUSY_PAST_LEASE_S = 6.0
# The busy request's tokens per seat: as many as the decoder's max_model_len admits, so
# that no machine finishes them before its client leaves.
BUSY_TOKENS = 960
# The decoder's max_model_len: the busy request's prompt (35 tokens) and BUSY_TOKENS.
DECODER_MAX_MODEL_LEN = 1024
ABORT_AFTER_S = 2.0
# slow: the producer's WRITE of prompt SLOW_RID is reported in flight this long after it
# is posted (the probe's SLOW_WRITE_ENV; its bytes land at once): past the prompt's lease
# from its prefill, and past the last renewal of the decoder's heartbeats, which stop
# when the decode request finishes (a lease extension, 8 s, after its last heartbeat).
SLOW_RID = "push-slow"
SLOW_WRITE_S = LEASE_S + 8
PRODUCER_METRICS = ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_bytes_transferred_count",
                    "vllm:nixl_num_kv_expired_reqs", "vllm:nixl_num_failed_transfers",
                    "vllm:nixl_num_notifications_after_expiry", "vllm:kv_cache_usage_perc",
                    "vllm:num_requests_running", "vllm:num_requests_waiting")
DECODER_METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                   "vllm:num_requests_waiting")


def push_config(name: str, connector: str, lease: int = LEASE_S) -> dict[str, Any]:
    """The KV transfer config of both engines (a fixed engine id: the decoder names the
    producer's before the producer answers), lease ``lease`` seconds:
    ``NixlPushConnector`` itself, or ``MultiConnector`` with it as its one child (which
    takes the parent's engine id)."""
    push = {"kv_connector": "NixlPushConnector", "kv_role": "kv_both",
            "kv_buffer_device": "cpu", "kv_connector_extra_config": {
                "kv_lease_duration": lease,
                "push_registration_timeout": REGISTRATION_TIMEOUT_S}}
    if connector == "MultiConnector":
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                "engine_id": f"{name}-engine",
                "kv_connector_extra_config": {"connectors": [push]}}
    return {**push, "engine_id": f"{name}-engine"}


class PushPair:
    def __init__(self, run_dir: Path, connector: str) -> None:
        self.run_dir = run_dir
        self.producer = nixl_server("producer", run_dir, 8100, PRODUCER_SIDE_PORT, core=0,
                                    connector=connector, lease=LEASE_S,
                                    kv_transfer=push_config("producer", connector),
                                    probe_env={SLOW_WRITE_ENV: f"{SLOW_RID}={SLOW_WRITE_S}"})
        self.decoder = nixl_server("decoder", run_dir, 8200, PRODUCER_SIDE_PORT + 1, core=1,
                                   connector=connector, lease=LEASE_S,
                                   kv_transfer=push_config("decoder", connector),
                                   max_num_seqs=DECODER_SEATS,
                                   max_model_len=DECODER_MAX_MODEL_LEN)
        self.ready = {"producer_s": round(self.producer.wait_ready(), 1),
                      "decoder_s": round(self.decoder.wait_ready(), 1)}

    def probe(self, server: Server) -> list[dict[str, Any]]:
        return probe_lines(self.run_dir / f"{server.name}.probe.jsonl")


def prefill_payload(prompt: list[int], n: int) -> dict[str, Any]:
    return {"prompt": prompt, "n": n, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}}


def decode_payload(prompt: list[int], n: int, rid: str, tokens: int) -> dict[str, Any]:
    return {"prompt": prompt, "n": n, "max_tokens": tokens, "kv_transfer_params": {
        "do_remote_decode": False, "do_remote_prefill": True,
        "remote_engine_id": "producer-engine", "remote_host": "127.0.0.1",
        "remote_port": PRODUCER_SIDE_PORT, "tp_size": 1, "pp_size": 1,
        "remote_request_id": rid}}


def legs(pair: PushPair, rid: str, prompt: list[int], p_n: int, d_n: int,
         tokens: int = DECODE_TOKENS, decode_params: dict[str, Any] | None = None,
         **decode_kw: Any) -> dict[str, Any]:
    """Both legs of one prompt at once, as the push proxy sends them; ``decode_params``:
    more ``kv_transfer_params`` of the decode leg (the probe's stall key)."""
    headers = {"X-Request-Id": rid}
    started = time.monotonic()
    payload = decode_payload(prompt, d_n, rid, tokens)
    payload["kv_transfer_params"].update(decode_params or {})
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(call, pair.producer, prefill_payload(prompt, p_n), headers=headers,
                        limit_s=HANG_LIMIT_S)
        d = pool.submit(call, pair.decoder, payload,
                        headers=headers, **{"limit_s": HANG_LIMIT_S, **decode_kw})
        prefill_call, decode_call = p.result(), d.result()
    return {"rid": rid, "p_n": p_n, "d_n": d_n, "prompt_tokens": len(prompt),
            "t_start": started, "prefill": prefill_call, "decode": decode_call}


def traffic(pair: PushPair, rid: str) -> dict[str, Any]:
    """What the engines' probes and logs show of request ``rid`` (the X-Request-Id):
    the producer's WRITEs (descriptors, the decoder request each names), the decoder's
    registrations, the producer's expiry lines and the decoder's watchdog lines."""
    writes = [{"t": e["t"], "descs": e["descs"], "to": e["notif"]}
              for e in pair.probe(pair.producer)
              if e["event"] == "read" and "WRITE" in e["op"] and rid in e["notif"]]
    registrations = [e["t"] for e in pair.probe(pair.decoder)
                     if e["event"] == "notif_sent" and e["notif"].startswith("PUSH_REG:")
                     and rid in e["notif"]]
    return {
        "writes": writes,
        "write_targets": sorted({w["to"] for w in writes}),
        "registrations_sent": registrations,
        "expired_lines": [line for line in log_lines(pair.producer, 0,
                                                      "Releasing expired KV blocks")
                          if rid in line],
        "watchdog_lines": [line for line in log_lines(pair.decoder, 0, "timed out after")
                           if rid in line],
    }


def heartbeats(pair: PushPair, since: float) -> list[dict[str, Any]]:
    return [{"t": e["t"], "names": e["notif"][3:].split(",")}
            for e in pair.probe(pair.decoder)
            if e["event"] == "notif_sent" and e["notif"].startswith("HB:") and e["t"] >= since]


# ---------------------------------------------------------------------------- the cases


def writes_case(pair: PushPair) -> dict[str, Any]:
    out = []
    for i, n in enumerate(WRITE_NS):
        before = sample(pair.producer, PRODUCER_METRICS)
        phases = sample(pair.decoder, DECODER_PHASES)
        flow = legs(pair, f"push-writes-n{n}", tokens_of(3, 5, 1000 * (i + 1)), n, n)
        phases = delta(sample(pair.decoder, DECODER_PHASES), phases)
        time.sleep(2.0)
        after = sample(pair.producer, PRODUCER_METRICS)
        out.append({**flow, "producer_delta": delta(after, before), "decoder_phases": phases,
                    **traffic(pair, flow["rid"])})
    return {"prompts": out}


def mismatch_case(pair: PushPair) -> dict[str, Any]:
    flow = legs(pair, "push-mismatch", tokens_of(2, 9, 5000), 1, 4)
    time.sleep(2.0)
    return {**flow, "decoder_after": sample(pair.decoder, DECODER_METRICS),
            **traffic(pair, flow["rid"])}


LATE_RID = "push-late"
# n of both legs of ``late`` and ``retry``. With n > 1, the fixed decoder's other
# children compute the late prompt once its one registration failed (F12), so the
# retry finds it in the decoder's prefix cache and registers nothing (the
# clean-clone run of 4f33b04): no WRITE would show where the producer writes a retry.
LATE_N = 1


def late_prompt() -> list[int]:
    return tokens_of(2, 7, 6000)


def late_case(pair: PushPair) -> dict[str, Any]:
    rid, prompt = LATE_RID, late_prompt()
    started = time.monotonic()
    prefill_call = call(pair.producer, prefill_payload(prompt, LATE_N),
                        headers={"X-Request-Id": rid}, limit_s=HANG_LIMIT_S)
    time.sleep(LEASE_S + 2)
    poke(pair.producer)
    poke(pair.producer)
    usage_before_decode = sample(pair.producer, PRODUCER_METRICS)
    decode_call = call(pair.decoder, decode_payload(prompt, LATE_N, rid, DECODE_TOKENS),
                       headers={"X-Request-Id": rid}, limit_s=HANG_LIMIT_S)
    time.sleep(2.0)
    return {"rid": rid, "p_n": LATE_N, "d_n": LATE_N, "t_start": started,
            "prefill": prefill_call,
            "producer_before_decode": usage_before_decode, "decode": decode_call,
            "decoder_after": sample(pair.decoder, DECODER_METRICS), **traffic(pair, rid)}


def retry_case(pair: PushPair) -> dict[str, Any]:
    """Both legs of prompt ``late`` again, with its X-Request-Id: the producer's WRITEs
    from then on (the decoder requests they name), and the producer's lines that drop
    a parked registration."""
    flow = legs(pair, LATE_RID, late_prompt(), LATE_N, LATE_N)
    time.sleep(2.0)
    writes = [w for w in traffic(pair, LATE_RID)["writes"] if w["t"] >= flow["t_start"]]
    return {**flow, "writes": writes, "write_targets": sorted({w["to"] for w in writes}),
            "dropped_lines": log_lines(pair.producer, 0, "Dropping the KV registration"),
            "decoder_after": sample(pair.decoder, DECODER_METRICS)}


def busy_case(pair: PushPair) -> dict[str, Any]:
    """The busy request, prompt A (its client leaves) and prompt B (it waits), each on
    its own thread: B's legs go ``ABORT_AFTER_S`` and a half after A's, whatever A's
    calls wait for. (A CI run of f2e8f82 through MultiConnector sent B's legs only once
    A's calls and the producer's poke were done, 35 s later, when the busy request had
    already freed the seats.) Raises ``Breakdown`` when the busy request freed the
    decoder's seats within B's lease from B's prefill, or within ``ABORT_AFTER_S`` from
    A's legs: the machine did not set the case up, and no check could read it."""
    started = time.monotonic()
    busy_leaves = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        busy = pool.submit(call, pair.decoder, {"prompt": tokens_of(1, 3, 7000),
                                                "n": DECODER_SEATS,
                                                "max_tokens": BUSY_TOKENS},
                           limit_s=WAIT_LIMIT_S, give_up=busy_leaves)
        time.sleep(1.0)
        before_a = sample(pair.producer, PRODUCER_METRICS)
        aborted = pool.submit(legs, pair, "push-abort", tokens_of(2, 3, 8000), 2, 2,
                              disconnect_after_s=ABORT_AFTER_S)
        time.sleep(ABORT_AFTER_S + 0.5)
        give_up = threading.Event()
        busy_leave = threading.Timer(LEASE_S + BUSY_PAST_LEASE_S, busy_leaves.set)
        busy_leave.daemon = True
        busy_leave.start()
        waited = pool.submit(legs, pair, "push-wait", tokens_of(2, 5, 9000), 2, 2,
                             limit_s=WAIT_LIMIT_S, give_up=give_up)
        aborted_flow = aborted.result()
        poke(pair.producer)
        after_a = sample(pair.producer, PRODUCER_METRICS)
        t_after_a = time.monotonic()
        busy_call = busy.result()
        t_busy_done = time.monotonic()
        leave = threading.Timer(HANG_LIMIT_S, give_up.set)
        leave.daemon = True
        leave.start()
        waited_flow = waited.result()
        leave.cancel()
    time.sleep(2.0)
    check_seats_held(waited_flow, aborted_flow, t_busy_done)
    return {"t_start": started, "busy": busy_call, "t_busy_done": t_busy_done,
            "producer_before_abort": before_a, "producer_after_abort": after_a,
            "t_after_abort": t_after_a,
            "aborted": {**aborted_flow, **traffic(pair, "push-abort")},
            "waited": {**waited_flow, **traffic(pair, "push-wait")},
            "heartbeats": heartbeats(pair, started),
            "decoder_after": sample(pair.decoder, DECODER_METRICS)}


def leased_at(flow: dict[str, Any]) -> float:
    """When the producer's lease of a prompt started at the latest: its prefill's end."""
    return flow["t_start"] + flow["prefill"]["s"]


def check_seats_held(waited: dict[str, Any], aborted: dict[str, Any],
                     t_busy_done: float) -> None:
    """Case busy's premise (``busy_case``): raises ``Breakdown`` when it was not met."""
    held_b, held_a = t_busy_done - leased_at(waited), t_busy_done - aborted["t_start"]
    if held_b <= LEASE_S or held_a <= ABORT_AFTER_S:
        raise Breakdown(f"case busy: the busy request freed the decoder's seats "
                        f"{held_b:.1f} s after B's prefill (lease {LEASE_S} s) and "
                        f"{held_a:.1f} s after A's legs (A leaves at {ABORT_AFTER_S} s)")


def slow_writes(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe's events of the slowed WRITE of SLOW_RID: its post and its end."""
    return [e for e in events
            if e["event"] in ("write_slow", "write_slow_end") and SLOW_RID in e["notif"]]


def slow_case(pair: PushPair) -> dict[str, Any]:
    """Prompt SLOW_RID (n=1) whose WRITE is reported in flight for SLOW_WRITE_S: the
    producer's releases of it (``free``), its expiry lines, and KV usage while the WRITE
    is in flight and after it."""
    flow = legs(pair, SLOW_RID, tokens_of(2, 6, 10000), 1, 1)
    posted = next((e for e in slow_writes(pair.probe(pair.producer))
                   if e["event"] == "write_slow"), None)
    # Past the lease (from the prefill), with the WRITE in flight: stock releases here.
    time.sleep(max(0.0, flow["t_start"] + LEASE_S + 3 - time.monotonic()))
    poke(pair.producer)
    poke(pair.producer)
    during = sample(pair.producer, PRODUCER_METRICS)
    if posted is not None:
        time.sleep(max(0.0, posted["until"] + 1 - time.monotonic()))
    poke(pair.producer)
    poke(pair.producer)
    time.sleep(1.0)
    events = pair.probe(pair.producer)
    return {**flow, **traffic(pair, SLOW_RID), "producer_during": during,
            "producer_after": sample(pair.producer, PRODUCER_METRICS),
            "slow_writes": slow_writes(events),
            "frees": [{"t": e["t"], "req": e["req"], "freed": len(e["freed"])}
                      for e in events if e["event"] == "free" and SLOW_RID in e["req"]]}


CASES = {"writes": writes_case, "mismatch": mismatch_case, "late": late_case,
         "retry": retry_case, "busy": busy_case, "slow": slow_case}


def run(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """Every case of ``args["cases"]`` (all by default) in order on one pair of
    ``args["connector"]`` (``NixlPushConnector`` by default, or ``MultiConnector``)."""
    pair = PushPair(run_dir, args.get("connector", "NixlPushConnector"))
    record: dict[str, Any] = {"lease_s": LEASE_S, "registration_timeout_s":
                              REGISTRATION_TIMEOUT_S, "hang_limit_s": HANG_LIMIT_S,
                              "decoder_seats": DECODER_SEATS, "busy_tokens": BUSY_TOKENS,
                              "abort_after_s": ABORT_AFTER_S,
                              "ready": pair.ready, "cases": {}}
    try:
        record["warmup"] = {**legs(pair, "push-warmup", tokens_of(1, 4, 900), 1, 1, 2,
                                 limit_s=150),
                            **traffic(pair, "push-warmup")}
        for case in args.get("cases", list(CASES)):
            decoder_before = sample(pair.decoder, DECODER_METRICS)
            record["cases"][case] = {"decoder_before": decoder_before, **CASES[case](pair),
                                     "t_end": time.monotonic()}
        settle(pair.producer, [pair.producer, pair.decoder], LEASE_S + 1)
        record["final_producer"] = sample(pair.producer, PRODUCER_METRICS)
        record["final_decoder"] = sample(pair.decoder, DECODER_METRICS)
    finally:
        for server in (pair.producer, pair.decoder):
            server.stop()
    for name, server in (("producer", pair.producer), ("decoder", pair.decoder)):
        record[f"{name}_lines"] = {
            needle: log_lines(server, 0, needle)
            for needle in ("KV Transfer metrics", "Releasing expired KV blocks",
                           "timed out after", "Unrecognized request", "KV load failure",
                           "nixl-push-writer error", "No local blocks", "Traceback")}
    return record
