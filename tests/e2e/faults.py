"""The P/D fault matrix: one NIXL pair driven through what operators meet besides the
happy path (the leases of vllm PR 41383, the sibling release
of PR 43509).

One pair per mode and connector (``scenarios.nixl_faults`` runs ``run``): the producer
and a loaded decoder (``DECODER_SEQS`` sequences: it admits a prompt's children in
waves). The cases share the engines where they can; the kill cases restart the engine
they kill. Every client call is bounded (``CLIENT_LIMIT_S``): one without an answer by
then counts as hung. Nothing here checks the fixes (``test_pd_faults.py`` does); it
records, per case, the prompts it sent, what each client call saw, and the producer's
KV usage when the case is over.

Cases, in the order they run:
- ``waves``: two prompts of other sizes than the pair's burst (``WAVES``), decoded in
  the other order than prefilled; the decoder runs ``DECODER_SEQS`` children at a time
  and each decodes long enough that the last wave starts past the lease;
- ``abort_decoding``: a client streams a prompt's decode leg (n=8) and disconnects after
  its first tokens;
- ``abort_waiting``: a client disconnects from a decode leg (n=8) whose children are all
  still waiting behind a busy decoder, before any READ;
- ``no_decode``: a prefill leg whose client never sends the decode leg (gone between the
  legs): only the lease can free it;
- ``stalled_decoder``: the decoder's engine core does not step for longer than the lease
  when a decode leg (n=3) arrives (the probe's stall), so nothing renews the lease; the
  producer keeps stepping and releases the prompt; then the decoder schedules it;
- ``decoder_killed``: the decoder is SIGKILLed while a prompt's children decode, then
  restarted; the producer must free everything by lease and the new decoder serve;
- ``producer_killed``: the producer is SIGKILLed after a prefill, before the decoder
  reads; the decode leg must end with an answer (an error, or the prompt recomputed)
  within the bound, and the pair serve again once a new producer is up.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from e2e_probe import STALL_KEY
from scenarios import (
    DECODER_PHASES,
    Server,
    decoder_notifications_sent,
    delta,
    drain,
    metric,
    nixl_server,
    poke,
    prefill,
    producer_notifications_read,
    sample,
)

# A short lease, so that waves outlast it within a CI budget: heartbeats every 2 s
# (upstream: lease // 6), each renewing 8 s (lease * 2 // 3).
LEASE_S = 12
# Two children at a time: a prompt with n children takes n / 2 waves.
DECODER_SEQS = 2
# A client call with no answer after this long is hung (the engines answer any call here
# in well under a minute when nothing is wrong).
CLIENT_LIMIT_S = 150
# waves: (n, full blocks, tail tokens, decode tokens) per prompt; decoded last first.
WAVES = [(6, 4, 8, 128), (3, 2, 20, 64)]
ABORT_N = 8
KILLED_N = 4
# stalled_decoder: a prompt with n = 3 whose decoder stops stepping past the lease.
STALLED_N = 3
STALL_S = LEASE_S + 2


class Pair:
    """The producer and the decoder of a run, restartable under new names."""

    def __init__(self, run_dir: Path, connector: str,
                 waves: list[tuple[int, int, int, int]] | None = None) -> None:
        self.run_dir, self.connector = run_dir, connector
        # The waves case's prompts (``WAVES`` unless the run names others).
        self.waves = waves or WAVES
        self.starts = {"producer": 0, "decoder": 0}
        self.producer = self._start("producer")
        self.decoder = self._start("decoder")
        self.ready = {"producer_s": round(self.producer.wait_ready(), 1),
                      "decoder_s": round(self.decoder.wait_ready(), 1)}

    def _start(self, role: str) -> Server:
        self.starts[role] += 1
        name = role if self.starts[role] == 1 else f"{role}-{self.starts[role]}"
        if role == "producer":
            return nixl_server(name, self.run_dir, 8100, 5600, core=0,
                               connector=self.connector, lease=LEASE_S)
        return nixl_server(name, self.run_dir, 8200, 5601, core=1, connector=self.connector,
                           lease=LEASE_S, max_num_seqs=DECODER_SEQS)

    def restart(self, role: str) -> float:
        """Start ``role`` again (after it was killed); seconds until it was ready."""
        server = self._start(role)
        setattr(self, role, server)
        return round(server.wait_ready(), 1)

    def servers(self) -> list[Server]:
        return [self.producer, self.decoder]

    def probe(self, role: str) -> Path:
        server = getattr(self, role)
        return self.run_dir / f"{server.name}.probe.jsonl"


def call(server: Server, payload: dict[str, Any], stream_chunks: int | None = None,
         disconnect_after_s: float | None = None, headers: dict[str, str] | None = None,
         limit_s: float = CLIENT_LIMIT_S,
         give_up: threading.Event | None = None) -> dict[str, Any]:
    """One client call to ``/v1/completions``, never raising: its HTTP status, choices
    (or error text), and seconds. ``stream_chunks``: stream the answer and disconnect
    after that many chunks that carry text; ``disconnect_after_s``: stream and disconnect
    after that long, whatever arrived. Hung when no answer came within ``limit_s``
    (``CLIENT_LIMIT_S``), or before ``give_up`` was set (a bound the scenario sets
    later: the client leaves then). ``headers``: more request headers (push mode's
    ``X-Request-Id``)."""
    temperature = 1.0 if payload.get("n", 1) > 1 else 0.0
    # Every scenario times its requests by their lengths (a busy request holds the
    # decoder's seats past a lease): no sample may stop early at EOS. A CI run of the push
    # pair had a busy request of n=8, 320 tokens each, answered in under 3 s.
    body = {"model": server.model, "temperature": temperature, "ignore_eos": True, **payload}
    streaming = stream_chunks is not None or disconnect_after_s is not None
    if streaming:
        body["stream"] = True
    started = time.monotonic()
    outcome: dict[str, Any] = {"status": None, "hung": False, "disconnected": False}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=limit_s)
    if give_up is not None:
        threading.Thread(target=_leave_on, args=(give_up, connection, limit_s),
                         daemon=True).start()
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Content-Type": "application/json", **(headers or {})})
        if disconnect_after_s is not None:
            connection.sock.settimeout(disconnect_after_s)
        response = connection.getresponse()
        outcome["status"] = response.status
        if not streaming:
            data = json.loads(response.read() or b"{}")
            outcome["choices"] = len(data.get("choices", ()))
            outcome["completion_tokens"] = data.get("usage", {}).get("completion_tokens")
            outcome["kv_transfer_params"] = data.get("kv_transfer_params")
            if response.status >= 400:
                outcome["error"] = str(data)[:300]
        else:
            chunks = 0
            while stream_chunks is None or chunks < stream_chunks:
                line = response.fp.readline()
                if not line or line.strip() == b"data: [DONE]":
                    break
                if line.startswith(b"data: ") and b'"text"' in line:
                    chunks += 1
            outcome["chunks"] = chunks
            outcome["disconnected"] = True
    except TimeoutError:
        # A client that leaves after ``disconnect_after_s`` is not kept waiting: it left.
        outcome["disconnected" if disconnect_after_s is not None else "hung"] = True
    except (ConnectionError, http.client.HTTPException, OSError) as error:
        if give_up is not None and give_up.is_set() and outcome["status"] is None:
            outcome["hung"] = True
        else:
            outcome["error"] = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    outcome["s"] = round(time.monotonic() - started, 1)
    return outcome


def _leave_on(give_up: threading.Event, connection: http.client.HTTPConnection,
              limit_s: float) -> None:
    """Close the call's socket when ``give_up`` is set within ``limit_s``: the blocked
    read ends (``call`` counts the call as hung if no answer had come)."""
    if give_up.wait(limit_s) and connection.sock is not None:
        with contextlib.suppress(OSError):
            connection.sock.shutdown(socket.SHUT_RDWR)


def decode_payload(flow: dict[str, Any], tokens: int) -> dict[str, Any]:
    return {"prompt": flow["prompt"], "n": flow["n"], "max_tokens": tokens,
            "kv_transfer_params": flow["params"]}


def tokens_of(full_blocks: int, tail: int, seed: int) -> list[int]:
    from harness import block_size

    return [seed + t for t in range(full_blocks * block_size() + tail)]


def flow_record(flow: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in flow.items() if k not in ("prompt", "params")}


def idle(server: Server) -> bool:
    samples = server.metrics()
    return metric(samples, "vllm:num_requests_running") + \
        metric(samples, "vllm:num_requests_waiting") == 0


def settle(pair: Pair, limit_s: float = 60.0) -> bool:
    """Wait until the decoder has no request left (aborts and kills take a step or two to
    reach its scheduler); whether it got there within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if idle(pair.decoder):
            return True
        time.sleep(0.5)
    return False


def past_lease(pair: Pair, since: float) -> dict[str, Any]:
    """Wait until a lease after ``since`` has passed, make the producer step (it releases
    expired requests only in a step), and read its KV usage."""
    time.sleep(max(0.0, since + LEASE_S + 1 - time.monotonic()))
    poke(pair.producer)
    poke(pair.producer)
    return {"t": time.monotonic(),
            "usage": metric(pair.producer.metrics(), "vllm:kv_cache_usage_perc")}


# ---------------------------------------------------------------------------- the cases


def waves(pair: Pair, seed: int) -> dict[str, Any]:
    spec = pair.waves
    prompts = [tokens_of(blocks, tail, seed + 1000 * i)
               for i, (_, blocks, tail, _) in enumerate(spec)]
    with ThreadPoolExecutor(len(spec)) as pool:
        flows = list(pool.map(lambda i: prefill(pair.producer, prompts[i], spec[i][0]),
                              range(len(spec))))
        before = sample(pair.decoder, DECODER_PHASES)
        # The last prompt's decode leg first: its children take the first waves.
        futures = []
        for i in reversed(range(len(spec))):
            futures.append((i, pool.submit(call, pair.decoder,
                                           decode_payload(flows[i], spec[i][3]))))
            time.sleep(0.5)
        calls = {i: future.result() for i, future in futures}
    return {"flows": [flow_record(f) for f in flows], "calls": [calls[i] for i in
                                                                  range(len(spec))],
            "decoder_phases": delta(sample(pair.decoder, DECODER_PHASES), before)}


def abort_decoding(pair: Pair, seed: int) -> dict[str, Any]:
    flow = prefill(pair.producer, tokens_of(3, 5, seed), ABORT_N)
    outcome = call(pair.decoder, decode_payload(flow, 64), stream_chunks=2)
    return {"flows": [flow_record(flow)], "calls": [outcome], "settled": settle(pair)}


def abort_waiting(pair: Pair, seed: int) -> dict[str, Any]:
    """A local request with n = ``DECODER_SEQS`` keeps the decoder's seats taken while the
    decode leg waits behind it; the client leaves after a second."""
    flow = prefill(pair.producer, tokens_of(2, 11, seed), ABORT_N)
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(call, pair.decoder, {"prompt": tokens_of(1, 3, seed + 500),
                                                "n": DECODER_SEQS, "max_tokens": 200})
        time.sleep(1.0)
        outcome = call(pair.decoder, decode_payload(flow, 16), disconnect_after_s=1.0)
        filler = busy.result()
    return {"flows": [flow_record(flow)], "calls": [outcome, filler], "settled": settle(pair)}


def no_decode(pair: Pair, seed: int) -> dict[str, Any]:
    flow = prefill(pair.producer, tokens_of(2, 3, seed), ABORT_N)
    return {"flows": [flow_record(flow)], "calls": []}


def decoder_killed(pair: Pair, seed: int) -> dict[str, Any]:
    flow = prefill(pair.producer, tokens_of(3, 9, seed), KILLED_N)
    probe = pair.probe("decoder")
    sent = decoder_notifications_sent(probe)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(call, pair.decoder, decode_payload(flow, 200))
        # Mid-burst: once the decoder has READ the prompt (or after 10 s).
        deadline = time.monotonic() + 10
        while decoder_notifications_sent(probe) == sent and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        t_killed = time.monotonic()
        pair.decoder.kill()
        killed_call = future.result()
    expiry = past_lease(pair, max(flow["t_prefilled"], t_killed))
    restarted_s = pair.restart("decoder")
    after = prefill(pair.producer, tokens_of(2, 17, seed + 500), KILLED_N)
    served = call(pair.decoder, decode_payload(after, 8))
    return {"flows": [flow_record(flow)], "after_flows": [flow_record(after)],
            "calls": [killed_call], "served_after": served, "restarted_s": restarted_s,
            "t_killed": t_killed, "usage_past_lease": expiry["usage"],
            "read_before_kill": decoder_notifications_sent(probe) > sent}


def producer_killed(pair: Pair, seed: int) -> dict[str, Any]:
    flow = prefill(pair.producer, tokens_of(3, 1, seed), KILLED_N)
    t_killed = time.monotonic()
    pair.producer.kill()
    outcome = call(pair.decoder, decode_payload(flow, 8))
    settled = settle(pair)
    restarted_s = pair.restart("producer")
    after = prefill(pair.producer, tokens_of(2, 13, seed + 500), KILLED_N)
    served = call(pair.decoder, decode_payload(after, 8))
    return {"flows": [flow_record(flow)], "after_flows": [flow_record(after)],
            "calls": [outcome], "settled": settled, "served_after": served,
            "restarted_s": restarted_s, "t_killed": t_killed}


def stalled_decoder(pair: Pair, seed: int) -> dict[str, Any]:
    """The decoder's engine core stops stepping for ``STALL_S`` (longer than the lease)
    when the decode leg arrives, so no heartbeat renews the lease, while the producer
    keeps stepping (it releases expired requests only in a step); then it schedules the
    children as usual."""
    flow = prefill(pair.producer, tokens_of(3, 14, seed), STALLED_N)
    payload = decode_payload(flow, 8)
    payload["kv_transfer_params"] = {**flow["params"], STALL_KEY: STALL_S}
    with ThreadPoolExecutor(2) as pool:
        future = pool.submit(call, pair.decoder, payload)
        deadline = time.monotonic() + STALL_S + 3
        while not future.done() and time.monotonic() < deadline:
            poke(pair.producer)
            time.sleep(0.5)
        outcome = future.result()
    return {"flows": [flow_record(flow)], "calls": [outcome], "stall_s": STALL_S}


CASES = {"waves": waves, "abort_decoding": abort_decoding, "abort_waiting": abort_waiting,
         "no_decode": no_decode, "stalled_decoder": stalled_decoder,
         "decoder_killed": decoder_killed,
         "producer_killed": producer_killed}
# Cases after which the pair is not the one it started with.
RESTARTING = ("decoder_killed", "producer_killed")


def log_lines_of(run_dir: Path, prefix: str, needle: str) -> list[str]:
    """Lines containing ``needle`` in every log of the servers named ``prefix*``."""
    return [line for path in sorted(run_dir.glob(f"{prefix}*.log"))
            for line in path.read_text(errors="replace").splitlines() if needle in line]


def run(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """Every case of ``args["cases"]`` (all by default) in order on one pair of engines
    with ``args["connector"]``; the cases that share the pair end with one lease wait."""
    cases = args.get("cases", list(CASES))
    pair = Pair(run_dir, args["connector"],
                [tuple(prompt) for prompt in args["waves"]] if "waves" in args else None)
    record: dict[str, Any] = {"connector": args["connector"], "lease_s": LEASE_S,
                              "decoder_seqs": DECODER_SEQS, "ready": pair.ready, "cases": {}}
    try:
        warm = prefill(pair.producer, tokens_of(1, 4, 900), 1)
        call(pair.decoder, decode_payload(warm, 2))
        shared = [case for case in cases if case not in RESTARTING]
        last_start = time.monotonic()
        for index, case in enumerate(cases):
            if case in RESTARTING and shared:
                # The shared cases' KV must be gone before the pair changes.
                drain(pair.producer, pair.probe("producer"),
                      decoder_notifications_sent(pair.probe("decoder")))
                record["shared_past_lease"] = past_lease(pair, last_start)
                shared = []
            started = time.monotonic()
            last_start = started
            # Each case's token ids of its own, all within opt-125m's vocabulary (50272
            # ids): a seed past it crashes the engine core (an embedding IndexError).
            record["cases"][case] = {"t_start": started,
                                     **CASES[case](pair, 2_000 + 4_000 * index),
                                     "t_end": time.monotonic()}
        if shared:
            drain(pair.producer, pair.probe("producer"),
                  decoder_notifications_sent(pair.probe("decoder")))
            record["shared_past_lease"] = past_lease(pair, last_start)
        record["final_usage"] = metric(pair.producer.metrics(), "vllm:kv_cache_usage_perc")
        record["decoder_idle"] = settle(pair, 30)
    finally:
        for server in pair.servers():
            server.stop()
    record["producer_notifications_read"] = producer_notifications_read(pair.probe("producer"))
    record["expired_lines"] = log_lines_of(run_dir, "producer", "Releasing expired KV blocks")
    record["invalid_lines"] = log_lines_of(run_dir, "producer", "Potentially invalid KV blocks")
    record["load_failure_lines"] = log_lines_of(run_dir, "decoder", "KV load failure")
    return record
