# SPDX-License-Identifier: Apache-2.0
"""F22 overlay of vllm/v1/simple_kv_offload/copy_backend.py: a store's batch copy
reads its source in stream order, so that the store stream's wait for the compute
stream (``worker.py``) orders its reads after the forward's KV writes."""

import torch

from vllm.v1.simple_kv_offload.cuda_mem_ops import BatchMemcpyParams, build_params

from vllm_patches._overlay import amend, redirect_call_in


@amend("F22", ">=0.19.0")
class DmaCopyBackend:
    # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM (cuda.h): the copy reads its source after the
    # work issued to its stream before it. Upstream's ANY (3) lets the driver read it
    # out of stream order, past any wait. ROCm's batch copy takes no attributes.
    _STORE_SRC_ACCESS_ORDER = 1

    @redirect_call_in("init", "build_params")
    def _copy_params(
        self,
        src_caches: dict[str, torch.Tensor],
        dst_caches: dict[str, torch.Tensor],
        stream: torch.cuda.Stream,
    ) -> BatchMemcpyParams:
        """Upstream's build_params; on the store stream, in stream order."""
        params = build_params(src_caches, dst_caches, stream)
        if stream is self._store_stream:
            params.attrs.srcAccessOrder = self._STORE_SRC_ACCESS_ORDER
        return params
