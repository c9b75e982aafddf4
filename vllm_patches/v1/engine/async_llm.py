# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/v1/engine/async_llm.py.

F26 (v0.18 - v0.20): the front end sends the engine a notice for a request with
KV-transfer params that the serving layer rejected before admission (PR 41269, in
v0.21).
"""

import time
from typing import Any

from vllm.v1.engine import EngineCoreRequest
from vllm.v1.request import KVTransferRejection

from vllm_patches._overlay import amend


@amend("F26", ">=0.18.0")
class AsyncLLM:
    async def notify_kv_transfer_request_rejected(
        self,
        request_id: str,
        kv_transfer_params: dict[str, Any],
        *,
        data_parallel_rank: int | None = None,
    ) -> None:
        """Send the engine a rejection notice for ``request_id``, which the scheduler
        ends as it is added, so that the KV connector frees what the remote prefill
        holds (a NIXL producer's prompt blocks) now rather than at its abort
        timeout."""
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=[0],
            mm_features=None,
            sampling_params=KVTransferRejection.sampling_params(kv_transfer_params),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=data_parallel_rank,
        )
        # An id of its own: the rejected request's may be in use in the engine.
        self.input_processor.assign_request_id(request)
        await self.engine_core.add_request_async(request)
