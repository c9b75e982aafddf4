# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL producer with KV leases (v0.22+): every lease that has run out is released,
also when a request registered before it is still held.

Reproduces vllm#58222 (fixed by PR 50789 in v0.31): up to v0.30 the lease expiry
takes ``_reqs_to_send`` in insertion order and stops at the first live lease, but
a heartbeat renews a lease in place, a READ in flight may hold a prompt longer
than its lease, and the decoder's cached blocks have a longer TTL than the
prefill leases; so a live request registered first kept every lease behind it
held, run out or not. The producer is driven through its own code paths: leases
registered by ``start_load_kv``, renewed by ``HB:`` notifications, released by
``get_finished`` / ``get_transfer_results`` (``nixl_harness.make_producer``:
fake NIXL agent and clock).
"""

import pytest

from . import nixl_harness

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

HEAD = "cmpl-head-0"
BEHIND = ("cmpl-behind-1", "cmpl-behind-2", "cmpl-behind-3")

dist_world = nixl_harness.dist_world
make_producer = nixl_harness.make_producer


def test_expired_leases_behind_a_renewed_one_are_released(make_producer):
    """A decoder keeps renewing the lease of the request registered first (it
    waits for a decode seat); the leases registered after it run out and are
    released in the step they ran out, while the renewed one stays held."""
    producer = make_producer()
    ttl = producer.lease_extension + 10
    producer.register(HEAD, ttl=ttl)
    producer.register(*BEHIND, ttl=ttl)
    producer.advance(ttl - 5)
    producer.heartbeat(HEAD)
    assert producer.finished_sending() == set()
    producer.advance(10)
    released = producer.finished_sending()
    assert released == set(BEHIND), (
        f"released {sorted(released) or 'nothing'} with the leases of "
        f"{sorted(BEHIND)} run out: they wait behind {HEAD}, which a heartbeat "
        f"renewed, as long as a decoder keeps renewing it"
    )
    assert producer.held() == {HEAD}
    producer.advance(producer.lease_extension)
    assert producer.finished_sending() == {HEAD}


def test_a_longer_ttl_ahead_does_not_stall_expiry(make_producer):
    """Leases of different lengths share the map (the decoder's cached blocks,
    decoder_kv_blocks_ttl, against prefill leases): a longer one registered first
    does not keep the shorter ones behind it."""
    producer = make_producer()
    short = producer.lease_extension + 10
    producer.register(HEAD, ttl=16 * short)
    producer.register(*BEHIND, ttl=short)
    producer.advance(short)
    assert producer.finished_sending() == set(BEHIND)
    assert producer.held() == {HEAD}


def test_a_read_hold_does_not_stall_later_expiries(make_producer):
    """A decoder marks its READ of the first request (``read-posted/``) and dies
    mid-READ: no notification and no heartbeat follow. The producer may hold that
    request up to read_hold_limit (120 s) for the READ, and the leases registered
    after it still run out and are released on time; at last the held one too."""
    producer = make_producer()
    ttl = producer.lease_extension + 10
    producer.register(HEAD, ttl=ttl)
    producer.register(*BEHIND, ttl=ttl)
    producer.advance(ttl - 5)
    producer.heartbeat(HEAD, f"read-posted/{HEAD}")
    assert producer.finished_sending() == set()
    for _ in range(3):
        producer.advance(5)
        producer.finished_sending()
    assert producer.held() == {HEAD}, (
        f"{sorted(producer.held() - {HEAD})} still held 10 s after their leases "
        f"ran out, behind {HEAD}, held for a READ whose decoder died"
    )
    producer.advance(120)
    assert producer.finished_sending() == {HEAD}
    assert producer.held() == set()
