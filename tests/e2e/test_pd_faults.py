"""The P/D fault matrix in a real NIXL pair: children
admitted in waves past the lease, clients that disconnect, engines killed and restarted.

One pair per run (``faults.py``, which says what each case sends): a producer and a
decoder that runs ``faults.DECODER_SEQS`` children at a time, lease ``faults.LEASE_S``
(12 s: heartbeats every 2 s, each renewing 8 s). The runs:
- stock and fixed with ``NixlConnector``, every case (the kill cases fixed only).
  ``MultiConnector`` runs in generated seeds (``harness.pair_runs``).

What each case must show, fixed: no "Releasing expired KV blocks" line and no
"Potentially invalid KV blocks" line for a prompt that was decoded or whose client left
(only a prompt nobody ever decodes, and a killed decoder's, wait for the lease), every
child that completed holds the producer's prompt KV bit for bit, no READ of a prompt
whose lease lapsed while the decoder stalled, the producer's KV usage back to 0, no
client call hung, a killed producer's requests answered with an error within the bound,
and a restarted engine serving again. Stock shows F2's expiries and invalid-KV lines in
every case that decodes and READs the stalled prompt after the producer released it.
Each check fails, never skips, when its case was not reached. No run shows F6 here (why:
docs/real-engine-lane.md, "F6 in an engine").
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

import analysis
import pytest
from harness import bug_expected, pair_runs, probe_events, run_scenario

pytestmark = pytest.mark.engine

# The cases of faults.CASES each run takes. The kill cases restart an engine (a minute
# on 2 cores each): fixed NixlConnector alone runs them. Stock has no bug of its own
# there (it frees a killed decoder's prompt by lease too, and fails a killed
# producer's requests the same way: checked stock until 2026-11-26), so a stock run
# would show nothing a fixed one does not.
PAIR_CASES = ["waves", "abort_decoding", "abort_waiting", "no_decode", "stalled_decoder"]
KILL_CASES = ["decoder_killed", "producer_killed"]
RUNS = pair_runs()
KILL_RUNS = [run for run in RUNS if run == ("fixed", "NixlConnector")]
LEASE_LINE = re.compile(r"request (\S+) which were retrieved by (\d+)")
INVALID_LINE = re.compile(r"unrecognized request (\S+) were retrieved")


class Faults:
    """One run of the fault matrix, with the probe events of its first engines."""

    def __init__(self, mode: str, connector: str) -> None:
        self.mode = mode
        cases = PAIR_CASES + (KILL_CASES if (mode, connector) in KILL_RUNS else [])
        self.record = run_scenario("nixl_faults", "stock" if mode == "stock" else "fixed",
                                   {"connector": connector, "cases": cases},
                                   label=f"nixl-faults-{connector}-{mode}")
        self.run_dir = Path(self.record["run_dir"])
        self.cases = self.record["cases"]
        self.producer = probe_events(self.run_dir, "producer.probe.jsonl")
        self.decoder = probe_events(self.run_dir, "decoder.probe.jsonl")
        self.expired = self._by_parent(LEASE_LINE, self.record["expired_lines"])
        self.invalid = self._by_parent(INVALID_LINE, self.record["invalid_lines"])

    @staticmethod
    def _by_parent(pattern: re.Pattern, lines: list[str]) -> Counter:
        return Counter(analysis.parent_of(pattern.search(line).group(1)) for line in lines)

    def case(self, name: str) -> dict:
        assert name in self.cases, f"case {name} did not run: {sorted(self.cases)}"
        return self.cases[name]

    def symptoms(self, name: str) -> dict[str, int]:
        """Expired and invalid-KV lines of the prompts case ``name`` sent first."""
        parents = [analysis.parent_of(f["remote_request_id"]) for f in self.case(name)["flows"]]
        return {"expired": sum(self.expired[p] for p in parents),
                "invalid": sum(self.invalid[p] for p in parents)}

    def children_ready(self, flow: dict) -> list[float]:
        """When each of the decoder's children of ``flow``'s prompt completed its prompt
        (the probe's ``prompt_kv``), in order."""
        advertised = [e for e in self.producer
                      if e["event"] == "prompt_kv" and e["req"] == flow["remote_request_id"]]
        assert advertised, f"the producer recorded no KV for {flow['remote_request_id']}"
        return sorted(e["t"] for e in self.decoder
                      if e["event"] == "prompt_kv" and e["prompt"] == advertised[0]["prompt"])


@functools.cache
def faults(mode: str, connector: str) -> Faults:
    return Faults(mode, connector)


def served(call: dict, n: int) -> None:
    assert call["status"] == 200 and call.get("choices") == n and not call["hung"], call


@pytest.mark.parametrize(("mode", "connector"), RUNS)
def test_children_in_waves_keep_the_prompt_until_the_last_is_served(mode: str,
                                                                    connector: str) -> None:
    """Case a. A prompt's children are admitted ``DECODER_SEQS`` at a time; fixed, the
    decoder renews the lease while any child still needs the prompt (F6) and the
    producer releases the siblings with the last child's notification (F2), never by
    lease, although later waves start after the lease: no expired and no invalid-KV
    line. Stock releases the unread siblings by lease and logs the later children's
    notifications as invalid (F2's bug)."""
    run = faults(mode, connector)
    case = run.case("waves")
    for flow, call in zip(case["flows"], case["calls"], strict=True):
        served(call, flow["n"])
    # Reached: the n = 6 prompt's last wave began past the lease (not needed of a stock
    # decoder, which READs every child's KV up front while they wait).
    flow = case["flows"][0]
    ready = run.children_ready(flow)
    assert len(ready) == flow["n"], f"{len(ready)} children of n={flow['n']} completed"
    if mode != "stock":
        late = ready[-1] - flow["t_prefilled"]
        assert late > run.record["lease_s"], \
            f"the last wave began {late:.1f} s after the prefill, within the lease"
    symptoms = run.symptoms("waves")
    if bug_expected("F2", mode):
        assert symptoms["expired"] > 0 and symptoms["invalid"] > 0, symptoms
    else:
        assert symptoms == {"expired": 0, "invalid": 0}, symptoms


@pytest.mark.parametrize(("mode", "connector"), [r for r in RUNS if r[0] != "stock"])
def test_every_child_in_waves_holds_the_prompt_kv(mode: str, connector: str) -> None:
    """Case a: every child of both prompts, whichever wave it came in, holds the
    advertised sibling's full blocks bit for bit (``analysis.prompt_kv_problems``)."""
    run = faults(mode, connector)
    problems = analysis.prompt_kv_problems(run.producer, run.decoder,
                                           run.case("waves")["flows"])
    assert not problems, problems


@pytest.mark.parametrize("name", ["abort_decoding", "abort_waiting"])
@pytest.mark.parametrize(("mode", "connector"), RUNS)
def test_client_that_leaves_releases_the_prompt_at_once(mode: str, connector: str,
                                                        name: str) -> None:
    """Case c, n = 8. A client that disconnects from the decode leg after its first
    tokens, or while every child still waits behind a busy decoder (before any READ):
    the decoder drops every child, and the producer releases the prompt's siblings at
    once (fixed: no expired and no invalid-KV line). Stock releases the read sibling
    at the first notification and the unread ones by lease."""
    run = faults(mode, connector)
    case = run.case(name)
    assert case["calls"][0]["disconnected"], case["calls"][0]
    assert case["settled"], "the decoder still held requests a minute after the client left"
    symptoms = run.symptoms(name)
    if bug_expected("F2", mode):
        assert symptoms["expired"] > 0, symptoms
    else:
        assert symptoms == {"expired": 0, "invalid": 0}, symptoms


@pytest.mark.parametrize(("mode", "connector"), RUNS)
def test_prompt_nobody_decodes_is_released_by_lease(mode: str, connector: str) -> None:
    """Case c, the client gone between the legs: nothing but the lease can free the
    prompt (one expired line per sibling, stock and fixed), and it does: the producer's
    KV usage is back to 0 once a lease after the last shared case has passed."""
    run = faults(mode, connector)
    flow = run.case("no_decode")["flows"][0]
    assert run.symptoms("no_decode") == {"expired": flow["n"], "invalid": 0}
    assert run.record["shared_past_lease"]["usage"] == 0.0


@pytest.mark.parametrize(("mode", "connector"), RUNS)
def test_decoder_stalled_past_the_lease_never_serves_released_blocks(mode: str,
                                                                     connector: str) -> None:
    """Case b. The decoder's engine core does not step for longer than the lease while
    a prompt's children (n = 3) wait for its KV, so no heartbeat renews the lease and the
    producer releases the prompt (its expired lines: the case was reached). Stock then
    READs the released blocks anyway: the producer logs "Potentially invalid KV blocks"
    and the client gets a normal answer computed from whatever the READ found (the
    production report of aws-samples/aws-do-eks PR 84). Fixed (F7), the decoder READs
    nothing of a prompt whose lease it cannot vouch for and computes it itself: a
    normal answer and no READ (the producer may still log its notifications, which
    carry no READ, as invalid KV: it released the prompt)."""
    run = faults(mode, connector)
    case = run.case("stalled_decoder")
    flow = case["flows"][0]
    remote = flow["remote_request_id"]
    stalls = [e for e in run.decoder if e["event"] == "stalled" and e["remote"] == remote]
    assert stalls, "the decoder never stalled on the prompt"
    symptoms = run.symptoms("stalled_decoder")
    assert symptoms["expired"] > 0, \
        f"the producer did not release {remote} by lease during the stall: {symptoms}"
    served(case["calls"][0], flow["n"])
    reads_after = [e for e in analysis.reads_by_request(run.decoder).get(remote, ())
                   if e["event"] == "read" and e["t"] > stalls[0]["t"]]
    if mode == "stock":
        assert reads_after and symptoms["invalid"] > 0, (reads_after, symptoms)
    else:
        assert not reads_after, f"{len(reads_after)} READ(s) of a released prompt"


@pytest.mark.parametrize(("mode", "connector"), RUNS)
def test_diagnose_names_the_lapsed_lease_on_stock_and_nothing_fixed(mode: str,
                                                                   connector: str) -> None:
    """`vllm-patches diagnose` on the run's engine logs, the operator's view of the
    cases above: stock's producer shows KV served after its lease (the waves' and the
    stalled decoder's expired-then-invalid pairs, F6 and F7); a fixed pair's logs show
    nothing, though the producer still logs the notifications of the prompt F7 computed
    and the expiries of the prompt nobody decodes."""
    run = faults(mode, connector)
    found = analysis.diagnosed(run.run_dir)
    if bug_expected("F7", mode):
        assert "kv-served-after-lease" in found.get("producer.log", []), found
    else:
        assert found == {}, found


@pytest.mark.parametrize(("mode", "connector"), KILL_RUNS)
def test_killed_decoder_leaks_nothing_and_its_successor_serves(mode: str,
                                                               connector: str) -> None:
    """Case d. The decoder is SIGKILLed while a prompt's children decode (after its
    READ): the client's call fails, the producer frees the prompt by lease (no block
    left held: KV usage 0), and a new decoder on the same ports handshakes and serves
    a new prompt."""
    run = faults(mode, connector)
    case = run.case("decoder_killed")
    assert case["read_before_kill"], "the decoder was killed before it READ the prompt"
    killed = case["calls"][0]
    assert killed["status"] != 200 and not killed["hung"], killed
    assert case["usage_past_lease"] == 0.0
    served(case["served_after"], case["after_flows"][0]["n"])


@pytest.mark.parametrize(("mode", "connector"), KILL_RUNS)
def test_killed_producer_fails_its_requests_and_its_successor_serves(mode: str,
                                                                     connector: str) -> None:
    """Case e. The producer is SIGKILLed after a prefill, before the decoder reads: the
    decode leg is answered within the bound with an error the client sees (an HTTP
    error status, not a hang and not a normal answer), the decoder keeps no request,
    and once a new producer is up the pair serves a new prompt."""
    run = faults(mode, connector)
    case = run.case("producer_killed")
    failed = case["calls"][0]
    assert failed["status"] is not None and failed["status"] >= 400 and not failed["hung"], \
        failed
    assert case["settled"]
    served(case["served_after"], case["after_flows"][0]["n"])


@pytest.mark.parametrize(("mode", "connector"), RUNS)
def test_no_call_hangs_and_nothing_is_left_held(mode: str, connector: str) -> None:
    """Every client call of every case got an answer (or its client left) within the
    bound, and the decoder ends with no request."""
    run = faults(mode, connector)
    hung = [(name, call) for name, case in run.cases.items()
            for call in case["calls"] + [case.get("served_after") or {}] if call.get("hung")]
    assert not hung, hung
    assert run.record["decoder_idle"]
