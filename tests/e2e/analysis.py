"""What the records and probe events of e2e runs show; shared by the tests and benchmarks.

Pure functions over a scenario's ``record.json`` and the probe's events
(``engine_plugins/e2e_probe.py``); nothing here runs an engine.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

LOG_PROCESS = re.compile(r"\[pid=(\d+) ([^\]]+)\]")
# The message of a vLLM log line: what follows its "[file.py:line] " location.
LOG_MESSAGE = re.compile(r"\[[\w.]+\.py:\d+\] (.*)$")
SIBLING = re.compile(r"^(\d+)_(.+)$")


# ----------------------------------------------------------------------- plugin line


def lines_by_process(log: Path, prefix: str) -> dict[int, tuple[str, list[str]]]:
    """pid -> (process name, its log messages that start with ``prefix``), for every
    process that logged a line with vLLM's ``[pid=N name]`` prefix. Only messages: a
    path in a traceback may hold ``prefix`` too (a checkout named ``vllm-patches``)."""
    processes: dict[int, tuple[str, list[str]]] = {}
    for line in log.read_text(errors="replace").splitlines():
        match = LOG_PROCESS.search(line)
        if not match:
            continue
        pid, name = int(match.group(1)), match.group(2)
        entry = processes.setdefault(pid, (name, []))
        message = LOG_MESSAGE.search(line)
        if message and message.group(1).startswith(prefix):
            entry[1].append(message.group(1))
    return processes


# vLLM's process names (multiprocessing), one of each in a served engine on CPU.
ROLES = {"API server": "MainProcess", "engine core": "EngineCore", "worker": "VllmWorker-"}


def plugin_line_problems(log: Path, expected: str, quiet: tuple[str, ...] = ()
                         ) -> list[str]:
    """What is wrong with the plugin's lines in a served engine's log: one process of
    each of ``ROLES``, each logging exactly ``expected`` (a process without the line
    would run unfixed: F1 acts in the engine core, F2/F3/F4 in the workers); a role in
    ``quiet`` (one that loads plugins before vLLM configures its logging) may log
    nothing instead."""
    processes = lines_by_process(log, "vllm-patches")
    names = sorted(name for name, _ in processes.values())
    problems = [f"{log.name}: expected one {role} process ({name}), found {names}"
                for role, name in ROLES.items()
                if sum(n.startswith(name) for n in names) != 1]
    quiet_names = tuple(ROLES[role] for role in quiet)
    problems += [f"{log.name}: process {pid} ({name}) logged {lines}, not [{expected!r}]"
                 for pid, (name, lines) in sorted(processes.items())
                 if lines != [expected] and not (lines == [] and name.startswith(quiet_names))]
    return problems


def diagnosed(run_dir: Path) -> dict[str, list[str]]:
    """Engine log -> the symptoms `vllm-patches diagnose` finds in it, for each engine of
    a run (``producer*.log``, ``decoder*.log``: a restarted engine's too); a log without
    findings is left out."""
    from vllm_patches._commands import diagnose as _diagnose

    found: dict[str, list[str]] = {}
    for log in sorted([*run_dir.glob("producer*.log"), *run_dir.glob("decoder*.log")]):
        symptoms = [finding["symptom"] for finding in _diagnose.diagnose([str(log)])]
        if symptoms:
            found[log.name] = symptoms
    return found


# ------------------------------------------------------------------------------- F1


def pair_plugin_line_problems(run_dir: Path, expected: str, quiet: tuple[str, ...] = ()
                              ) -> list[str]:
    """``plugin_line_problems`` of both engines of a pair run in ``run_dir``."""
    return [problem for engine in ("producer", "decoder")
            for problem in plugin_line_problems(run_dir / f"{engine}.log", expected, quiet)]


def blocks_in_several_groups(block_ids: list[list[int]]) -> dict[int, list[int]]:
    """Physical block id -> the KV-cache groups holding it, for every block (other than
    the null block 0) that more than one group holds: vllm#33775."""
    holders: dict[int, list[int]] = defaultdict(list)
    for group, ids in enumerate(block_ids):
        for block in set(ids) - {0}:
            holders[block].append(group)
    return {block: groups for block, groups in sorted(holders.items()) if len(groups) > 1}


def engine_request(events: list[dict[str, Any]], event: str, client_id: str) -> dict[str, Any]:
    """The ``event`` of the request the client knows as ``client_id`` (the engine adds a
    random suffix: ``0`` -> ``0-1a2b3c4d``)."""
    found = [e for e in events if e["event"] == event and e["req"].startswith(client_id + "-")]
    if len(found) != 1:
        raise AssertionError(f"expected one {event} event for request {client_id}, "
                             f"found {len(found)}")
    return found[0]


# ---------------------------------------------------------------------------- F2/F3


def parent_of(req_id: str) -> str | None:
    """The parent of a parallel-sampling sibling ``f"{i}_{parent}"``, else None."""
    match = SIBLING.match(req_id)
    return match.group(2) if match else None


# A decoder's heartbeat ("HB:req,req"), v0.22+: renews leases, reports no pull.
HEARTBEAT_PREFIX = "HB:"


def pull_notifications(messages: list[str]) -> list[str]:
    """The pull notifications (``f"{req_id}:{count}"``) among NIXL notification messages."""
    return [message for message in messages if not message.startswith(HEARTBEAT_PREFIX)]


def notification_messages(events: list[dict[str, Any]]) -> list[tuple[float, str]]:
    """(time read, request id) of every pull notification a producer's worker read."""
    return [(event["t"], message.rsplit(":", 1)[0]) for event in events
            if event["event"] == "notifs" for message in pull_notifications(event["msgs"])]


def reads_by_request(decoder_events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Remote (producer) request id -> the READs and bare notifications a decoder sent
    for it, in order."""
    reads: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in decoder_events:
        if event["event"] in ("read", "notif_sent") and pull_notifications([event["notif"]]):
            reads[event["notif"].rsplit(":", 1)[0]].append(event)
    return reads


def notification_timing(producer_events: list[dict[str, Any]],
                        decoder_events: list[dict[str, Any]], remote_ids: list[str]
                        ) -> list[dict[str, Any]]:
    """Per advertised request: how many READs the decoder posted for it and how far
    apart, how many notifications the producer read for it, and when each was read
    relative to the first (ms), and in how many separate reads of the agent."""
    by_request: dict[str, list[float]] = defaultdict(list)
    for t, req_id in notification_messages(producer_events):
        by_request[req_id].append(t)
    reads = reads_by_request(decoder_events)
    rows = []
    for remote_id in remote_ids:
        times, posted = sorted(by_request.get(remote_id, [])), reads.get(remote_id, [])
        rows.append({
            "remote_request_id": remote_id,
            "reads_posted": sum(1 for e in posted if e["event"] == "read"),
            "bare_notifications": sum(1 for e in posted if e["event"] == "notif_sent"),
            "descriptors_per_read": sorted({e["descs"] for e in posted if e["event"] == "read"}),
            "reads_posted_within_ms": round(1000 * (posted[-1]["t"] - posted[0]["t"]), 2)
            if posted else None,
            "notifications_read": len(times),
            "notification_offsets_ms": [round(1000 * (t - times[0]), 2) for t in times],
            "separate_agent_reads": len(set(times)),
        })
    return rows


def frees_while_read_outstanding(producer_events: list[dict[str, Any]],
                                 decoder_events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Blocks the producer returned to the free queue before it had read the pull
    notification of every READ of a request that held them (see the F2 test's docstring
    for why this is "freed while a READ of it was outstanding").

    For each ``free`` of a request R with block ids B (all groups), each block b of B is
    followed to the moment it next reached ref_cnt 0 (at R's free, or at the free of
    another request sharing it); notifications for R read after that moment are a
    violation, one entry per (R, b), when one of them is a READ's. The producer reads
    R's notifications in the order the decoder sent them (one NIXL agent to another), so
    those read after the free are the last ones the decoder sent for R; a bare
    notification (a full local prefix hit: a child that took the read prompt from the
    decoder's prefix cache, sent once that READ completed) reads nothing."""
    notified: dict[str, list[float]] = defaultdict(list)
    for t, req_id in notification_messages(producer_events):
        notified[req_id].append(t)
    sent = reads_by_request(decoder_events)
    zero_at: dict[int, list[float]] = defaultdict(list)
    frees = [e for e in producer_events if e["event"] == "free"]
    for event in frees:
        for block in event["freed"]:
            zero_at[block].append(event["t"])
    violations = []
    for event in frees:
        if event["req"] not in notified:
            continue
        for block in sorted({b for group in event["blocks"] for b in group} - {0}):
            freed = next((t for t in zero_at[block] if t >= event["t"]), None)
            if freed is None:
                continue
            later = [t for t in notified[event["req"]] if t > freed]
            if later and any(e["event"] == "read" for e in sent[event["req"]][-len(later):]):
                violations.append({"req": event["req"], "block": block,
                                   "notifications_after_free": len(later),
                                   "ms_after_free": round(1000 * (max(later) - freed), 2)})
    return violations


def siblings_by_parent(producer_events: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Parent id -> its sibling requests, from the producer's frees."""
    parents: dict[str, set[str]] = defaultdict(set)
    for event in producer_events:
        if event["event"] == "free" and (parent := parent_of(event["req"])):
            parents[parent].add(event["req"])
    return parents


def prompt_kv_problems(producer_events: list[dict[str, Any]],
                       decoder_events: list[dict[str, Any]],
                       flows: list[dict[str, Any]]) -> list[str]:
    """What differs between the full blocks of the sibling the producer advertised for
    each prompt of ``flows`` and those each of the decoder's n children of that prompt
    holds right after the step that completed its prompt (the probe's ``prompt_kv``).
    Empty when every child holds the advertised sibling's full blocks bit for bit."""
    producer_kv = {e["req"]: e for e in producer_events if e["event"] == "prompt_kv"}
    decoder_kv = [e for e in decoder_events if e["event"] == "prompt_kv"]
    problems = []
    for flow in flows:
        remote, n = flow["remote_request_id"], flow["n"]
        advertised = producer_kv.get(remote)
        if advertised is None:
            problems.append(f"{remote}: the producer recorded no KV for it")
            continue
        children = [e for e in decoder_kv if e["prompt"] == advertised["prompt"]]
        if len(children) != n:
            problems.append(f"{remote}: the decoder recorded {len(children)} children, not {n}")
        problems += [f"{remote}: child {child['req']} full blocks {child['full']}, "
                     f"the producer's {advertised['full']}"
                     for child in children if child["full"] != advertised["full"]]
    return problems


def staged_after(producer_events: list[dict[str, Any]], t: float) -> int | None:
    """Early notifications staged by the producer in its last report before ``t``
    (None: the worker has no staging, i.e. stock)."""
    states = [e for e in producer_events if e["event"] == "nixl_state" and e["t"] <= t]
    return states[-1]["staged"] if states else None


def held_blocks_timeline(producer_events: list[dict[str, Any]], since: float
                         ) -> list[tuple[float, int]]:
    """(seconds since ``since``, blocks in use) at each producer step from ``since``."""
    return [(round(e["t"] - since, 3), e["used_blocks"]) for e in producer_events
            if e["event"] == "step" and e["t"] >= since]


def released_at(producer_events: list[dict[str, Any]], rid: str) -> float | None:
    """When the producer first reported a request named by ``rid`` done sending (its
    blocks freed), if it did."""
    return next((e["t"] for e in producer_events if e["event"] == "finished_sending"
                 and any(rid in r for r in e["reqs"])), None)


def held_after_pull(producer_events: list[dict[str, Any]], remote_id: str) -> float | None:
    """Seconds from the producer reading the first pull notification for the advertised
    sibling ``remote_id`` to its freeing the last sibling of that prompt (None if a
    sibling was never freed or never notified)."""
    parent = parent_of(remote_id)
    notified = [t for t, req_id in notification_messages(producer_events) if req_id == remote_id]
    freed = [e["t"] for e in producer_events
             if e["event"] == "free" and parent_of(e["req"]) == parent]
    return round(max(freed) - min(notified), 3) if notified and freed else None


def pair_summary(record: dict[str, Any], producer_events: list[dict[str, Any]],
                 decoder_events: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one NIXL pair run (``scenarios.nixl_pair``) an operator and F2's
    design care about."""
    flows = record["flows"]
    remote_ids = [flow["remote_request_id"] for flow in flows]
    burst_steps = [e for e in producer_events if e["event"] == "step"
                   and record["t_burst"] <= e["t"] <= record["t_expired"]]
    # The frees of the drain's last poke leave what the burst still holds.
    after_drain = [e["used_blocks"] for e in producer_events
                   if e["event"] == "free" and e["t"] <= record["t_drained"]]
    held = [held_after_pull(producer_events, remote) for remote in remote_ids]
    return {
        "samples": [flow["n"] for flow in flows],
        "expired_lines": len(record["expired_lines"]),
        "invalid_kv_lines": len(record["invalid_lines"]),
        "kv_usage_after_burst": record["usage_after_burst"],
        "kv_usage_after_expiry": record["usage_after_expiry"],
        "peak_blocks_in_use": max((e["used_blocks"] for e in burst_steps), default=None),
        "blocks_in_use_after_drain": after_drain[-1] if after_drain else None,
        "s_siblings_held_after_first_pull": held,
        # From the first prefill to the step after the producer read the last pull
        # notification: the burst, prefill to every decode child's READ done.
        "s_burst_to_drained": round(record["t_drained"] - record["t_burst"], 1),
        "expiry_s": record["expiry_s"],
        "bytes_transferred": record["bytes_transferred"],
        "transfers": record["transfers"],
        "staged_after_drain": staged_after(producer_events, record["t_drained"]),
        "blocks_freed_while_read_outstanding":
            len(frees_while_read_outstanding(producer_events, decoder_events)),
        "notification_timing": notification_timing(producer_events, decoder_events, remote_ids),
    }


def _percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def load_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of one load run (``scenarios.nixl_load``): what an operator of a P/D
    deployment watches. Usage figures are over the load window (samples up to
    ``seconds``); "pool-bound" samples are those where the producer had requests waiting
    while its pool was at least 90 % used."""
    flows = record["flows"]
    latencies = [flow["t_decoded"] - flow["t_start"] for flow in flows]
    window = [s for s in record["samples"] if s["t"] <= record["seconds"]]
    usages = [s["usage"] for s in window]
    return {
        "clients": record["clients"], "n": record["n"], "seconds": record["seconds"],
        "pool_blocks": record["pool_blocks"], "prompt_tokens": record["prompt_tokens"],
        "prompts": len(flows),
        "prompts_per_min": round(60 * len(flows) / record["t_done"], 2),
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p90_s": _percentile(latencies, 0.9),
        "usage_peak": max(usages, default=None),
        "usage_mean": sum(usages) / len(usages) if usages else None,
        "usage_after": record["usage_after"],
        "pool_bound_samples": sum(1 for s in window if s["waiting"] > 0 and s["usage"] >= 0.9),
        "samples": len(window),
        "expired_lines": len(record["expired_lines"]),
        "invalid_kv_lines": len(record["invalid_lines"]),
        "bytes_transferred": record["bytes_transferred"],
        "transfers": record["transfers"],
        "usage_timeline": [(s["t"], s["usage"]) for s in record["samples"]],
    }
