# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/v1/request.py.

F26 (v0.18 - v0.20): what a rejection notice is, for the front end that sends it and the
scheduler that ends it (PR 41269, in v0.21).
"""

from typing import Any

from vllm.sampling_params import SamplingParams

from vllm_patches._overlay import add


@add("F26", ">=0.18.0")
class KVTransferRejection:
    """A request with KV-transfer params that the serving layer rejected before the
    engine admitted it, sent to the engine only so that its KV connector frees what the
    remote prefill holds: the scheduler ends it as it is added (vllm#41269)."""

    EXTRA_ARGS_KEY = "kv_transfer_rejected_before_admission"

    @classmethod
    def sampling_params(cls, kv_transfer_params: dict[str, Any]) -> SamplingParams:
        """A notice's sampling params: the rejected request's KV-transfer params, and
        one token that is never computed."""
        return SamplingParams(
            max_tokens=1,
            extra_args={
                "kv_transfer_params": dict(kv_transfer_params),
                cls.EXTRA_ARGS_KEY: True,
            },
        )

    @classmethod
    def is_notice(cls, request: "Request") -> bool:
        """Whether ``request`` is a rejection notice."""
        params = request.sampling_params
        return params is not None and bool(
            (params.extra_args or {}).get(cls.EXTRA_ARGS_KEY)
        )
