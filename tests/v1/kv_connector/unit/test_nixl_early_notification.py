# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL producer: pull notifications that arrive before registration.

Reproduces the second bug of vllm PR 43509: a decoder's pull-complete
notification can reach the producer before ``start_load_kv`` registered the
request. ``_get_new_notifs`` dropped it as "unrecognized", so the request was
held until its expiry (480 s up to v0.21) or lease ran out; with several
decode workers per producer (heterogeneous TP) every notification can race
the registration. The notifications are now staged and settled when the
request registers to send; the staging is bounded.

Also what staging must not take in: a notification that repeats a completed
pull (a decoder that read a request more often than the producer counted) is
neither staged, where it would push out genuine early notifications, nor
logged as invalid KV; and from v0.32 an early notification is not counted
as a notification after expiry.
"""

import pytest

from . import nixl_harness
from .nixl_harness import TTL, messages, vllm_log

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


dist_world = nixl_harness.dist_world
make_producer = nixl_harness.make_producer


@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_notification_before_registration_settles_on_registration(
    make_producer, consumers
):
    producer = make_producer()
    with vllm_log() as records:
        producer.notify("req-a", consumers, times=consumers)
        assert producer.finished_sending() == set()
    producer.register("req-a", "req-b")
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == {"req-b"}
    assert not messages(records, "Potentially invalid KV blocks")
    assert producer.notifications_after_expiry() in (None, 0)


@pytest.mark.parametrize("consumers, early", [(2, 1), (4, 1), (4, 3)])
def test_early_notifications_keep_counting_after_registration(
    make_producer, consumers, early
):
    producer = make_producer()
    producer.notify("req-a", consumers, times=early)
    assert producer.finished_sending() == set()
    producer.register("req-a")
    assert producer.finished_sending() == set()
    producer.notify("req-a", consumers, times=consumers - early - 1)
    assert producer.finished_sending() == set()
    producer.notify("req-a", consumers)
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == set()


def test_early_notification_settles_once_the_request_finishes(make_producer):
    """Scheduled, not finished: the request is released when it finishes."""
    producer = make_producer()
    producer.notify("req-a", 2, times=2)
    assert producer.finished_sending() == set()
    producer.step(in_batch=["req-a"])
    assert producer.finished_sending() == set()
    producer.step(to_send=["req-a"])
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == set()


def test_early_notification_does_not_release_a_request_being_scheduled(
    make_producer,
):
    """Only a finished request (registered to send) may be reported released."""
    producer = make_producer()
    producer.notify("req-a")
    assert producer.finished_sending() == set()
    producer.step(in_batch=["req-a"])
    assert producer.finished_sending() == set()
    assert producer.held() == {"req-a"}


def test_aborted_request_with_early_notification_is_never_reported(make_producer):
    producer = make_producer()
    producer.notify("req-a")
    assert producer.finished_sending() == set()
    producer.step(in_batch=["req-a"])
    producer.step(not_processed=["req-a"])
    producer.advance(2 * TTL)
    assert producer.finished_sending() == set()
    assert producer.held() == set()


@pytest.mark.parametrize("early", [2, 4])
def test_early_notification_releases_the_best_of_siblings(make_producer, early):
    """The decoder's 4 children each read the last sibling; the reads of
    ``early`` of them race its registration. All siblings go once all 4 did."""
    producer = make_producer()
    children = [f"{i}_cmpl-fb4bc0e0" for i in range(4)]
    producer.notify(children[-1], times=early)
    assert producer.finished_sending() == set()
    producer.register(*children)
    if early < 4:
        assert producer.finished_sending() == set()
        assert producer.held() == set(children)
        producer.notify(children[-1], times=4 - early)
    assert producer.finished_sending() == set(children)
    assert producer.held() == set()


def test_repeated_notification_of_a_completed_pull_is_not_staged(make_producer):
    """A decoder that reads a request more often than the producer counted
    repeats a completed pull: not an error, and not staged, where it would
    push a genuine early notification out of a full staging FIFO."""
    producer = make_producer(early_notifications_limit=1)
    producer.register("req-a")
    producer.notify("req-a")
    assert producer.finished_sending() == {"req-a"}
    with vllm_log() as records:
        producer.notify("req-b")  # races its registration
        producer.notify("req-a")  # repeats the completed pull
        assert producer.finished_sending() == set()
    producer.register("req-b")
    assert producer.finished_sending() == {"req-b"}
    assert producer.held() == set()
    assert not messages(records, "Potentially invalid KV blocks")
    assert producer.notifications_after_expiry() in (None, 0)


def test_staging_is_bounded_and_evicted_requests_fall_back_to_expiry(make_producer):
    producer = make_producer(early_notifications_limit=4)
    requests = [f"req-{i}" for i in range(6)]
    for req_id in requests:
        producer.notify(req_id)
    assert producer.finished_sending() == set()
    producer.register(*requests)
    # The two oldest notifications were dropped to stay within the limit.
    assert producer.finished_sending() == set(requests[2:])
    assert producer.held() == set(requests[:2])
    producer.advance(2 * TTL)
    assert producer.finished_sending() == set(requests[:2])
    assert producer.held() == set()


def test_heartbeats_keep_working_next_to_staged_notifications(make_producer):
    """Leases still extend; a heartbeat naming a staged request changes nothing."""
    producer = make_producer()
    if not producer.has_heartbeats:
        pytest.skip("lease heartbeats exist from v0.22")
    ttl = producer.lease_extension + 10
    producer.notify("req-early", 2)
    assert producer.finished_sending() == set()
    producer.register("req-b", ttl=ttl)
    producer.register("req-a", ttl=ttl)
    producer.advance(ttl - 5)
    producer.heartbeat("req-a", "req-early")
    producer.advance(10)
    assert producer.finished_sending() == {"req-b"}
    assert producer.held() == {"req-a"}
    producer.advance(producer.lease_extension)
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == set()


def test_notification_after_expiry_never_counts_for_a_reused_id(make_producer):
    """A notification that comes after its request expired is late, however many
    requests registered since: it is not staged, so it cannot count toward a
    later request with the same id (client-chosen ids reach the engine unchanged
    when request id randomization is off) and release that one's KV unread."""
    producer = make_producer()
    producer.register("req-a")
    producer.advance(2 * TTL)
    assert producer.finished_sending() == {"req-a"}
    for i in range(300):  # busy: more registering steps than any recent window
        producer.register(f"busy-{i}")
        producer.notify(f"busy-{i}")
        assert producer.finished_sending() == {f"busy-{i}"}
    producer.notify("req-a")
    assert producer.finished_sending() == set()
    producer.register("req-a")
    assert producer.finished_sending() == set()
    assert producer.held() == {"req-a"}
