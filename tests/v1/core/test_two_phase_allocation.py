# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cross-group prefix-cache hits plus external (connector) tokens must never hand
one physical block to two KV-cache groups.

Reproduces vllm-project/vllm#33775 (root cause of #43884), fixed upstream by the
two-phase allocation of PR #44409 (v0.24.0): the coordinator used to let each group
touch its own hits and then pop the free queue for its external tokens, so an
earlier group could evict a cached block that a later group was about to claim as
its hit. These tests fail on stock vLLM v0.18.x .. v0.23.x and pass with the fix.

Scenarios stage real prefix-cache hits at the head of the free queue, where an
earlier group's external allocation reaches them first.
"""

import inspect
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager, Request
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16


@pytest.fixture(scope="module", autouse=True)
def _none_hash():
    init_none_hash(sha256)


def make_hybrid_config(
    num_groups: int, num_blocks: int, sliding_window_blocks: int = 64
) -> KVCacheConfig:
    """One full-attention group followed by ``num_groups - 1`` sliding-window groups."""
    groups = [
        KVCacheGroupSpec(
            ["full"],
            FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
            ),
        )
    ]
    for i in range(1, num_groups):
        spec = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=sliding_window_blocks * BLOCK_SIZE,
        )
        groups.append(KVCacheGroupSpec([f"swa{i}"], spec))
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )


def make_manager(kv_cache_config: KVCacheConfig) -> KVCacheManager:
    kwargs = dict(
        max_model_len=8192,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    # v0.23 added scheduler_block_size (the LCM of the group block sizes).
    if "scheduler_block_size" in inspect.signature(KVCacheManager).parameters:
        kwargs["scheduler_block_size"] = BLOCK_SIZE
    return KVCacheManager(kv_cache_config, **kwargs)


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    sampling_params = SamplingParams(max_tokens=8)
    sampling_params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=None,
        sampling_params=sampling_params,
        pooling_params=None,
        lora_request=None,
        cache_salt=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def tokens(seed: int, num_tokens: int) -> list[int]:
    """Token ids unique to ``seed``, so that different seeds never share a block."""
    return [1000 * (seed + 1) + i for i in range(num_tokens)]


def assert_block_ownership(manager: KVCacheManager, live: list[str]) -> None:
    """No physical block is held by two groups (or twice by one request), and
    every block's ref_cnt equals the number of live references to it."""
    null_id = manager.block_pool.null_block.block_id
    references: Counter[int] = Counter()
    for request_id in live:
        groups = manager.get_blocks(request_id).get_block_ids()
        owners: dict[int, int] = {}
        for group_id, block_ids in enumerate(groups):
            for block_id in block_ids:
                if block_id == null_id:
                    continue
                assert owners.setdefault(block_id, group_id) == group_id, (
                    f"{request_id}: block {block_id} is in groups "
                    f"{owners[block_id]} and {group_id}"
                )
                references[block_id] += 1
    for block in manager.block_pool.blocks:
        if block.block_id != null_id:
            assert block.ref_cnt == references[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"{references[block.block_id]} live references"
            )


def compute(
    manager: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_external_tokens: int = 0,
) -> None:
    """Schedule ``request`` as the scheduler does: local hits, then slots.
    (get_computed_blocks returns a third value from v0.24 on; unused here.)"""
    hit_blocks, num_local = manager.get_computed_blocks(request)[:2]
    num_new = num_new_tokens - num_external_tokens - num_local
    assert num_new > 0
    allocated = manager.allocate_slots(
        request,
        num_new,
        num_local,
        hit_blocks,
        num_external_computed_tokens=num_external_tokens,
    )
    assert allocated is not None, "the pool is sized to fit every step"


def free_all_but(manager: KVCacheManager, keep: int, seed: int) -> None:
    """Put every free block except the first ``keep`` behind them in the free queue.

    A filler request takes the blocks in front, leaving ``keep`` blocks at the
    head, then frees them so they go to the tail.
    """
    num_free = manager.block_pool.get_num_free_blocks()
    num_groups = len(manager.kv_cache_config.kv_cache_groups)
    assert (num_free - keep) % num_groups == 0
    filler_blocks = (num_free - keep) // num_groups
    filler = make_request(f"filler{seed}", tokens(seed, filler_blocks * BLOCK_SIZE))
    allocated = manager.allocate_slots(filler, filler.num_tokens)
    assert allocated is not None
    manager.free(filler)


def stage_cached_prompt(manager: KVCacheManager, prompt: list[int]) -> None:
    """Compute ``prompt`` once and free it, leaving its cached blocks (group by
    group) at the head of the free queue: evictable prefix hits."""
    owner = make_request("prompt-owner", prompt)
    compute(manager, owner, len(prompt))
    manager.free(owner)
    num_groups = len(manager.kv_cache_config.kv_cache_groups)
    num_cached = len(prompt) // BLOCK_SIZE * num_groups
    free_all_but(manager, keep=num_cached, seed=1)


@pytest.mark.parametrize("num_groups", [2, 3])
def test_local_hits_and_external_tokens_do_not_share_blocks(num_groups: int):
    """Full attention + sliding window (2 and 3 groups): local hits of 4 blocks
    in every group plus 2 blocks of external tokens."""
    config = make_hybrid_config(num_groups, num_blocks=1 + 12 * num_groups)
    manager = make_manager(config)
    prefix = tokens(0, 4 * BLOCK_SIZE)
    stage_cached_prompt(manager, prefix)

    request = make_request("req", prefix + tokens(2, 3 * BLOCK_SIZE))
    compute(manager, request, request.num_tokens, num_external_tokens=2 * BLOCK_SIZE)

    assert_block_ownership(manager, ["req"])


@pytest.mark.parametrize("num_groups", [2, 3])
def test_preempt_and_reallocate_with_external_tokens(num_groups: int):
    """A request prefilled in part, preempted, then scheduled again with its own
    cached blocks as local hits and external tokens behind them: the coordinator
    must run both phases again for the re-admitted request."""
    config = make_hybrid_config(num_groups, num_blocks=1 + 12 * num_groups)
    manager = make_manager(config)
    prefix = tokens(0, 4 * BLOCK_SIZE)
    stage_cached_prompt(manager, prefix)

    request = make_request("req", prefix + tokens(2, 6 * BLOCK_SIZE + 1))
    compute(manager, request, 7 * BLOCK_SIZE)  # chunked prefill: 7 of 11 blocks
    assert_block_ownership(manager, ["req"])

    manager.free(request)  # preemption
    free_all_but(manager, keep=7 * num_groups, seed=3)

    compute(manager, request, request.num_tokens, num_external_tokens=2 * BLOCK_SIZE)
    assert_block_ownership(manager, ["req"])


def test_running_request_skips_computed_block_allocation():
    """The fast path for a running request stays: a second step allocates only
    new slots, never re-adds computed blocks (stock behaviour, kept)."""
    manager = make_manager(make_hybrid_config(2, num_blocks=1 + 24))
    request = make_request("req", tokens(0, 3 * BLOCK_SIZE))
    compute(manager, request, 2 * BLOCK_SIZE)
    before = manager.get_blocks("req").get_block_ids()
    manager.coordinator.allocate_new_computed_blocks("req", ([], []), 0, 0)
    assert manager.get_blocks("req").get_block_ids() == before
    assert_block_ownership(manager, ["req"])


def test_single_type_manager_keeps_allocate_new_computed_blocks():
    """Callers of the single-type manager's allocate_new_computed_blocks (e.g.
    upstream's test_evictable_cached_blocks_not_double_allocated) still get
    hits added and external blocks allocated for one group."""
    manager = make_manager(make_hybrid_config(1, num_blocks=1 + 16))
    prefix = tokens(0, 4 * BLOCK_SIZE)
    stage_cached_prompt(manager, prefix)
    single = manager.coordinator.single_type_managers[0]
    request = make_request("req", prefix + tokens(2, 3 * BLOCK_SIZE))
    hit_blocks, num_local = manager.get_computed_blocks(request)[:2]
    single.allocate_new_computed_blocks("req", hit_blocks.blocks[0], num_local, 32)
    block_ids = manager.get_blocks("req").get_block_ids()[0]
    assert len(block_ids) == (num_local + 32) // BLOCK_SIZE
    assert_block_ownership(manager, ["req"])


class HybridAllocationMachine(RuleBasedStateMachine):
    """Random hybrid configs (1-3 groups), prefix hits from shared prefixes,
    external tokens, other running traffic, frees and preemptions; block
    ownership is checked after every step."""

    def __init__(self):
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.requests: dict[str, Request] = {}
        self.next_id = 0

    @precondition(lambda self: self.manager is None)
    @rule(
        num_groups=st.integers(1, 3),
        blocks_per_group=st.integers(4, 14),
        window_blocks=st.integers(2, 8),
    )
    def configure(self, num_groups, blocks_per_group, window_blocks):
        config = make_hybrid_config(
            num_groups, 1 + num_groups * blocks_per_group, window_blocks
        )
        self.manager = make_manager(config)

    @precondition(lambda self: self.manager is not None)
    @rule(
        prefix=st.integers(0, 2),
        prefix_blocks=st.integers(1, 5),
        tail_tokens=st.integers(1, 3 * BLOCK_SIZE),
        external_blocks=st.integers(0, 3),
    )
    def admit(self, prefix, prefix_blocks, tail_tokens, external_blocks):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        prompt = tokens(prefix, prefix_blocks * BLOCK_SIZE) + tokens(
            10 + self.next_id, tail_tokens
        )
        request = make_request(request_id, prompt)
        self._schedule(request, external_blocks)

    def _schedule(self, request: Request, external_blocks: int) -> None:
        assert self.manager is not None
        hit_blocks, num_local = self.manager.get_computed_blocks(request)[:2]
        num_external = min(
            external_blocks * BLOCK_SIZE, request.num_tokens - num_local - 1
        )
        allocated = self.manager.allocate_slots(
            request,
            request.num_tokens - num_local - num_external,
            num_local,
            hit_blocks,
            num_external_computed_tokens=num_external,
        )
        if allocated is None:
            return  # not enough free blocks: the scheduler would wait
        self.requests[request.request_id] = request

    @precondition(lambda self: self.manager is not None)
    @rule()
    def busy_traffic(self):
        """Other running requests take the never-cached blocks at the head of the
        free queue, leaving evictable cached blocks at its head, as on a busy
        server."""
        assert self.manager is not None
        queue = self.manager.block_pool.free_block_queue
        num_fresh = 0
        block = queue.fake_free_list_head.next_free_block
        while block is not queue.fake_free_list_tail and block.block_hash is None:
            num_fresh += 1
            block = block.next_free_block
        num_groups = len(self.manager.kv_cache_config.kv_cache_groups)
        num_tokens = num_fresh // num_groups * BLOCK_SIZE
        if num_tokens == 0:
            return
        self.next_id += 1
        prompt = tokens(1000 + self.next_id, num_tokens)
        request = make_request(f"busy{self.next_id}", prompt)
        if self.manager.allocate_slots(request, num_tokens) is not None:
            self.requests[request.request_id] = request

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        assert self.manager is not None
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        self.manager.free(self.requests.pop(request_id))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), external_blocks=st.integers(0, 3))
    def preempt_and_reallocate(self, data, external_blocks):
        assert self.manager is not None
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests.pop(request_id)
        self.manager.free(request)
        self._schedule(request, external_blocks)

    @invariant()
    def blocks_have_one_owner(self):
        if self.manager is not None:
            assert_block_ownership(self.manager, list(self.requests))


TestHybridAllocationMachine = HybridAllocationMachine.TestCase
TestHybridAllocationMachine.settings = settings(
    max_examples=300,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
