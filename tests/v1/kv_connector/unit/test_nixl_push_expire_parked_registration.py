# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: no decoder registration is parked past the decoder's timeout.

A push producer parks a registration that pairs with no finished request in
_pending_d_registrations, and removes it only when a request pairs with it: the
eviction of finished requests is keyed by the producer's request ids, the
registration by the decoder's. A decode leg that arrives after the producer
released the prompt by lease, or one with n > 1 for a prefill leg with n = 1,
leaves its registration there for good. When the client retries with the same
X-Request-Id, the producer's new request pairs with the oldest such registration
(the id less its random suffix matches), and the producer WRITEs into blocks the
decoder freed when it gave up on them (push_registration_timeout), while the
retry's own registration waits unserved.

These tests drive a producer and a decoder in one process, each with its
scheduler and a push worker whose NIXL agent is a stub on an in-process fabric
(notifications are delivered), and record the WRITEs the producer starts.
"""

import logging
import time
from typing import Any

import pytest

from vllm.v1.request import Request

from . import nixl_harness
from .nixl_harness import LEASE, Clock, Engine, FabricNixlAgent, prefilled, step_until

dist_world = nixl_harness.dist_world
make_engine = nixl_harness.make_engine

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

# The decoders' push_registration_timeout, which the producer has too (one
# kv_transfer_config for the deployment), shorter than the lease: the expiry
# tested is the registration's, not the prompt's.
TIMEOUT = LEASE / 10


class Clocks(Clock):
    """Both clocks the engines read, moved forward together: perf_counter (leases,
    the decoder's watchdog) and time (when a registration expires, which the
    decoder writes into it for the producer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(monkeypatch)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + self.offset)


class Pair:
    """A producer and a decoder, both with push_registration_timeout TIMEOUT; the
    producer's WRITEs are recorded as (producer request, decoder request)."""

    def __init__(self, make_engine, **producer_config: Any) -> None:
        config = {"push_registration_timeout": TIMEOUT}
        self.producer: Engine = make_engine(**config, **producer_config)
        self.decoder: Engine = make_engine(**config)
        self.decoder.knows(self.producer)
        self.producer.knows(self.decoder)
        self.writes: list[tuple[str, str]] = []
        worker: Any = self.producer.worker

        def start_write(request_id: str, blocks: Any, registration: dict) -> None:
            self.writes.append((request_id, registration["request_id"]))

        worker._do_start_push_kv = start_write

    def parked(self) -> dict[str, Any]:
        worker: Any = self.producer.worker
        return worker._pending_d_registrations

    def decode_leg(self, decoder_req_id: str) -> Request:
        """A decode leg naming the proxy's request id as the push proxy does: the
        decoder's id less the engine's prefix and suffixes (one prompt to the
        decoder's scheduler per proxy request)."""
        request = self.decoder.add_decode(decoder_req_id, self.producer)
        params = request.kv_transfer_params
        assert params is not None
        params["remote_request_id"] = decoder_req_id.split("_")[-1].rsplit("-", 2)[0]
        return request

    def register(self, decoder_req_id: str) -> Request:
        """A decode leg whose registration reaches the producer, which parks it
        (no finished request pairs with it)."""
        request = self.decode_leg(decoder_req_id)
        assert step_until(
            lambda: decoder_req_id in self.parked(), self.decoder, self.producer
        ), f"the producer did not park the registration of {decoder_req_id}"
        return request

    def send_registration(self, decoder_req_id: str) -> Request:
        """A decode leg whose registration is sent to the producer, which does not
        read it yet (an idle producer's writer sleeps until its next request)."""
        fabric = FabricNixlAgent.fabric
        request = self.decode_leg(decoder_req_id)
        assert step_until(
            lambda: bool(fabric.inboxes[self.producer.agent_name]), self.decoder
        ), f"the decoder sent no registration for {decoder_req_id}"
        return request

    def prefill(self, request_id: str) -> None:
        """A prefill leg the producer computes; its finished blocks reach the
        writer, which pairs them with a registration or keeps them."""
        prefilled(self.producer, [request_id])
        worker: Any = self.producer.worker
        assert step_until(
            lambda: (
                any(write[0] == request_id for write in self.writes)
                or request_id in worker._push_finished_blocks
            ),
            self.producer,
        ), f"the producer's writer never took the finished request {request_id}"


@pytest.mark.parametrize("read", ["at_once", "late"])
def test_a_retry_is_written_to_its_own_registration(make_engine, monkeypatch, read):
    """The decode leg of cmpl-retry-0 registered after its prompt was released
    (it is parked), the decoder gave up on it, the client left and retried: the
    retry's prompt is WRITTEN to the retry's registration, not to the stale one
    (stock pairs it with the stale one, the oldest, whose blocks the decoder
    freed). ``late``: the producer was idle when the stale registration came, so
    its writer read it only when the retry woke it, past the decoder's timeout
    (seen in a real pair: read 22 s after it was sent, timeout 20 s); the
    registration says when its decoder gives up on it, so the producer drops it
    however late it reads it."""
    clock = Clocks(monkeypatch)
    pair = Pair(make_engine)
    if read == "at_once":
        first = pair.register("cmpl-retry-0-bbbbbbbb")
    else:
        first = pair.send_registration("cmpl-retry-0-bbbbbbbb")
    clock.advance(TIMEOUT + 1)
    # The client gave up and retries with the same X-Request-Id.
    pair.decoder.abort(first)
    pair.register("cmpl-retry-0-dddddddd")
    pair.prefill("cmpl-retry-0-cccccccc")
    assert pair.writes == [("cmpl-retry-0-cccccccc", "cmpl-retry-0-dddddddd")], (
        "the retry's prompt was not WRITTEN to the retry's own registration"
    )
    assert "cmpl-retry-0-bbbbbbbb" not in pair.parked()


def test_an_expired_registration_is_never_written(make_engine, monkeypatch, caplog):
    """A registration parked past push_registration_timeout is dropped, with a
    warning: a later request with the same id less its suffix starts no WRITE
    into its blocks, and nothing of it stays parked (stock WRITEs into it)."""
    clock = Clocks(monkeypatch)
    pair = Pair(make_engine)
    pair.register("cmpl-late-0-bbbbbbbb")
    clock.advance(TIMEOUT + 1)
    with caplog.at_level(logging.WARNING):
        pair.prefill("cmpl-late-0-cccccccc")
    assert pair.writes == [], "a WRITE into the blocks of an expired registration"
    assert not pair.parked(), "the expired registration is still parked"
    assert "push_registration_timeout" in caplog.text


def test_an_idle_producer_drops_expired_registrations(make_engine, monkeypatch):
    """Registrations that never pair (decode legs that arrived after their
    prompts were released by lease) are dropped once expired when the next
    registration arrives, even if no request of the producer finishes meanwhile."""
    clock = Clocks(monkeypatch)
    pair = Pair(make_engine)
    pair.register("cmpl-lost-0-bbbbbbbb")
    pair.register("cmpl-gone-0-bbbbbbbb")
    clock.advance(TIMEOUT + 1)
    pair.register("cmpl-next-0-bbbbbbbb")
    assert set(pair.parked()) == {"cmpl-next-0-bbbbbbbb"}, (
        "registrations past their timeout are still parked"
    )


def test_a_registration_within_its_timeout_is_written(make_engine, monkeypatch):
    """A registration parked while the producer still prefills is WRITTEN to when
    the prompt finishes before the timeout, as upstream does."""
    clock = Clocks(monkeypatch)
    pair = Pair(make_engine)
    pair.register("cmpl-early-0-bbbbbbbb")
    clock.advance(TIMEOUT - 1)
    pair.prefill("cmpl-early-0-cccccccc")
    assert pair.writes == [("cmpl-early-0-cccccccc", "cmpl-early-0-bbbbbbbb")]


def test_expiry_off_keeps_registrations(make_engine, monkeypatch):
    """expire_push_registrations = false: a registration stays parked until a
    request pairs with it, however old, as upstream keeps it."""
    clock = Clocks(monkeypatch)
    pair = Pair(make_engine, expire_push_registrations=False)
    pair.register("cmpl-kept-0-bbbbbbbb")
    clock.advance(TIMEOUT + 1)
    pair.prefill("cmpl-kept-0-cccccccc")
    assert pair.writes == [("cmpl-kept-0-cccccccc", "cmpl-kept-0-bbbbbbbb")]
