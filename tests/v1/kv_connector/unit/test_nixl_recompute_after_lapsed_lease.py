# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL consumer: no READ of a prompt whose lease may have lapsed on the producer.

From v0.22 (PR 41383) the producer holds a finished prefill's KV blocks under a
lease, which each heartbeat from the decoder extends to lease * 2 // 3 from when
the producer handles it. Heartbeats ride the decoder's steps, so a decoder that
does not step for longer than that (a stall, a starved CPU), or a request whose
first step comes later than that, lets the lease lapse: the producer releases the
blocks, and upstream's decoder READs them anyway and serves whatever it read.

Before v0.22 the producer holds the blocks for VLLM_NIXL_ABORT_REQUEST_TIMEOUT
from the prefill's end and nothing renews it: a request that waits for a seat, or
across a stall, meets the same end (upstream issue 21570: "the D node retrieves
the already released kv blocks, leading to abnormal precision").

These tests drive the scheduler with the NIXL connector's scheduler side under a
controlled clock (``time.perf_counter`` and ``time.time`` moved forward, as a stall
does) and read each step's connector metadata as the decode workers get it. A lease
of 30 s: the producer's extension is 20 s, the heartbeat interval 5 s, so the decoder
vouches for a prompt 15 s after it arrived or after a heartbeat named it. Before
v0.22, a timeout of 30 s: the decoder vouches for half of it from the arrival, the
same 15 s.
"""

import pytest

from vllm.v1.request import RequestStatus

from .nixl_harness import (
    PROMPT_BLOCKS,
    REMOTE_REQUEST_ID,
    Clock,
    PullDecoder,
    connector_module,
    remote_children,
)
from .utils import create_request, create_scheduler, create_vllm_config

pytestmark = pytest.mark.cpu_test

LEASE = {"kv_lease_duration": 30}
TIMEOUT = "30"
# The producer's extension (20 s) less the heartbeat interval (5 s); half the timeout.
VOUCHED = 15
# Step heartbeats renew the producer's hold from v0.22 (PR 41383).
HEARTBEATS = hasattr(connector_module().NixlConnectorMetadata(), "heartbeat_by_engine")
# Steps of a busy decoder: heartbeats go out every other one.
STEP = 4


@pytest.fixture(autouse=True)
def producer_timeout(monkeypatch):
    """The producer's hold before v0.22, as both engines read it."""
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", TIMEOUT)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    return Clock(monkeypatch, wall=True)


def remote_prompt(
    n: int,
    *,
    blocker: bool = False,
    queued: float = 0.0,
    max_tokens: int = 2,
    through: str = "NixlConnector",
    **extra_config,
) -> tuple:
    """A decoder with ``n`` requests of one remote prompt waiting (the children of
    a parallel-sampling request when ``n > 1``), and KV room for all of them. With
    ``blocker``, a local request takes the room first, so that the remote prompt
    waits for blocks until it finishes (after 6 steps). ``queued``: seconds the
    requests arrived at the front end before the engine core took them; ``through``:
    the NIXL connector itself or a MultiConnector with it as its only child."""
    config = {**LEASE, **extra_config}
    vllm_config = create_vllm_config(kv_connector_extra_config=config)
    if through == "MultiConnector":
        transfer = vllm_config.kv_transfer_config
        transfer.kv_connector = "MultiConnector"
        transfer.kv_connector_extra_config = {
            "connectors": [
                {
                    "kv_connector": "NixlConnector",
                    "kv_role": transfer.kv_role,
                    "kv_connector_extra_config": config,
                }
            ]
        }
    block_size = vllm_config.cache_config.block_size
    scheduler = create_scheduler(vllm_config, num_blocks=1 + n * PROMPT_BLOCKS)
    num_tokens = int(block_size * (PROMPT_BLOCKS - 0.5))
    requests = []
    if blocker:
        local = create_request(
            request_id=100, block_size=block_size, num_tokens=num_tokens, max_tokens=6
        )
        scheduler.add_request(local)
        requests.append(local)
    children = remote_children(n, block_size, num_tokens, max_tokens=max_tokens)
    for child in children:
        child.arrival_time -= queued
        scheduler.add_request(child)
    return scheduler, requests + children


def wait_out_blocker(decoder: PullDecoder, clock: Clock, blocker) -> None:
    """Steps of a busy decoder, STEP seconds each, until ``blocker`` finished: the
    remote prompt waits longer than the lease, kept by heartbeats."""
    renewals = 0
    while blocker.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        clock.advance(STEP)
        renewals += decoder.step()
    assert renewals >= 2, "no heartbeats renewed the prompt while it waited"


def read_or_computed(decoder: PullDecoder, request) -> str:
    """Step until the decoder decided for ``request``: "read" (a READ of the
    producer's blocks started) or "computed" (the scheduler computed the prompt)."""
    for _ in range(4):
        decoder.step()
        if request.request_id in decoder.loading | decoder.read:
            assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            return "read"
        if request.num_computed_tokens >= request.num_prompt_tokens:
            return "computed"
    raise AssertionError(f"{request.request_id} neither read nor computed")


@pytest.mark.parametrize("lapse", ["stalled", "waited"])
def test_lapsed_lease_computes_prompt_locally(clock, lapse):
    """A decoder that did not step for longer than it can vouch for the lease
    (stalled: after heartbeats kept it while the prompt waited for blocks; waited:
    before the prompt's first step, also against the timeout before v0.22) computes
    the prompt itself."""
    if lapse == "stalled":
        if not HEARTBEATS:
            pytest.skip("no heartbeats before v0.22: the waited case is the stall")
        scheduler, (blocker, request) = remote_prompt(1, blocker=True)
        decoder = PullDecoder(scheduler, [blocker, request])
        wait_out_blocker(decoder, clock, blocker)
    else:
        scheduler, (request,) = remote_prompt(1)
        decoder = PullDecoder(scheduler, [request])
    clock.advance(VOUCHED + 1)
    assert read_or_computed(decoder, request) == "computed", (
        f"READ of a prompt whose lease may have lapsed ({lapse})"
    )


def test_a_request_queued_past_the_bound_computes_prompt_locally(clock):
    """A decode request that waited in the engine core's input queue (a stalled core
    takes no input) longer than the decoder can vouch for the lease, counted from
    its arrival at the front end: computed locally, never read. (A real pair: the
    producer had released the prompt by lease, and the decoder READ it.)"""
    scheduler, (request,) = remote_prompt(1, queued=VOUCHED + 1)
    decoder = PullDecoder(scheduler, [request])
    assert read_or_computed(decoder, request) == "computed"


def test_renewed_lease_still_reads(clock):
    """Heartbeats kept the lease while the prompt waited longer than the lease
    itself: the decoder READs it, as upstream does."""
    if not HEARTBEATS:
        pytest.skip("no heartbeats before v0.22: nothing renews the timeout")
    scheduler, (blocker, request) = remote_prompt(1, blocker=True)
    decoder = PullDecoder(scheduler, [blocker, request])
    wait_out_blocker(decoder, clock, blocker)
    clock.advance(STEP)
    assert read_or_computed(decoder, request) == "read"


def test_a_read_within_the_bound_is_upstreams(clock):
    """A prompt scheduled just inside the bound is read."""
    scheduler, (request,) = remote_prompt(1)
    decoder = PullDecoder(scheduler, [request])
    clock.advance(VOUCHED - 1)
    assert read_or_computed(decoder, request) == "read"


def test_switched_off_reads_as_upstream(clock):
    """recompute_after_lapsed_lease false: the decoder READs whatever the lease."""
    scheduler, (request,) = remote_prompt(1, recompute_after_lapsed_lease=False)
    decoder = PullDecoder(scheduler, [request])
    clock.advance(VOUCHED + 1)
    assert read_or_computed(decoder, request) == "read"


def test_children_read_nothing_after_the_lease_lapsed(clock):
    """The children of a parallel-sampling prompt whose lease may have lapsed:
    none READs it, each computes it or takes it from the local prefix cache."""
    scheduler, children = remote_prompt(4)
    decoder = PullDecoder(scheduler, children)
    clock.advance(VOUCHED + 1)
    for _ in range(8):
        decoder.step()
        assert not decoder.loading, "a child READs a prompt whose lease lapsed"
        if all(c.num_computed_tokens >= c.num_prompt_tokens for c in children):
            break
    else:
        raise AssertionError("a child of the prompt was never computed")
    assert not decoder.read


@pytest.mark.parametrize("through", ["NixlConnector", "MultiConnector"])
@pytest.mark.parametrize("n", [1, 4])
def test_a_lapsed_prompt_is_neither_notified_nor_heartbeated(clock, n, through):
    """Once the decoder computes a prompt whose lease (PR 41383) may have lapsed, it
    sends the producer no notification for it (no READ happened: a producer that
    released the prompt by lease logs "Potentially invalid KV blocks") and no
    heartbeat after the step that scheduled it; every request finishes. (A real
    pair through a MultiConnector, decoder stalled 22 s with a lease of 20 s.)"""
    scheduler, children = remote_prompt(n, max_tokens=6, through=through)
    decoder = PullDecoder(scheduler, children)
    clock.advance(VOUCHED + 1)
    scheduled_all = False
    for _ in range(8 + 3 * n):
        # Busy steps: a heartbeat is due every other one.
        clock.advance(STEP)
        renewing = decoder.step()
        assert not decoder.loading, "a READ of a prompt whose lease lapsed"
        assert not decoder.notified, (
            f"the producer notified for {sorted(decoder.notified)}, whose prompt the "
            "decoder computed after its lease may have lapsed"
        )
        assert not (scheduled_all and renewing), (
            f"a heartbeat renews {REMOTE_REQUEST_ID} after every request of it was "
            "scheduled to compute it"
        )
        scheduled_all = all(c.num_computed_tokens > 0 for c in children)
        if all(c.status == RequestStatus.FINISHED_LENGTH_CAPPED for c in children):
            break
    else:
        raise AssertionError("a request of the prompt did not finish")


@pytest.mark.parametrize("through", ["NixlConnector", "MultiConnector"])
def test_a_late_child_of_a_lapsed_prompt_notifies_nothing(clock, through):
    """Two children of a prompt queued past the bound (a stalled engine core; PR
    41383's lease may have lapsed) reach the scheduler apart: the first computes the
    prompt and finishes, the second then takes it from the prefix cache. Neither READs
    nor notifies the producer. (A real pair through a MultiConnector, decoder stalled
    22 s with a lease of 20 s: the second child's notification was logged as
    "Potentially invalid KV blocks".)"""
    scheduler, (first,) = remote_prompt(1, queued=VOUCHED + 1, through=through)
    decoder = PullDecoder(scheduler, [first])
    for _ in range(4):
        clock.advance(1)
        decoder.step()
    assert first.status == RequestStatus.FINISHED_LENGTH_CAPPED, first.status
    (second,) = remote_children(
        1,
        scheduler.cache_config.block_size,
        first.num_prompt_tokens,
        first_id=2,
        max_tokens=2,
    )
    second.arrival_time -= VOUCHED + 1
    scheduler.add_request(second)
    decoder.children.append(second)
    for _ in range(4):
        clock.advance(1)
        decoder.step()
    assert second.status == RequestStatus.FINISHED_LENGTH_CAPPED, second.status
    assert not decoder.read, f"READs of a prompt whose lease lapsed: {decoder.read}"
    assert not decoder.notified, (
        f"the producer notified for {sorted(decoder.notified)}, whose prompt the "
        "decoder computed after its lease may have lapsed"
    )


@pytest.mark.parametrize("through", ["NixlConnector", "MultiConnector"])
@pytest.mark.parametrize("n", [1, 4])
def test_a_request_that_leaves_unscheduled_after_the_lapse_notifies_nothing(
    clock, n, through
):
    """The decoder stalls past the bound with the children of a prompt queued (PR
    41383's lease may have lapsed), and their client leaves before any was
    scheduled: the decoder sends the producer nothing for them. Upstream notifies
    for each, as for any request that ends unscheduled, and a producer that released
    the prompt by lease logs "Potentially invalid KV blocks"."""
    scheduler, children = remote_prompt(n, through=through)
    decoder = PullDecoder(scheduler, children)
    clock.advance(VOUCHED + 1)
    leave(scheduler, children)
    for _ in range(3):
        clock.advance(1)
        decoder.step()
    assert not decoder.notified, (
        f"the producer notified for {sorted(decoder.notified)}, whose prompt's lease "
        "may have lapsed before they left unscheduled"
    )


def test_a_request_that_leaves_unscheduled_in_time_notifies_the_producer(clock):
    """Within the bound, a request that leaves unscheduled notifies the producer,
    as upstream does, so that it frees the prompt at once."""
    scheduler, children = remote_prompt(1)
    decoder = PullDecoder(scheduler, children)
    clock.advance(VOUCHED - 1)
    leave(scheduler, children)
    decoder.step()
    assert decoder.notified == {children[0].request_id}


def leave(scheduler, requests) -> None:
    """Their client left: the requests end aborted."""
    scheduler.finish_requests(
        [r.request_id for r in requests], RequestStatus.FINISHED_ABORTED
    )
