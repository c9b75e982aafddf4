"""Seeded scenarios: one real NIXL prefill/decode pair per seed, its shape drawn by ``draw``,
checked by ``violations`` (``test_generated_pairs.py``, ``tools/scenario_search.py``).

The other e2e scenarios each pick the n, lengths, lease, order and timing that make their
case happen; a fix holds only if it holds for shapes nobody picked. ``draw(seed)`` picks
them (a pure function of the seed); ``run`` drives the pair through them (the scenario
``generated`` of ``scenarios.py``) and records what the invariants need; ``violations``
says which invariants a fixed run broke (they hold for what every fix promises, so stock
breaks some of them).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from analysis import parent_of, prompt_kv_problems
from e2e_probe import STALL_KEY, prompt_digest
from faults import call, decode_payload, flow_record, tokens_of
from harness import block_size, probe_events, release
from packaging.version import Version
from push import DECODER_METRICS, PRODUCER_SIDE_PORT, legs, push_config
from scenarios import (
    Breakdown,
    decoder_tp_args,
    fixes_without,
    log_lines,
    nixl_server,
    poke,
    prefill,
    sample,
    settle,
)

DECODER_SEQS = (2, 4, 8)
LEASES = (12, 20, 30)
FAULTS = ("none", "abort", "stall")
ROLES = ("decoder", "producer")
# What an engine not yet upgraded runs: stock, or every fix but F5 (and those built on
# it), as an engine of an earlier series would.
BEHIND = ("none", "but F5")
# A client call with no answer after this long is hung (a drawn run's longest call, n = 8
# children in waves of 2 with 96 tokens each, takes well under a minute here).
CLIENT_LIMIT_S = 150
# The producer steps at least this often while traffic runs, as a serving producer does
# (it reads notifications and releases expired prompts only in a step).
PRODUCER_STEP_S = 0.5
# A decode leg that reached the decoder later than this before its prompt's lease ran
# out was late by the client's doing (the decoder's first heartbeat for it comes with a
# step, up to a heartbeat interval, lease / 6, later): its prompt may expire.
LATE_MARGIN_S = 2.0
# The busy request's tokens per seat: what the decoder's max_model_len (512) leaves
# after its 8-token prompt.
BUSY_TOKENS = 500
EXPIRED = "Releasing expired KV blocks"
INVALID = "Potentially invalid KV blocks"
# The first release with push mode (NixlPushConnector): an older one runs a push draw's
# prompts through a pull pair.
PUSH_SINCE = Version("0.24.0")
# The first release whose decoder renews the producer's lease (heartbeats). Before it
# the producer frees a prompt by a fixed timeout, whatever its children wait for: a
# decoder with F7 computes such a prompt itself rather than READ it (F6 and F8 start
# here).
HEARTBEATS_SINCE = Version("0.22.0")


def draw(seed: int, on: str | None = None) -> dict[str, Any]:
    """The pair and traffic of ``seed`` on vLLM release ``on`` (None: one with every
    mode); the same seed and release draw the same dict."""
    rng = random.Random(seed)
    mode = rng.choice(["pull", "push"])
    prompts = []
    for _ in range(rng.randint(1, 3)):
        blocks = rng.randint(1, 6)
        # A partial last block: the last of ``blocks`` holds 1..15 tokens (under every
        # release's block size).
        tail = rng.randint(1, 15) if rng.random() < 0.5 else 0
        prompts.append({"n": rng.randint(1, 8), "full_blocks": blocks - (tail > 0),
                        "tail": tail, "tokens": rng.randint(4, 96)})
    concurrent = rng.random() < 0.5
    params = {
        "seed": seed, "mode": mode,
        "connector": rng.choice(["plain", "MultiConnector"]),
        "prompts": prompts,
        "decoder_seqs": rng.choice(DECODER_SEQS),
        "lease": rng.choice(LEASES),
        "arrival": "concurrent" if concurrent else "sequential",
        "offsets": [round(rng.uniform(0, 3), 1) for _ in prompts] if concurrent else None,
        "order": rng.choice(["prefill", "reversed"]),
        # Push mode's decoder names the producer's TP size 1 in its registrations; the
        # heterogeneous-TP pair is a pull pair (test_hetero_tp_pair.py).
        "decoder_tp": rng.choice([1, 2]) if mode == "pull" else 1,
    }
    fault = rng.choice(FAULTS)
    params["fault"] = {"kind": fault}
    if fault != "none":
        params["fault"]["prompt"] = rng.randrange(len(prompts))
    if fault == "abort":
        params["fault"]["after_s"] = round(rng.uniform(0.3, 4.0), 1)
    if fault == "stall":
        params["fault"]["stall_s"] = params["lease"] + 2
    # A third of the draws with no other fault kill an engine (SIGKILL, as a crash or an
    # OOM kill) that long after the prompt's decode leg started. Drawn last, so that the
    # seeds drawn before kills were added keep every other dimension.
    if fault == "none" and rng.random() < 1 / 3:
        params["fault"] = {"kind": "kill", "prompt": rng.randrange(len(prompts)),
                           "role": rng.choice(ROLES),
                           "after_s": round(rng.uniform(0.3, 4.0), 1)}
    # A third of the draws start with every decoder seat busy until past the lease (a
    # local request whose client leaves then): the drawn children wait for seats while
    # their prompts' leases run, whatever the machine's speed. Drawn last, as the kill.
    params["busy_s"] = (params["lease"] + round(rng.uniform(2, 8), 1)
                        if rng.random() < 1 / 3 else None)
    # A quarter of the draws run an upgrade in progress (operators upgrade prefill and
    # decode fleets one at a time): one engine on every fix, the other behind. Drawn last.
    params["fix_sets"] = {"producer": "all", "decoder": "all"}
    if rng.random() < 1 / 4:
        params["fix_sets"][rng.choice(ROLES)] = rng.choice(BEHIND)
    # After every draw, so that the seed keeps its other dimensions on every release.
    if on is not None and Version(on) < PUSH_SINCE:
        params["mode"] = "pull"
    return params


def connector_name(params: dict[str, Any]) -> str:
    if params["connector"] == "MultiConnector":
        return "MultiConnector"
    return "NixlConnector" if params["mode"] == "pull" else "NixlPushConnector"


def fix_sets(params: dict[str, Any]) -> dict[str, str]:
    """Each engine's fixes in this run: "all" (every fix the release needs), "none", or
    fix ids; the drawn ones in a fixed run, none in a stock run (the harness's mode)."""
    if os.environ.get("VLLM_PATCHES_DISABLE") != "0":
        return {role: "none" for role in ROLES}
    return {role: fixes_without("F5") if fix_set == "but F5" else fix_set
            for role, fix_set in params["fix_sets"].items()}


def fixes_run(fix_set: str, on: str) -> set[str]:
    """The ids of the fixes an engine on ``fix_set`` (``fix_sets``) runs on release ``on``."""
    from vllm_patches._catalog import series as _series

    if fix_set == "all":
        return {fix.id for fix in _series.load().applicable(Version(on))}
    return set() if fix_set == "none" else set(fix_set.split(","))


class DrawnPair:
    """The producer (TP 1) and the decoder the draw asks for, KV transfer config of its
    mode, connector and lease, each engine on its fix set (``fix_sets``)."""

    def __init__(self, run_dir: Path, params: dict[str, Any]) -> None:
        connector, lease = connector_name(params), params["lease"]
        self.fix_sets = fix_sets(params)
        fixes = {role: None if fix_set == "all" else fix_set
                 for role, fix_set in self.fix_sets.items()}
        transfer = {role: push_config(role, params["connector"], lease)
                    if params["mode"] == "push" else None for role in ("producer", "decoder")}
        self.producer = nixl_server("producer", run_dir, 8100, PRODUCER_SIDE_PORT, core=0,
                                    connector=connector, lease=lease,
                                    kv_transfer=transfer["producer"],
                                    fixes=fixes["producer"])
        self.decoder = nixl_server("decoder", run_dir, 8200, PRODUCER_SIDE_PORT + 1, core=1,
                                   connector=connector, lease=lease,
                                   kv_transfer=transfer["decoder"],
                                   fixes=fixes["decoder"], max_num_seqs=params["decoder_seqs"],
                                   **decoder_tp_args(params["decoder_tp"]))
        self.ready = {"producer_s": round(self.producer.wait_ready(), 1),
                      "decoder_s": round(self.decoder.wait_ready(), 1)}
        # The drawn kill, once done: the role killed and when.
        self.killed: dict[str, Any] = {}
        self._kill_timer: threading.Timer | None = None

    def alive(self) -> dict[str, Any]:
        """The engines still running, by role."""
        return {role: server for role, server in (("producer", self.producer),
                                                   ("decoder", self.decoder))
                if role != self.killed.get("role")}

    def kill_later(self, params: dict[str, Any], index: int) -> None:
        """Start the drawn kill's timer when prompt ``index`` is the one it names."""
        fault = params["fault"]
        if fault["kind"] != "kill" or fault["prompt"] != index:
            return
        self._kill_timer = threading.Timer(fault["after_s"], self._kill, (fault["role"],))
        self._kill_timer.daemon = True
        self._kill_timer.start()

    def wait_for_kill(self) -> None:
        """Return once the drawn kill is done. A decode leg may end before its kill's
        time (a fast machine, a short leg): the kill still comes, and what follows the
        traffic (settling, the engines' last samples) must see the engines it left."""
        if self._kill_timer is not None:
            self._kill_timer.join()

    def _kill(self, role: str) -> None:
        self.killed.update(role=role, t=time.monotonic())
        (self.producer if role == "producer" else self.decoder).kill()


def _fault_kw(params: dict[str, Any], index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(more ``kv_transfer_params`` of prompt ``index``'s decode leg, more ``call``
    arguments of it) for the drawn fault."""
    fault = params["fault"]
    if fault.get("prompt") != index or fault["kind"] == "kill":
        return {}, {}
    if fault["kind"] == "stall":
        return {STALL_KEY: fault["stall_s"]}, {}
    return {}, {"disconnect_after_s": fault["after_s"]}


def _pull_prompt(pair: DrawnPair, params: dict[str, Any], index: int, prompt: list[int],
                 flow: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prompt ``index``'s decode leg (after its prefill ``flow``, prefilled here if None)."""
    spec = params["prompts"][index]
    flow = flow or prefill(pair.producer, prompt, spec["n"])
    extra_params, extra_kw = _fault_kw(params, index)
    payload = decode_payload(flow, spec["tokens"])
    payload["kv_transfer_params"] = {**flow["params"], **extra_params}
    started = time.monotonic()
    pair.kill_later(params, index)
    outcome = call(pair.decoder, payload, limit_s=CLIENT_LIMIT_S, **extra_kw)
    return {**flow_record(flow), "index": index, "key": parent_of(flow["remote_request_id"])
            or flow["remote_request_id"], "t_decode_start": started, "decode": outcome,
            "t_end": time.monotonic()}


def _push_prompt(pair: DrawnPair, params: dict[str, Any], index: int,
                 prompt: list[int]) -> dict[str, Any]:
    spec = params["prompts"][index]
    rid = f"gen-{params['seed']}-{index}"
    extra_params, extra_kw = _fault_kw(params, index)
    pair.kill_later(params, index)
    both = legs(pair, rid, prompt, spec["n"], spec["n"], spec["tokens"],
                decode_params=extra_params, limit_s=CLIENT_LIMIT_S, **extra_kw)
    # Both legs start together: the decode leg is never late.
    return {**both, "index": index, "key": rid, "n": spec["n"],
            "t_prefilled": both["t_start"], "t_decode_start": both["t_start"],
            "t_end": time.monotonic()}


def _traffic(pair: DrawnPair, params: dict[str, Any],
             prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Every prompt through the pair as drawn; one record per prompt, in index order."""
    order = list(range(len(prompts)))
    if params["order"] == "reversed":
        order.reverse()
    one = _pull_prompt if params["mode"] == "pull" else _push_prompt
    if params["arrival"] == "sequential":
        done = [one(pair, params, i, prompts[i]) for i in order]
        return sorted(done, key=lambda flow: flow["index"])
    starts = sorted(params["offsets"])
    t0 = time.monotonic()

    def push_at(k: int, i: int) -> dict[str, Any]:
        time.sleep(max(0.0, t0 + starts[k] - time.monotonic()))
        return _push_prompt(pair, params, i, prompts[i])

    def prefill_at(i: int) -> dict[str, Any]:
        time.sleep(max(0.0, t0 + starts[i] - time.monotonic()))
        return prefill(pair.producer, prompts[i], params["prompts"][i]["n"])

    with ThreadPoolExecutor(len(prompts)) as pool:
        if params["mode"] == "push":
            futures = [pool.submit(push_at, k, i) for k, i in enumerate(order)]
            return sorted((f.result() for f in futures), key=lambda flow: flow["index"])
        # Pull: the prefills at their offsets in index order, then every decode leg at
        # once in the drawn order (a prompt's decode leg within its lease).
        flows = list(pool.map(prefill_at, range(len(prompts))))
        futures = []
        for i in order:
            futures.append(pool.submit(_pull_prompt, pair, params, i, prompts[i], flows[i]))
            time.sleep(0.2)
        return sorted((f.result() for f in futures), key=lambda flow: flow["index"])


def _hold_seats(pair: DrawnPair, params: dict[str, Any]) -> Future[dict[str, Any]] | None:
    """The drawn busy request: a child on every decoder seat, its client leaving
    ``busy_s`` after it started (sooner only if the machine decodes its tokens first)."""
    if not params["busy_s"]:
        return None
    leave = threading.Event()
    timer = threading.Timer(params["busy_s"], leave.set)
    timer.daemon = True
    timer.start()
    pool = ThreadPoolExecutor(1)
    busy = pool.submit(call, pair.decoder, {"prompt": tokens_of(0, 8, 7000),
                                            "n": params["decoder_seqs"],
                                            "max_tokens": BUSY_TOKENS},
                       limit_s=CLIENT_LIMIT_S, give_up=leave)
    pool.shutdown(wait=False)
    # The seats are taken before the drawn traffic comes.
    time.sleep(1.0)
    return busy


def _keep_stepping(pair: DrawnPair, running: threading.Event, errors: list[str]) -> None:
    while running.is_set():
        if "producer" not in pair.alive():
            return
        try:
            poke(pair.producer)
        except (Breakdown, RuntimeError) as error:  # recorded: ``violations`` reports it
            if "producer" in pair.alive():  # not a poke the drawn kill cut short
                errors.append(f"{type(error).__name__}: {error}"[:200])
        time.sleep(PRODUCER_STEP_S)


def run(run_dir: Path, params: dict[str, Any]) -> dict[str, Any]:
    """The drawn pair: a warm-up prompt (n = 1, the NIXL handshakes), the drawn traffic
    while the producer keeps stepping, then the KV usage of the engines left running,
    once none holds KV or a lease after the last call ended (``scenarios.settle``)."""
    pair = DrawnPair(run_dir, params)
    prompts = [tokens_of(spec["full_blocks"], spec["tail"], 2_000 + 4_000 * i)
               for i, spec in enumerate(params["prompts"])]
    record: dict[str, Any] = {"params": params, "release": release(),
                              "fix_sets": pair.fix_sets, "ready": pair.ready,
                              "block_size": block_size(), "client_limit_s": CLIENT_LIMIT_S,
                              "prompt_digests": [prompt_digest(p) for p in prompts]}
    try:
        warm = tokens_of(1, 4, 900)
        if params["mode"] == "pull":
            call(pair.decoder, decode_payload(prefill(pair.producer, warm, 1), 2),
                 limit_s=CLIENT_LIMIT_S)
        else:
            legs(pair, f"gen-{params['seed']}-warm", warm, 1, 1, 2, limit_s=CLIENT_LIMIT_S)
        running, errors = threading.Event(), []
        running.set()
        stepper = threading.Thread(target=_keep_stepping,
                                   args=(pair, running, errors), daemon=True)
        record["t_traffic"] = time.monotonic()
        stepper.start()
        try:
            busy = _hold_seats(pair, params)
            record["flows"] = _traffic(pair, params, prompts)
            record["busy"] = busy and busy.result()
            pair.wait_for_kill()
        finally:
            running.clear()
            stepper.join()
        record["step_errors"] = errors
        record["t_last_call"] = max(flow["t_end"] for flow in record["flows"])
        alive = pair.alive()
        settle(alive.get("producer"), list(alive.values()),
               record["t_last_call"] + params["lease"] + 1 - time.monotonic())
        record["t_final"] = time.monotonic()
        record["killed"] = pair.killed
        record["final"] = {role: sample(server, DECODER_METRICS)
                           for role, server in alive.items()}
    finally:
        for server in (pair.producer, pair.decoder):
            server.stop()
    for name, server in (("producer", pair.producer), ("decoder", pair.decoder)):
        record[f"{name}_lines"] = {needle: log_lines(server, 0, needle)
                                   for needle in (EXPIRED, INVALID)}
    return record


# ---------------------------------------------------------------------------- invariants


def violations(record: dict[str, Any]) -> list[str]:
    """What the run in ``record`` broke of what its engines' fix sets promise.

    Every fix set: no call hung; the producer failed no step; the KV usage of every
    engine left running 0 a lease after the last call (in push mode, a decoder's own
    only if it runs F9); no child holds other prompt KV than the producer's unless an
    invalid-KV line names its prompt (TP 1). Every fix on both engines: no invalid-KV
    line. A pull producer with F2 and F8 frees a prompt under a READ only by lease;
    before heartbeats (``HEARTBEATS_SINCE``), one with F2 frees only prompts a READ
    reached late, and none beside a decoder with F7. No prompt released by lease
    unless its decode leg came late, a stall froze the decoder within its lease (then,
    pull, no READ of it after the stall: F7) or its calls ended with a kill: every fix
    on both engines, or a pull decoder with F6 (heartbeats are upstream's), where a
    producer without F2 may still let the siblings no child reads expire (F2's bug)."""
    params, found = record["params"], []
    fixes = {role: fixes_run(fix_set, record["release"])
             for role, fix_set in record["fix_sets"].items()}
    both = all(fix_set == "all" for fix_set in record["fix_sets"].values())
    pull = params["mode"] == "pull"
    run_dir = Path(record["run_dir"])
    producer_events = probe_events(run_dir, "producer.probe.jsonl")
    decoder_events = probe_events(run_dir, "decoder.probe.jsonl")
    expired = record["producer_lines"][EXPIRED]
    invalid = record["producer_lines"][INVALID] + record["decoder_lines"][INVALID]
    timeout_layout = Version(record["release"]) < HEARTBEATS_SINCE
    if both or (timeout_layout and "F2" in fixes["producer"] and "F7" in fixes["decoder"]):
        found += [f"invalid-KV line: {line.strip()[-200:]}" for line in invalid]
    elif timeout_layout:
        if "F2" in fixes["producer"]:
            found += [f"invalid-KV line for a prompt READ in time: {line.strip()[-200:]}"
                      for line in invalid if not any(
                          _names(flow, line) and _read_late(flow, decoder_events, params)
                          for flow in record["flows"])]
    elif pull and {"F2", "F8"} <= fixes["producer"]:
        found += [f"invalid-KV line for a prompt not released by lease: {line.strip()[-200:]}"
                  for line in invalid if not any(_names(flow, line) and _names(flow, *expired)
                                                 for flow in record["flows"])]
    if {"F6", "F7"} <= fixes["decoder"] and (both or pull):
        read_only = not both and "F2" not in fixes["producer"]
        found += _released_by_lease(record, expired, decoder_events, read_only)
    found += [f"the producer failed a step: {error}" for error in record["step_errors"]]
    # A push decoder without F9 leaves a request whose registration is never served
    # waiting, its blocks held, until its client leaves (F9's own bug).
    ends = pull or "F9" in fixes["decoder"]
    for role, state in record["final"].items():
        if state["kv_cache_usage_perc"] != 0 and (ends or role == "producer"):
            found.append(f"{role} KV usage {state['kv_cache_usage_perc']} a lease after "
                         f"the last call")
    for flow in record["flows"]:
        for leg in ("prefill", "decode"):
            if flow.get(leg, {}).get("hung") and (ends or leg == "prefill"):
                found.append(f"prompt {flow['index']}: its {leg} call hung "
                             f"(no answer in {record['client_limit_s']} s)")
    if params["decoder_tp"] == 1:
        warned = {flow["index"] for flow in record["flows"] if _names(flow, *invalid)}
        found += _kv_problems(record, producer_events, decoder_events, warned)
    return found


def _names(flow: dict[str, Any], *lines: str) -> bool:
    """Whether one of ``lines`` names ``flow``'s prompt (its request or a sibling's)."""
    return any(flow["key"] in line for line in lines)


def _read_late(flow: dict[str, Any], decoder_events: list[dict[str, Any]],
               params: dict[str, Any]) -> bool:
    """Whether a READ of ``flow``'s prompt started later than ``LATE_MARGIN_S`` before
    its lease ran out (a READ takes milliseconds; the producer sees its notification in a
    step)."""
    deadline = flow["t_prefilled"] + params["lease"] - LATE_MARGIN_S
    return any(event["event"] == "read" and flow["key"] in event["notif"]
               and event["t"] > deadline for event in decoder_events)


def _released_by_lease(record: dict[str, Any], expired: list[str],
                       decoder_events: list[dict[str, Any]], read_only: bool) -> list[str]:
    """Prompts released by lease although their decode leg came in time, no stall froze
    the decoder (or, pull, it READ nothing of them after the stall) and no kill ended
    their calls; and releases that name no drawn prompt. ``read_only``: only releases of
    the sibling the children read (pull) count."""
    params, found = record["params"], []
    stalls = [(s["t"], e["t"]) for s in decoder_events if s["event"] == "stall"
              for e in decoder_events if e["event"] == "stalled" and e["req"] == s["req"]]
    for flow in record["flows"]:
        key = flow["key"]
        lines = [line for line in expired if key in line and not (
            read_only and flow.get("remote_request_id", key) not in line)]
        if not lines:
            continue
        late = flow["t_decode_start"] > flow["t_prefilled"] + params["lease"] - LATE_MARGIN_S
        frozen = [end for start, end in stalls
                  if start <= flow["t_end"] and end >= flow["t_prefilled"]]
        if late or flow["t_end"] >= record.get("killed", {}).get("t", float("inf")):
            continue
        if not frozen:
            found.append(f"prompt {flow['index']} ({key}) released by lease: {lines[0][-160:]}")
            continue
        reads = [e for e in decoder_events if e["event"] == "read" and key in e["notif"]
                 and e["t"] > min(frozen)]
        if params["mode"] == "pull" and reads:
            found.append(f"prompt {flow['index']} ({key}) released by lease during a stall "
                         f"and READ after it ({len(reads)} READs)")
    # Expired lines of prompts no flow names (the warm-up, or an id the keys miss).
    found += [f"a prompt released by lease that no drawn prompt names: {line[-160:]}"
              for line in expired if not any(_names(flow, line) for flow in record["flows"])]
    return found


def _kv_problems(record: dict[str, Any], producer_events: list[dict[str, Any]],
                 decoder_events: list[dict[str, Any]], warned: set[int]) -> list[str]:
    """``analysis.prompt_kv_problems`` for every prompt whose decode leg was served whole
    (its n choices) with KV the producer sent: not a prompt the decoder computed itself
    (a stalled one; pull, any it READ none of: F7 past its bound), nor one whose call
    ended with a kill, nor one an invalid-KV line warned of (index in ``warned``)."""
    params = record["params"]
    advertised = {}
    for event in producer_events:
        if event["event"] == "prompt_kv":
            advertised.setdefault(event["prompt"], event["req"])
    flows = []
    for flow in record["flows"]:
        decode = flow["decode"]
        if decode.get("status") != 200 or decode.get("choices") != flow["n"]:
            continue
        if params["fault"]["kind"] == "stall" and params["fault"]["prompt"] == flow["index"]:
            continue
        if params["mode"] == "pull" and not any(
                event["event"] == "read" and flow["key"] in event["notif"]
                for event in decoder_events):
            continue
        if flow["t_end"] >= record.get("killed", {}).get("t", float("inf")):
            continue
        if flow["index"] in warned:
            continue
        digest = record["prompt_digests"][flow["index"]]
        remote = flow.get("remote_request_id") or advertised.get(digest, f"(none: {digest})")
        flows.append({"remote_request_id": remote, "n": flow["n"]})
    return [f"prompt KV: {problem}"
            for problem in prompt_kv_problems(producer_events, decoder_events, flows)]


def rerun_command(seed: int, on: str, mode: str = "fixed") -> str:
    """The command that runs ``seed`` again on release ``on`` (``draw`` depends on it)."""
    return (f".venv/bin/python tools/scenario_search.py --start {seed} --seeds 1 "
            f"--release v{on}"
            + (" --mode stock" if mode == "stock" else ""))
