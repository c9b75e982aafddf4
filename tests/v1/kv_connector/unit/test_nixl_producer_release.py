# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NIXL producer (prefill) release path, driven through its real methods.

The behaviour that the fixes of vllm PR 43509 (best_of sibling fan-out, early
notifications) must keep: a request is released once all its consumers
notified, at its expiry or lease end otherwise, and never when it was aborted.
The producer (``nixl_harness.make_producer``: a fake NIXL agent whose only
behaviour is a notification queue, and a fake clock) is only driven through
``start_load_kv`` (registration), the agent's notifications and
``get_finished``/``get_transfer_results`` (release), so the tests hold for the
stock and the patched worker, on every NIXL layout.
"""

import pytest

from . import nixl_harness
from .nixl_harness import TTL, messages, vllm_log

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

dist_world = nixl_harness.dist_world
make_producer = nixl_harness.make_producer


# ---------------------------------------------------------------------------
# Behaviour the fixes keep.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_released_once_every_consumer_notified(make_producer, consumers):
    """Heterogeneous TP: P waits for all of its decode readers (1, 2 or 4)."""
    producer = make_producer()
    producer.register("req-a", "req-b")
    producer.notify("req-a", consumers, times=consumers - 1)
    assert producer.finished_sending() == set()
    producer.notify("req-a", consumers)
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == {"req-b"}


def test_notification_before_finish_releases_a_scheduled_request(make_producer):
    """Async scheduling: the pull can complete before ``reqs_to_send`` arrives."""
    producer = make_producer()
    producer.step(in_batch=["req-a"])
    producer.notify("req-a")
    assert producer.finished_sending() == {"req-a"}
    producer.step(to_send=["req-a"])
    assert producer.finished_sending() == set()
    assert producer.held() == set()


def test_unpulled_request_is_released_when_it_expires(make_producer):
    producer = make_producer()
    producer.register("req-a")
    producer.advance(TTL / 2)
    assert producer.finished_sending() == set()
    producer.advance(TTL)
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == set()


def test_aborted_request_is_never_reported(make_producer):
    producer = make_producer()
    producer.step(in_batch=["req-a", "req-b"])
    producer.step(not_processed=["req-a"], to_send=["req-b"])
    producer.advance(2 * TTL)
    assert producer.finished_sending() == {"req-b"}
    assert producer.held() == set()


def test_late_notification_is_dropped(make_producer):
    """A notification for an expired request releases nothing (again); it is
    logged as possibly invalid KV and, from v0.32, counted after expiry."""
    producer = make_producer()
    producer.register("req-a")
    producer.advance(2 * TTL)
    assert producer.finished_sending() == {"req-a"}
    with vllm_log() as records:
        producer.notify("req-a")
        producer.register("req-b")
        producer.notify("req-b")
        assert producer.finished_sending() == {"req-b"}
    assert producer.held() == set()
    assert messages(records, "Potentially invalid KV blocks")
    assert producer.notifications_after_expiry() in (None, 1)


def test_heartbeat_extends_the_lease(make_producer):
    producer = make_producer()
    if not producer.has_heartbeats:
        pytest.skip("lease heartbeats exist from v0.22")
    ttl = producer.lease_extension + 10
    # Up to v0.30 reaping stops at the first live lease in registration order.
    producer.register("req-b", ttl=ttl)
    producer.register("req-a", ttl=ttl)
    producer.advance(ttl - 5)
    producer.heartbeat("req-a")
    producer.advance(10)
    assert producer.finished_sending() == {"req-b"}
    assert producer.held() == {"req-a"}
    producer.advance(producer.lease_extension)
    assert producer.finished_sending() == {"req-a"}
