# SPDX-License-Identifier: Apache-2.0
"""F1 overlay of vllm/v1/core/kv_cache_coordinator.py: two-phase allocation."""

from collections.abc import Sequence

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from vllm_patches._overlay import amend


@amend("F1", ">=0.18.0")
class KVCacheCoordinator:
    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """
        Add the new computed blocks to the request, then allocate new blocks for
        external computed tokens (if any), in two phases over all groups.

        No group pops the free queue while another group still has untouched
        prefix-cache hits (vllm-project/vllm#33775).

        Args:
            request_id: The request ID.
            new_computed_blocks: The new computed blocks just hitting the
                prefix cache.
            num_local_computed_tokens: The number of local computed tokens.
            num_external_computed_tokens: The number of external computed tokens.
        """
        managers = self.single_type_managers
        for manager in managers:
            if request_id in manager.num_cached_block:
                # Fast-path: a running request won't have any new prefix-cache
                # hits. It should not have any new computed blocks.
                assert all(len(blocks) == 0 for blocks in new_computed_blocks)
                return

        for manager, blocks in zip(managers, new_computed_blocks):
            manager.add_local_computed_blocks(
                request_id,
                blocks,
                num_local_computed_tokens,
                num_external_computed_tokens,
            )
        if num_external_computed_tokens > 0:
            for manager in managers:
                manager.allocate_external_computed_blocks(
                    request_id,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                )
