# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a decoder request whose push never comes ends (vllm#46283).

In push mode the decoder registers the blocks it allocated with the producer and
waits in WAITING_FOR_REMOTE_KVS for the producer's WRITE. A registration the
producer never serves (it reached the producer after the prompt was released by
lease, or it matches no producer request: a prefill leg with n=1 and a decode leg
with n>1) left the request waiting: the registration watchdog only logged and
dropped the registration, and a client that gave up then aborted a request whose
blocks the scheduler holds until a receive completion that never comes
(vllm#46283): the decoder's KV cache leaks.

These tests drive a decoder, the scheduler with the push connector's scheduler
side and a push worker with a stub NIXL agent, step by step under a controlled
clock (``time.perf_counter`` moved forward), with no producer: nothing is ever
pushed, as when the producer released the prompt.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from vllm.v1.request import Request, RequestStatus

from . import nixl_harness
from .nixl_harness import Clock, engine_step, push_connector, push_decode_leg
from .utils import create_scheduler, create_vllm_config

# The distributed world is set up once for the module (dist_world).
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

# The registration watchdog's timeout (push_registration_timeout), in seconds.
TIMEOUT = 20
NUM_BLOCKS = 64
NUM_TOKENS = 100

dist_world = nixl_harness.dist_world


@pytest.fixture
def make_decoder(dist_world, monkeypatch) -> Iterator[Any]:
    """Yield ``make(policy) -> Decoder``; its connectors shut down after the test."""
    decoders: list[Decoder] = []

    def make(policy: str) -> Decoder:
        decoders.append(Decoder(policy, monkeypatch))
        return decoders[-1]

    yield make
    for decoder in decoders:
        with contextlib.suppress(Exception):
            decoder.connector.shutdown()


class Decoder:
    """A push decoder with no producer (its NIXL agent receives nothing): its
    scheduler, one push worker, and the steps between."""

    def __init__(self, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clock = Clock(monkeypatch)
        vllm_config = create_vllm_config(
            kv_connector="NixlPushConnector",
            kv_connector_extra_config={"push_registration_timeout": TIMEOUT},
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
        )
        self.block_size = vllm_config.cache_config.block_size
        self.scheduler = create_scheduler(vllm_config, num_blocks=NUM_BLOCKS)
        self.connector = push_connector(monkeypatch, vllm_config)
        worker = self.connector.connector_worker
        # No producer: heartbeats would start a handshake with it.
        monkeypatch.setattr(worker, "_send_heartbeats", lambda metadata: None)
        self.worker = worker
        self.registered: set[str] = set()
        self.outputs: dict[str, list[Any]] = {}

    def add(self, request_id: int) -> Request:
        """A decode leg as a push proxy sends it."""
        request = push_decode_leg(self.block_size, NUM_TOKENS, request_id=request_id)
        self.scheduler.add_request(request)
        return request

    def step(self) -> dict[str, int]:
        """One engine step; returns the tokens scheduled per request."""
        scheduler_output, engine_outputs = engine_step(
            self.scheduler, self.connector, load_errors=True
        )
        metadata = scheduler_output.kv_connector_metadata
        self.registered.update(getattr(metadata, "push_registrations", {}))
        for client_outputs in engine_outputs.values():
            for output in client_outputs.outputs:
                self.outputs.setdefault(output.request_id, []).append(output)
        return dict(scheduler_output.num_scheduled_tokens)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def waiting_for_push(decoder: Decoder, request: Request) -> None:
    """The request allocated its blocks, registered them and waits."""
    decoder.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.request_id in decoder.registered, "no registration was sent"


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_unserved_registration_fails_the_receive(make_decoder, policy):
    """The watchdog gives up on a registration no producer serves: the request
    leaves WAITING_FOR_REMOTE_KVS as a failed KV load, which
    kv_load_failure_policy decides: "fail" ends it with an error and frees its
    blocks, "recompute" computes its prompt on the decoder."""
    decoder = make_decoder(policy)
    free_before = decoder.free_blocks()
    request = decoder.add(1)
    waiting_for_push(decoder, request)
    assert decoder.free_blocks() < free_before

    decoder.clock.advance(TIMEOUT - 1)
    decoder.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    decoder.clock.advance(2)
    computed_here = 0
    for _ in range(4):
        computed_here += decoder.step().get(request.request_id, 0)
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR, (
            f"still {request.status.name} after the registration timed out"
        )
        (final,) = decoder.outputs[request.request_id]
        assert final.finish_reason is not None
        assert request.request_id not in decoder.scheduler.requests
        assert decoder.free_blocks() == free_before
    else:
        assert request.status == RequestStatus.RUNNING, (
            f"still {request.status.name} after the registration timed out"
        )
        # The whole prompt was computed here: nothing of it came from the push.
        assert computed_here >= NUM_TOKENS


def test_request_aborted_while_unserved_frees_its_blocks(make_decoder):
    """A client that gives up aborts a request whose push never came: the
    scheduler holds its blocks until the receive ends, and the watchdog ends it,
    so the blocks are freed at the registration's deadline (vllm#46283)."""
    decoder = make_decoder("fail")
    free_before = decoder.free_blocks()
    request = decoder.add(1)
    waiting_for_push(decoder, request)

    decoder.scheduler.finish_requests(
        request.request_id, RequestStatus.FINISHED_ABORTED
    )
    decoder.step()
    assert decoder.free_blocks() < free_before  # held for the receive

    decoder.clock.advance(TIMEOUT + 1)
    for _ in range(3):
        decoder.step()
    assert decoder.free_blocks() == free_before, "the aborted request's blocks leak"
    assert request.request_id not in decoder.scheduler.requests


def test_served_registration_is_not_failed(make_decoder):
    """A push that completes before the deadline is the request's KV: the
    request runs on it, and the deadline passing later changes nothing."""
    decoder = make_decoder("fail")
    request = decoder.add(1)
    waiting_for_push(decoder, request)

    # The producer's WRITE notification names the decoder request.
    decoder.worker._pending_completion_notifs.put(  # type: ignore[attr-defined]
        f"{request.request_id}:1".encode()
    )
    decoder.step()
    scheduled = decoder.step()
    assert request.status == RequestStatus.RUNNING
    # Only the last prompt token is computed here; the rest was pushed.
    assert scheduled[request.request_id] < NUM_TOKENS

    decoder.clock.advance(TIMEOUT + 1)
    for _ in range(3):
        decoder.step()
    # Still decoding on the pushed KV, or done: never failed.
    assert request.status in (
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_LENGTH_CAPPED,
    )
    assert not decoder.outputs.get(request.request_id) or all(
        o.finish_reason is None or o.finish_reason.name != "ERROR"
        for o in decoder.outputs[request.request_id]
    )
