# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a WRITE that fails must not end the producer's worker.

A push producer WRITEs a prompt's KV into the decoder's blocks and polls the
WRITE's handles in get_finished. When NIXL reports one failed (its decoder died,
its link dropped), the base worker's poll hands it to _handle_failed_transfer,
which queued the producer's request id as a failed *receive*; the next
get_finished reported it done receiving, found no receive for it and failed
``assert meta is not None``: the worker, and with it the engine, ended. Upstream
keeps a failed WRITE apart from v0.30.0 (it is not reported done either: the
lease releases the prompt); v0.24.0 .. v0.29.0 crash.

These tests drive a push producer's worker with a stub NIXL agent whose WRITE
handles report the state the test sets, under a controlled clock.
"""

import contextlib
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)

from . import nixl_harness
from .nixl_harness import StubNixlAgent, push_connector
from .utils import create_vllm_config

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

LEASE = 12
PROMPT = "cmpl-push-write-0-aaaaaaaa"

dist_world = nixl_harness.dist_world
# ``time.perf_counter`` as the worker sees it.
clock = nixl_harness.clock


class WriteStateAgent(StubNixlAgent):
    """A NIXL agent whose transfers all report ``state`` (in flight until a
    test sets it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.state = "PROC"
        self.released: list[Any] = []

    def check_xfer_state(self, handle: Any) -> str:
        return self.state

    def release_xfer_handle(self, handle: Any) -> None:
        self.released.append(handle)

    def get_xfer_telemetry(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(
            xferDuration=1, postDuration=1, totalBytes=1, descCount=1
        )


class Producer:
    """A push producer's worker holding one prompt under its lease, with a
    WRITE of it posted to a decoder."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        vllm_config = create_vllm_config(
            kv_connector="NixlPushConnector",
            kv_connector_extra_config={"kv_lease_duration": LEASE},
        )
        self.connector = push_connector(monkeypatch, vllm_config, WriteStateAgent)
        worker: Any = self.connector.connector_worker
        # The stub agent answers the few calls get_finished makes of the topology.
        worker.transfer_topo = object()
        self.worker = worker
        self.agent: Any = worker.nixl_wrapper
        self.released: set[str] = set()
        metadata = NixlConnectorMetadata()
        metadata.reqs_in_batch = {PROMPT}
        metadata.reqs_to_send = {PROMPT: time.perf_counter() + LEASE}
        worker.start_load_kv(metadata)
        # What the push writer keeps of a posted WRITE: its handle.
        with worker._sending_transfers_lock:
            worker._sending_transfers[PROMPT].append("write-handle")

    def step(self) -> None:
        finished = nixl_harness.connector_output(self.connector).finished_sending
        self.released |= finished or set()

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.connector.shutdown()


@pytest.fixture
def producer(dist_world, monkeypatch) -> Iterator[Producer]:
    made = Producer(monkeypatch)
    yield made
    made.shutdown()


def test_failed_write_keeps_the_worker(producer, clock):
    """The WRITE fails: the worker goes on stepping, releases the handle, and
    the prompt is released by its lease, not reported done before it."""
    producer.agent.state = "ERR"
    for _ in range(3):
        producer.step()
    assert producer.agent.released == ["write-handle"]
    assert PROMPT not in producer.released, (
        "a failed WRITE was reported as a completed push"
    )
    clock.advance(LEASE + 1)
    producer.step()
    assert producer.released == {PROMPT}


def test_completed_write_releases_the_prompt(producer):
    """A WRITE that completes releases the prompt at once, as before."""
    producer.step()
    assert not producer.released
    producer.agent.state = "DONE"
    producer.step()
    assert producer.released == {PROMPT}
