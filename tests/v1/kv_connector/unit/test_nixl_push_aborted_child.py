# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a decode request that never registers releases the prompt.

A decode request aborted before it was scheduled (its client left while every
decode seat was busy, or the serving layer rejected it) never allocates blocks
and never registers them with the producer. request_finished on the decoder
stages an empty receive for it "so the worker emits a notif that lets P free
them", as the pull connector does since PR 41269, but the push worker (PR 35264)
sends nothing: it keeps the empty receive in _recving_metadata for good (the
leak PR 55677 describes), and the producer holds the prompt until its KV lease
runs out ("Releasing expired KV blocks ... retrieved by 0 remote worker(s)").
vllm#46283 is the same abort path's leak for a request that did register.

These tests drive a producer and a decoder in one process, each with its
scheduler and a push worker whose NIXL agent is a stub on an in-process fabric
(notifications are delivered, nothing is transferred), and the workers'
writer threads running.
"""

import time

import pytest

from . import nixl_harness
from .nixl_harness import LEASE, Clock, FabricNixlAgent, prefilled, step_until

# The distributed world is set up once for the module (dist_world).
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

dist_world = nixl_harness.dist_world
make_engine = nixl_harness.make_engine


@pytest.mark.parametrize("order", ["after_prefill", "before_prefill"])
def test_child_aborted_before_scheduled_releases_its_prompt(make_engine, order):
    """Parallel sampling, n=2: the producer holds both children of the prompt;
    the decoder's child 1 is aborted before it is scheduled. The producer frees
    child 1's blocks at once (not when its lease runs out) and keeps child 0's
    for the decoder child that may still register. The release may also reach
    the producer before its prefill ends (a request the decoder rejects at
    once); it is applied when the prefill ends."""
    producer = make_engine()
    decoder = make_engine()
    decoder.knows(producer)
    free_before = producer.free_blocks()
    child_ids = ["0_cmpl-pair-0-aaaaaaaa", "1_cmpl-pair-0-aaaaaaaa"]

    if order == "after_prefill":
        held = prefilled(producer, child_ids)
    aborted = decoder.add_decode("1_cmpl-pair-0-bbbbbbbb", producer)
    decoder.abort(aborted)
    decoder.step()
    if order == "before_prefill":
        # The producer reads the release while it has nothing to release yet.
        fabric = FabricNixlAgent.fabric
        assert step_until(
            lambda: (
                fabric.delivered.get(producer.agent_name, 0) > 0
                and not fabric.inboxes[producer.agent_name]
            ),
            producer,
        ), "the decoder sent the producer nothing for the aborted request"
        held = prefilled(producer, child_ids)
    child0, child1 = held

    assert step_until(lambda: not producer.holds(child1), producer, decoder), (
        "the producer still holds the aborted child's prompt (until its lease)"
    )
    assert producer.holds(child0), "the other child's prompt was released too"
    assert producer.free_blocks() < free_before
    assert FabricNixlAgent.fabric.writes == 0


def test_aborted_request_leaves_no_receive_behind(make_engine):
    """The empty receive staged for a request aborted before it was scheduled is
    not kept by the decoder's worker (nothing will ever be pushed for it), and
    it is not reported as a finished receive (the scheduler no longer has the
    request)."""
    producer = make_engine()
    decoder = make_engine()
    decoder.knows(producer)
    aborted = decoder.add_decode("0_cmpl-gone-0-bbbbbbbb", producer)
    decoder.abort(aborted)
    for _ in range(3):
        decoder.step()
    recving = decoder.worker._recving_metadata
    assert aborted.request_id not in recving, "the empty receive is kept for good"
    assert aborted.request_id not in decoder.scheduler.requests


@pytest.mark.parametrize("off", ["producer", "decoder"])
def test_release_off_on_either_side_keeps_the_lease(make_engine, off):
    """With the release off on one side (as against an engine without it), the
    producer neither crashes nor WRITEs: it holds the prompt until its lease, as
    before. A producer that does not know the release reads it as a heartbeat
    entry for a request it does not hold."""
    switch = {"release_unregistered_push_requests": False}
    producer = make_engine(**(switch if off == "producer" else {}))
    decoder = make_engine(**(switch if off == "decoder" else {}))
    decoder.knows(producer)
    (held,) = prefilled(producer, ["0_cmpl-off-0-aaaaaaaa"])
    aborted = decoder.add_decode("0_cmpl-off-0-bbbbbbbb", producer)
    decoder.abort(aborted)
    for _ in range(10):
        decoder.step()
        producer.step()
        time.sleep(0.02)
    assert producer.holds(held)
    assert FabricNixlAgent.fabric.writes == 0


@pytest.mark.parametrize("case", ["unpaired", "stale"])
def test_a_release_that_pairs_with_nothing_frees_nothing(
    make_engine, monkeypatch, case
):
    """A release frees only what the aborted request's registration would have
    been served from. ``unpaired``: the prompt of a prefill leg with n=1 pairs
    with no child of a decode leg with n>1 (their registrations never match
    either), so it stays held. ``stale``: a release that found no finished
    request is kept no longer than the producer's lease; a prompt with the same
    id that finishes after that is not released by it."""
    clock = Clock(monkeypatch)
    producer = make_engine()
    decoder = make_engine()
    decoder.knows(producer)
    prefix = "cmpl-alone-0" if case == "unpaired" else "0_cmpl-again-0"
    if case == "unpaired":
        (held,) = prefilled(producer, [f"{prefix}-aaaaaaaa"])
        aborted_id = f"0_{prefix}-bbbbbbbb"
    else:
        aborted_id = f"{prefix}-bbbbbbbb"
    aborted = decoder.add_decode(aborted_id, producer)
    decoder.abort(aborted)
    decoder.step()
    fabric = FabricNixlAgent.fabric
    step_until(
        lambda: (
            fabric.delivered.get(producer.agent_name, 0) > 0
            and not fabric.inboxes[producer.agent_name]
        ),
        producer,
    )
    if case == "stale":
        clock.advance(LEASE + 1)
        (held,) = prefilled(producer, [f"{prefix}-cccccccc"])
    for _ in range(10):
        producer.step()
        time.sleep(0.02)
    assert producer.holds(held)
    assert fabric.writes == 0
