# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: the decoder's heartbeats renew the producer's KV lease
(vllm#53095).

A decoder renews the producer's lease of a prompt it still waits for by
heartbeats naming the remote request id of its decode leg. In push mode both
legs leave the proxy at once, so that id is the proxy's X-Request-Id
("push-wait"), while the producer holds the prompt under its own engine ids
("0_cmpl-push-wait-0-b46e20fe", "1_..." for n = 2): no heartbeat matched, and
the producer released the prompt when its first lease ran out while the decoder,
waiting for a seat, still heartbeated it. The registration that followed was
never served.

These tests drive a push decoder's scheduler (its requests wait for KV space,
so they heartbeat without being scheduled) and a push producer's worker with a
stub NIXL agent, and carry each heartbeat the decoder's step packages to the
producer as the decoder's worker sends it ("HB:id,id,..."), under a controlled
clock (``time.perf_counter`` moved forward).
"""

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from vllm.v1.request import Request, RequestStatus

from . import nixl_harness
from .nixl_harness import Clock, push_connector, push_decode_leg
from .utils import create_model_runner_output, create_scheduler, create_vllm_config

# The distributed world is set up once for the module (dist_world).
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

# kv_lease_duration, in seconds: heartbeats every LEASE // 6 s, each renewing
# the lease for LEASE * 2 // 3 s from when the producer handles it.
LEASE = 12
NUM_TOKENS = 100
# Too few blocks for one prompt: the decoder's requests wait for KV space.
DECODER_BLOCKS = 5
PRODUCER_ENGINE = "producer-engine"
X_REQUEST_ID = "push-wait"

dist_world = nixl_harness.dist_world
# ``time.perf_counter`` as both engines see it.
clock = nixl_harness.clock


def push_config(renew: bool | None) -> Any:
    extra: dict[str, Any] = {"kv_lease_duration": LEASE}
    if renew is not None:
        extra["renew_push_leases"] = renew
    return create_vllm_config(
        kv_connector="NixlPushConnector", kv_connector_extra_config=extra
    )


class Producer:
    """A push producer's worker, holding prompts under its lease."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, renew: bool | None) -> None:
        self.connector = push_connector(monkeypatch, push_config(renew))
        self.worker = self.connector.connector_worker
        self.released: set[str] = set()

    def hold(self, req_ids: list[str]) -> None:
        """The prompt's requests finished their prefill: the scheduler's lease."""
        metadata = NixlConnectorMetadata()
        metadata.reqs_in_batch = set(req_ids)
        metadata.reqs_to_send = {r: time.perf_counter() + LEASE for r in req_ids}
        self.worker.start_load_kv(metadata)  # type: ignore[arg-type]

    def held(self) -> set[str]:
        return set(self.worker._reqs_to_send)

    def receive(self, notif: bytes) -> None:
        """A notification the push writer forwards to the engine thread."""
        self.worker._pending_completion_notifs.put(notif)  # type: ignore[attr-defined]

    def step(self) -> None:
        """The producer's step: notifications, heartbeats, expired leases."""
        finished = nixl_harness.connector_output(self.connector).finished_sending
        self.released |= finished or set()

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.connector.shutdown()


class Decoder:
    """A push decoder's scheduler whose requests wait for KV space."""

    def __init__(self, renew: bool | None) -> None:
        vllm_config = push_config(renew)
        self.block_size = vllm_config.cache_config.block_size
        self.scheduler = create_scheduler(vllm_config, num_blocks=DECODER_BLOCKS)

    def add(self, req_id: str, x_request_id: str = X_REQUEST_ID) -> Request:
        """A decode leg as a push proxy sends it: the producer's coordinates and
        the X-Request-Id as the remote request id, no remote block ids."""
        remote = {
            "remote_engine_id": PRODUCER_ENGINE,
            "remote_request_id": x_request_id,
            "remote_port": 5600,
        }
        request = push_decode_leg(self.block_size, NUM_TOKENS, req_id, remote)
        self.scheduler.add_request(request)
        return request

    def step(self) -> list[bytes]:
        """One engine step; the heartbeats its worker sends to the producer."""
        output = self.scheduler.schedule()
        assert not output.num_scheduled_tokens, "the decoder had room after all"
        metadata = output.kv_connector_metadata
        assert isinstance(metadata, NixlConnectorMetadata)
        self.scheduler.update_from_output(output, create_model_runner_output([]))
        return [
            ("HB:" + ",".join(info.req_ids)).encode()
            for engine_id, info in metadata.heartbeat_by_engine.items()
            if engine_id == PRODUCER_ENGINE
        ]


@pytest.fixture
def make_pair(dist_world, monkeypatch) -> Iterator[Any]:
    """Yield ``make(renew) -> (Producer, Decoder)``; renew None: the default."""
    producers: list[Producer] = []

    def make(renew: bool | None = None) -> tuple[Producer, Decoder]:
        producers.append(Producer(monkeypatch, renew))
        return producers[-1], Decoder(renew)

    yield make
    for producer in producers:
        producer.shutdown()


def engine_ids(n: int, suffix: str) -> list[str]:
    """The engine request ids of one prompt of the push proxy's request: the
    serving layer's ``cmpl-<X-Request-Id>-0`` with the engine's random suffix,
    and for n > 1 the parallel-sampling children ``<i>_<that>``."""
    parent = f"cmpl-{X_REQUEST_ID}-0-{suffix}"
    return [parent] if n == 1 else [f"{i}_{parent}" for i in range(n)]


def run(producer: Producer, decoder: Decoder, clock: Clock, s: int) -> int:
    """Step both engines once a second for s seconds, carrying the decoder's
    heartbeats to the producer; returns how many were carried."""
    carried = 0
    for _ in range(s):
        clock.advance(1)
        for heartbeat in decoder.step():
            producer.receive(heartbeat)
            carried += 1
        producer.step()
    return carried


@pytest.mark.parametrize("n", [1, 2])
def test_heartbeats_keep_a_waiting_prompt_held(make_pair, clock, n):
    """While the decoder's requests of a prompt wait (here for KV space, as
    behind a busy request), their heartbeats keep the producer's lease of the
    prompt; once the decoder lets them go, the lease runs out."""
    producer, decoder = make_pair()
    producer_ids = engine_ids(n, "b46e20fe")
    producer.hold(producer_ids)
    requests = [decoder.add(r) for r in engine_ids(n, "0badcafe")]

    carried = run(producer, decoder, clock, 3 * LEASE)
    assert carried >= 3 * LEASE // (LEASE // 6) - 1, "the decoder did not heartbeat"
    assert all(r.status == RequestStatus.WAITING for r in requests)
    assert not producer.released, (
        f"released by lease while the decoder heartbeated: {producer.released}"
    )
    assert producer.held() == set(producer_ids)

    # Nobody waits for the prompt any more: the heartbeats stop, the lease ends.
    decoder.scheduler.finish_requests(
        [r.request_id for r in requests], RequestStatus.FINISHED_ABORTED
    )
    run(producer, decoder, clock, LEASE)
    assert producer.released == set(producer_ids)
    assert not producer.held()


def test_decoder_heartbeats_its_own_request_ids(make_pair, clock):
    """Each waiting request's own id is in its producer's heartbeat, beside the
    remote request id upstream sends, until the request stops heartbeating."""
    _, decoder = make_pair()
    first, second = (decoder.add(r) for r in engine_ids(2, "0badcafe"))
    clock.advance(LEASE)
    (heartbeat,) = decoder.step()
    assert set(heartbeat.decode()[3:].split(",")) == {
        X_REQUEST_ID,
        first.request_id,
        second.request_id,
    }

    # Another prompt: the children of one share its remote request id, and whether
    # that stays heartbeated once one child finished is not this fix's business.
    other = decoder.add("cmpl-push-other-0-0badcafe", "push-other")
    decoder.scheduler.finish_requests(
        [first.request_id, second.request_id], RequestStatus.FINISHED_ABORTED
    )
    clock.advance(LEASE)
    (heartbeat,) = decoder.step()
    assert set(heartbeat.decode()[3:].split(",")) == {"push-other", other.request_id}


# Producer ids of several prompts, and decoder ids, by shape: children of n = 2,
# n = 1, a second prompt of one request (index 1).
HELD = [
    "0_cmpl-a-0-11111111",
    "1_cmpl-a-0-11111111",
    "cmpl-b-0-22222222",
    "cmpl-c-1-33333333",
]
HEARTBEATED = [
    "0_cmpl-a-0-aaaaaaaa",  # child 0 of the prompt with n = 2
    "1_cmpl-a-0-aaaaaaaa",
    "2_cmpl-a-0-aaaaaaaa",  # decode leg n = 3, prefill leg n = 2: no child 2
    "0_cmpl-b-0-bbbbbbbb",  # decode leg n = 2, prefill leg n = 1
    "cmpl-b-0-22222222",  # the producer's own id (as in pull mode)
    "cmpl-c-0-cccccccc",  # another prompt of the same request
    "cmpl-c-1-cccccccc",
    X_REQUEST_ID,
]


@pytest.mark.parametrize("heartbeated", HEARTBEATED)
def test_heartbeat_renews_what_a_registration_is_paired_with(
    make_pair, clock, heartbeated
):
    """A heartbeat id renews exactly the held request that a registration with
    that id would be served from (the producer's own pairing of registrations
    with finished requests): heartbeat and registration never disagree."""
    producer, _ = make_pair()
    producer.hold(HELD)
    worker: Any = producer.worker
    worker._push_finished_blocks = {r: ([1],) for r in HELD}
    paired = worker._pop_matching_finished_blocks(heartbeated)
    before = dict(worker._reqs_to_send)

    # Half the lease on: a renewal (LEASE * 2 // 3 from now) outlasts the lease.
    clock.advance(LEASE // 2)
    producer.receive(f"HB:{heartbeated}".encode())
    producer.step()
    renewed = {r for r, expiry in worker._reqs_to_send.items() if expiry > before[r]}
    assert renewed == ({paired[0]} if paired else set())


def test_switched_off_heartbeats_are_upstreams(make_pair, clock):
    """renew_push_leases = false: the decoder heartbeats the remote request id
    only, and the producer renews exact ids only, as upstream does."""
    producer, decoder = make_pair(renew=False)
    producer_ids = engine_ids(2, "b46e20fe")
    producer.hold(producer_ids)
    for req_id in engine_ids(2, "0badcafe"):
        decoder.add(req_id)
    clock.advance(1)
    assert decoder.step() == [f"HB:{X_REQUEST_ID}".encode()]

    run(producer, decoder, clock, 2 * LEASE)
    assert producer.released == set(producer_ids)
