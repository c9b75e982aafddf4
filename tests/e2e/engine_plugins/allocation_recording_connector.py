"""A KV connector that records what the scheduler allocated for each request (F1 e2e).

``DecodeBenchConnector`` is the one ``SupportsHMA`` connector that runs on CPU (pure
torch): it reports every uncomputed prompt token but the last as external, so a prompt
that shares a cached prefix gets local prefix-cache hits and external tokens in one
allocation, the case of vllm#33775. This subclass changes nothing; it records, through
the e2e probe, the local hits the scheduler found (``get_num_new_matched_tokens``) and
every KV-cache group's block ids right after the allocation
(``update_state_after_alloc``).
"""

from __future__ import annotations

from typing import Any

from e2e_probe import emit

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnector,
)


class AllocationRecordingConnector(DecodeBenchConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        result = DecodeBenchConnector.get_num_new_matched_tokens(
            self, request, num_computed_tokens)
        emit("matched", req=request.request_id, local_hit_tokens=num_computed_tokens,
             external_tokens=result[0])
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        emit("alloc", req=request.request_id, external_tokens=num_external_tokens,
             blocks=[list(group) for group in blocks.get_block_ids()])
        DecodeBenchConnector.update_state_after_alloc(self, request, blocks,
                                                      num_external_tokens)
