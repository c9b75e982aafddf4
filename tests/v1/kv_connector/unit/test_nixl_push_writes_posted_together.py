# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a request is done sending only once its last WRITE is.

A push producer WRITEs a prompt into each decoder rank its blocks map to: two
WRITEs for a decoder of twice its TP size. Its writer thread posted them one at a
time, each handed to the engine thread's poll (get_finished) as it was posted. A
poll between two posts, the first WRITE complete, left the request with no WRITE
in flight: it was reported done sending and the producer freed the prompt's
blocks while the next WRITE was still to read them. Upstream hands a request's
WRITEs to the poll together from v0.26.0 (PR 45880).

These tests drive the release's push producer worker on upstream's fake NIXL
agent (its WRITEs complete at once) after upstream's fake handshake with a
decoder of TP 2, and run the engine thread's poll between the two posts.
"""

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)

from . import nixl_harness
from .test_nixl_connector import FakeNixlWrapper

# The distributed world is set up once for the module (dist_world).
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

dist_world = nixl_harness.dist_world

PROMPT = "cmpl-prefill-0"
LEASE = 30


def poll(worker: Any) -> set[str]:
    """The engine thread's poll, run in a thread of its own as in an engine: the
    requests it reports done sending."""
    done: list[set[str]] = []
    thread = threading.Thread(
        target=lambda: done.append(nixl_harness.transfer_results(worker)[0])
    )
    thread.start()
    thread.join(timeout=60)
    assert done, "the engine thread's poll waited on the writer's posts"
    return done[0]


class PollBetweenWrites(FakeNixlWrapper):
    """Upstream's fake NIXL agent, running the engine thread's poll before it
    prepares each WRITE after the first, and keeping what each poll reported."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker: Any = None
        self.writes = 0
        self.done_between_writes: list[set[str]] = []

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> int:
        if self.writes:
            self.done_between_writes.append(poll(self.worker))
        self.writes += 1
        return super().make_prepped_xfer(*args, **kwargs)


def make_producer(monkeypatch: pytest.MonkeyPatch, decoder_tp_size: int) -> Any:
    """A push producer's worker, handshaken with a decoder of ``decoder_tp_size``."""
    return nixl_harness.push_producer_handshaken(
        monkeypatch, PollBetweenWrites, decoder_tp_size
    )


@pytest.fixture
def producer(dist_world, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A push producer facing a decoder of TP 2: two WRITEs per request."""
    with make_producer(monkeypatch, decoder_tp_size=2) as worker:
        worker.nixl_wrapper.worker = worker
        yield worker


def push(worker: Any, decoder_tp_size: int) -> None:
    """Hold a finished prompt of three blocks under its lease, and pair it with a
    decoder's registration."""
    metadata = NixlConnectorMetadata()
    metadata.reqs_in_batch = {PROMPT}
    metadata.reqs_to_send = {PROMPT: time.perf_counter() + LEASE}
    worker.start_load_kv(metadata)
    registration = nixl_harness.push_registration(worker, [50, 51, 52], decoder_tp_size)
    worker._do_start_push_kv(PROMPT, ([10, 11, 12],), registration)


def test_a_poll_between_two_writes_does_not_report_the_request(producer):
    """The first WRITE completed when the engine thread polls before the second
    is posted: the request is not done sending. Stock before v0.26.0 reports it."""
    push(producer, decoder_tp_size=2)
    agent = producer.nixl_wrapper
    assert agent.writes == 2, "a decoder of TP 2 gets one WRITE per rank"
    assert agent.done_between_writes == [set()], (
        "a request was reported done sending before its last WRITE was posted"
    )


def test_the_request_is_reported_once_after_its_last_write(producer):
    """Held back between the writes, the request is reported by the next poll,
    and by no other. Stock before v0.26.0 reports it twice: between the writes
    and again once the second completes."""
    push(producer, decoder_tp_size=2)
    between = producer.nixl_wrapper.done_between_writes
    assert [*between, poll(producer), poll(producer)] == [set(), {PROMPT}, set()]


def test_a_single_write_is_reported_at_the_first_poll(dist_world, monkeypatch):
    """A decoder of the producer's TP size gets one WRITE, done at the next poll."""
    with make_producer(monkeypatch, decoder_tp_size=1) as worker:
        worker.nixl_wrapper.worker = worker
        push(worker, decoder_tp_size=1)
        assert worker.nixl_wrapper.writes == 1
        assert poll(worker) == {PROMPT}
