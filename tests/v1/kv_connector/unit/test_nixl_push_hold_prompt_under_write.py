# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: no lease runs out under a WRITE in flight from the prompt.

A push producer holds a prompt's blocks under a KV lease until its WRITE to the
decoder completes, but the lease's expiry does not look at the WRITE: a request
whose lease runs out is reported done sending with its WRITE still posted
("Expired requests were already reported, even if their WRITEs finish later";
PR 58188 leaves this "lease-expiry behavior while DMA remains active" out). The
scheduler frees the blocks and the next prefill overwrites them while the WRITE,
which cannot be aborted, sends them to the decoder.

These tests drive a producer and a decoder in one process, each with its
scheduler and a push worker whose NIXL agent is a stub on an in-process fabric
(notifications are delivered). The decoder registers; the producer's writer
pairs the registration with the prompt and posts the WRITE, which here records a
transfer handle whose state the test sets, as NIXL reports it.
"""

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from . import nixl_harness
from .nixl_harness import LEASE, Clock, Engine, prefilled, step_until

dist_world = nixl_harness.dist_world
make_engine = nixl_harness.make_engine

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

# The limit of the stalled-WRITE test: past the lease (a hold runs from when the WRITE
# is first seen in flight, and never shortens a lease).
LIMIT = 2 * LEASE


class WritePair:
    """A producer holding one prompt and a decoder whose request for it registered,
    so that the producer posted a WRITE from the prompt's blocks; the WRITE's
    state is ``state`` ("PROC" in flight, "DONE", "ERR") until the test changes it."""

    def __init__(self, make_engine, **producer_config: Any) -> None:
        self.producer: Engine = make_engine(**producer_config)
        self.decoder: Engine = make_engine()
        self.decoder.knows(self.producer)
        self.producer.knows(self.decoder)
        self.state = "PROC"
        worker: Any = self.producer.worker
        agent: Any = worker.nixl_wrapper
        agent.check_xfer_state = lambda handle: self.state
        agent.get_xfer_telemetry = lambda handle: SimpleNamespace(
            xferDuration=1, postDuration=1, totalBytes=1, descCount=1
        )
        self.posted: list[str] = []

        def post_write(request_id: str, blocks: Any, registration: dict) -> None:
            # What _xfer_blocks_for_req keeps of a posted WRITE: its handle.
            with worker._sending_transfers_lock:
                worker._sending_transfers[request_id].append(f"write-{request_id}")
            self.posted.append(request_id)

        worker._do_start_push_kv = post_write
        (self.held,) = prefilled(self.producer, ["cmpl-write-0-aaaaaaaa"])
        self.decoder.add_decode("cmpl-write-0-bbbbbbbb", self.producer)
        assert step_until(lambda: bool(self.posted), self.decoder, self.producer), (
            "the producer posted no WRITE for the decoder's registration"
        )
        assert self.posted == [self.held.request_id]

    def producer_steps(self, steps: int = 5) -> None:
        for _ in range(steps):
            self.producer.step()


@pytest.mark.parametrize("end", ["done", "failed"])
def test_no_lease_runs_out_under_a_write(make_engine, monkeypatch, end):
    """The prompt's lease runs out while its WRITE is in flight: the producer keeps
    the blocks (stock releases them: "Releasing expired KV blocks ... retrieved by
    0 remote worker(s)", and the next prefill may take them). When the WRITE is
    reported done, or failed, the producer releases them at once."""
    clock = Clock(monkeypatch)
    # A hold ends write_hold_limit seconds after the WRITE is first seen in flight,
    # which the producer's writer thread may post before or after a producer step:
    # a limit past the advance holds either way.
    pair = WritePair(make_engine, write_hold_limit=LIMIT)
    pair.producer_steps()
    clock.advance(LEASE + 1)
    pair.producer_steps()
    assert pair.producer.holds(pair.held), (
        "the lease released the prompt with its WRITE in flight"
    )
    pair.state = "DONE" if end == "done" else "ERR"
    assert step_until(lambda: not pair.producer.holds(pair.held), pair.producer), (
        f"the prompt is still held after its WRITE was reported {end}"
    )


def test_a_stalled_write_is_held_to_the_limit(make_engine, monkeypatch, caplog):
    """A WRITE NIXL never reports done or failed holds the prompt past its lease for
    write_hold_limit seconds from when it was first seen in flight, not for good:
    then the prompt is released by its lease, with a warning."""
    clock = Clock(monkeypatch)
    pair = WritePair(make_engine, write_hold_limit=LIMIT)
    pair.producer_steps()
    clock.advance(LEASE + 1)
    pair.producer_steps()
    assert pair.producer.holds(pair.held), (
        "the lease released the prompt with its WRITE in flight"
    )
    clock.advance(LIMIT)
    with caplog.at_level(logging.WARNING):
        pair.producer_steps()
    assert not pair.producer.holds(pair.held), "a stalled WRITE held the prompt"
    assert "write_hold_limit" in caplog.text


@pytest.mark.parametrize("renewed", [False, True])
def test_the_hold_gives_the_lease_back(make_engine, renewed):
    """When the WRITE fails, the prompt gets back the lease it had, or the one a
    heartbeat renewed it to during the hold (a hold never shortens a lease)."""
    pair = WritePair(make_engine, write_hold_limit=10 * LEASE)
    worker: Any = pair.producer.worker
    request_id = pair.held.request_id
    lease = worker._reqs_to_send[request_id]
    pair.producer_steps()
    assert worker._reqs_to_send[request_id] > lease + 5 * LEASE, "no hold"
    if renewed:
        # What _handle_heartbeat does: the later of the two.
        lease = worker._reqs_to_send[request_id] + 1
        worker._reqs_to_send[request_id] = lease
    pair.state = "ERR"
    pair.producer_steps()
    assert pair.producer.holds(pair.held)
    assert worker._reqs_to_send[request_id] == lease


def test_hold_off_is_the_lease(make_engine, monkeypatch):
    """write_hold_limit = 0: the lease releases the prompt with its WRITE in flight,
    as upstream does."""
    clock = Clock(monkeypatch)
    pair = WritePair(make_engine, write_hold_limit=0)
    clock.advance(LEASE + 1)
    pair.producer_steps()
    assert not pair.producer.holds(pair.held)
