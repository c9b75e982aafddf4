# SPDX-License-Identifier: Apache-2.0
"""F1 overlay of vllm/v1/core/single_type_kv_cache_manager.py.

Splits allocate_new_computed_blocks into its two phases so that the coordinator
can run each phase over every group before the next one.
"""

from collections.abc import Sequence

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_patches._overlay import amend


@amend("F1", ">=0.18.0")
class SingleTypeKVCacheManager:
    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """
        Add the prefix-cache hits of a new request (phase 1 of 2):
        1. Touch the computed blocks, paired with adding them to the request,
           so that a block's ref_cnt counts exactly the requests holding it.
        1.5. (Optional) For sliding window, skip blocks are padded with null blocks.
        2. Add the remaining computed blocks.

        Takes nothing from the free queue, so it cannot evict a hit of another
        group. External tokens are counted only to find the skipped blocks.

        Args:
            request_id: The request ID.
            new_computed_blocks: The new computed blocks just hitting the
                prefix cache.
            num_local_computed_tokens: The number of local computed tokens.
            num_external_computed_tokens: The number of external computed tokens.
        """
        req_blocks = self.req_to_blocks[request_id]
        assert len(req_blocks) == 0
        num_total_computed_tokens = (
            num_local_computed_tokens + num_external_computed_tokens
        )
        num_skipped_tokens = self.get_num_skipped_tokens(num_total_computed_tokens)
        num_skipped_blocks = num_skipped_tokens // self.block_size
        if num_skipped_blocks > 0:
            # It is possible that all new computed blocks are skipped when
            # num_skipped_blocks > len(new_computed_blocks).
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]

        # Touch the computed blocks to make sure they won't be evicted.
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        else:
            assert not any(new_computed_blocks), (
                "Computed blocks should be empty when prefix caching is disabled"
            )

        # Skip blocks are padded with null blocks.
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        # Add the remaining computed blocks.
        req_blocks.extend(new_computed_blocks)
        # All cached hits (including skipped nulls) are already cached; mark
        # them so cache_blocks() will not try to re-cache blocks that already
        # have a block_hash set.
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """
        Allocate new blocks for the external computed tokens of a new request
        (phase 2 of 2). Must run after add_local_computed_blocks() of every
        group for this request: it pops the free queue, which may evict any
        cached block that no request has touched yet.

        Args:
            request_id: The request ID.
            num_local_computed_tokens: The number of local computed tokens.
            num_external_computed_tokens: The number of external computed tokens.
        """
        num_total_computed_tokens = (
            num_local_computed_tokens + num_external_computed_tokens
        )
        req_blocks = self.req_to_blocks[request_id]
        # Phase 1 padded the skipped blocks with leading null blocks, so only
        # then can skipping have cut into the external tokens.
        if req_blocks and req_blocks[0] is self._null_block:
            # Some external computed tokens may be skipped too.
            num_skipped_tokens = self.get_num_skipped_tokens(num_total_computed_tokens)
            num_external_computed_tokens = min(
                num_total_computed_tokens - num_skipped_tokens,
                num_external_computed_tokens,
            )
        if num_external_computed_tokens > 0:
            # The base-class allocation, not a subclass override: it fills the
            # request up to num_total_computed_tokens slots and keeps the
            # new_block_ids bookkeeping of this release.
            SingleTypeKVCacheManager.allocate_new_blocks(
                self,
                request_id,
                num_total_computed_tokens,
                num_total_computed_tokens,
            )

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """
        Add the new computed blocks to the request and allocate new blocks for
        external computed tokens (if any): both phases, for this group alone.

        With several groups, go through the coordinator instead: it finishes
        phase 1 for every group before any group starts phase 2.

        Args:
            request_id: The request ID.
            new_computed_blocks: The new computed blocks just hitting the
                prefix cache.
            num_local_computed_tokens: The number of local computed tokens.
            num_external_computed_tokens: The number of external computed tokens.
        """
        if request_id in self.num_cached_block:
            # Fast-path: a running request won't have any new prefix-cache hits.
            # It should not have any new computed blocks.
            assert len(new_computed_blocks) == 0
            return

        self.add_local_computed_blocks(
            request_id,
            new_computed_blocks,
            num_local_computed_tokens,
            num_external_computed_tokens,
        )
        self.allocate_external_computed_blocks(
            request_id, num_local_computed_tokens, num_external_computed_tokens
        )


@amend("F1", ">=0.18.0")
class CrossAttentionManager:
    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        # We do not cache blocks for cross-attention to be shared between
        # requests, so `new_computed_blocks` should always be empty.
        assert len(new_computed_blocks) == 0

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        # Cross-attention blocks hold encoder states, allocated by
        # allocate_new_blocks() from the encoder token count; connectors
        # never load them as external computed tokens.
        pass
