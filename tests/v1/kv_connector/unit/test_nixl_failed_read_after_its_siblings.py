# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL pull decoder: a request one of whose READs failed is reported once, as
failed, only after none of its READs is in flight.

Reproduces the pull half of what PR 56104 fixed in v0.30: a decoder that reads a
request from several producer ranks (heterogeneous TP) posts one READ per rank.
Up to v0.29, a READ whose post raised (and, from v0.22, one NIXL reports failed)
queued the request as a failed receive, which get_finished reported at once, while
its other READs still wrote into its blocks; the next of them to complete ended the
worker on "assert meta is not None". The worker is driven through its own poll
(``get_finished`` / ``get_transfer_results``) with a fake NIXL agent whose handles
end when each seeded scenario says (``nixl_harness.make_producer``: the same worker
class reads as a decoder).
"""

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from . import nixl_harness

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

dist_world = nixl_harness.dist_world
make_producer = nixl_harness.make_producer

# How a READ ends: NIXL reports it done, reports it failed, its poll raises, or its
# post raised, so that it never flew.
OUTCOMES = ("DONE", "ERR", "raise", "post")


@dataclass(frozen=True)
class Read:
    handle: int
    outcome: str
    ends_at: int  # the first poll that sees it ended

    @property
    def posted(self) -> bool:
        return self.outcome != "post"


@dataclass(frozen=True)
class Receive:
    req_id: str
    blocks: tuple[int, ...]
    reads: tuple[Read, ...]

    @property
    def last_read_ends_at(self) -> int:
        """The poll that must report it: the first, when no READ of it flew."""
        return max([1] + [read.ends_at for read in self.reads if read.posted])

    def in_flight_at(self, poll: int) -> list[Read]:
        return [read for read in self.reads if read.posted and read.ends_at > poll]


def draw(seed: int) -> list[Receive]:
    """1-3 requests, each read from 1-4 producer ranks over 1-4 polls, at least
    one of its READs failing."""
    rng = random.Random(seed)
    receives: list[Receive] = []
    handle, block = 100, 1
    for index in range(rng.randint(1, 3)):
        reads: list[Read] = []
        for _ in range(rng.randint(1, 4)):
            handle += 1
            reads.append(Read(handle, rng.choice(OUTCOMES), rng.randint(1, 4)))
        if all(read.outcome == "DONE" for read in reads):
            failing = rng.randrange(len(reads))
            reads[failing] = Read(reads[failing].handle, "ERR", reads[failing].ends_at)
        blocks = tuple(range(block, block + rng.randint(1, 3)))
        block += len(blocks)
        receives.append(Receive(f"cmpl-read-{seed}-{index}", blocks, tuple(reads)))
    return receives


class ScriptedReads:
    """The NIXL agent's view of the READ handles: each is in progress until its
    ``ends_at`` poll, then ends as its outcome says."""

    def __init__(self, receives: list[Receive]) -> None:
        self.reads = {read.handle: read for r in receives for read in r.reads}
        self.poll = 0

    def check_xfer_state(self, handle: int) -> str:
        read = self.reads[handle]
        if self.poll < read.ends_at:
            return "PROC"
        if read.outcome == "raise":
            raise RuntimeError(f"NIXL lost READ handle {handle}")
        return read.outcome

    def get_xfer_telemetry(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(
            xferDuration=1, postDuration=1, totalBytes=1, descCount=1
        )

    def release_xfer_handle(self, handle: int) -> None:
        pass


def fail_post(worker, receive: Receive) -> None:
    """What ``_read_blocks`` leaves when a READ's post raises, up to v0.29: the
    request's blocks marked invalid and the request queued as a failed receive (a
    set up to v0.21, a queue after; from v0.30 the queue other threads report to)."""
    if isinstance(worker._failed_recv_reqs, set):
        worker._invalid_block_ids.update(receive.blocks)
        worker._failed_recv_reqs.add(receive.req_id)
    else:
        worker._invalid_block_ids.put(set(receive.blocks))
        worker._failed_recv_reqs.put(receive.req_id)


def violations(worker, receives: list[Receive]) -> list[str]:
    """Post every READ, poll until every posted one ended, and once more; what broke
    the invariants."""
    agent = ScriptedReads(receives)
    for name in ("check_xfer_state", "get_xfer_telemetry", "release_xfer_handle"):
        setattr(worker.nixl_wrapper, name, getattr(agent, name))
    for receive in receives:
        worker._recving_metadata[receive.req_id] = SimpleNamespace(
            local_block_ids=[list(receive.blocks)],
            local_physical_block_ids=[list(receive.blocks)],
            remote=SimpleNamespace(
                engine_id="prefill",
                request_id=receive.req_id,
                host="localhost",
                port=5600,
                block_ids=[list(receive.blocks)],
            ),
        )
        if posted := [read.handle for read in receive.reads if read.posted]:
            worker._recving_transfers[receive.req_id] = posted
        if not all(read.posted for read in receive.reads):
            fail_post(worker, receive)
    by_id = {receive.req_id: receive for receive in receives}
    found: list[str] = []
    reported: dict[str, int] = {}
    invalid: set[int] = set()
    last = max(r.last_read_ends_at for r in receives) + 1
    for poll in range(1, last + 1):
        agent.poll = poll
        try:
            done = nixl_harness.transfer_results(worker)[1]
        except AssertionError as e:
            return found + [f"poll {poll} ended the worker: {e}"]
        invalid |= worker.get_block_ids_with_load_errors()
        for req_id in done:
            receive = by_id[req_id]
            if req_id in reported:
                found.append(f"{req_id} reported again at poll {poll}")
            reported.setdefault(req_id, poll)
            flying = receive.in_flight_at(poll)
            if flying:
                found.append(
                    f"{req_id} reported at poll {poll} with READ handles "
                    f"{[r.handle for r in flying]} still in flight into its blocks"
                )
            elif poll > receive.last_read_ends_at:
                found.append(
                    f"{req_id} reported at poll {poll}, after its last READ ended "
                    f"at poll {receive.last_read_ends_at}"
                )
            if not set(receive.blocks) <= invalid:
                found.append(f"{req_id} reported without its blocks marked invalid")
    found += [
        f"{r.req_id} never reported" for r in receives if r.req_id not in reported
    ]
    return found


@pytest.mark.parametrize("seed", range(8))
def test_a_failed_read_is_reported_after_the_requests_other_reads(make_producer, seed):
    """Seeded receives, each with a failing READ among 1-4: every request is reported
    once, in the poll that sees its last READ end, with its blocks marked invalid; no
    poll ends the worker."""
    receives = draw(seed)
    found = violations(make_producer().worker, receives)
    assert not found, f"seed {seed}, {receives}:\n" + "\n".join(found)


def test_a_failure_with_no_read_in_flight_is_reported_at_once(make_producer):
    """The only READ of a request fails: it is reported in that poll, as upstream
    reports it."""
    receive = Receive("cmpl-read-alone", (7, 8), (Read(900, "ERR", 1),))
    assert not violations(make_producer().worker, [receive])
