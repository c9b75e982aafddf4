# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/simple_kv_offload/metadata.py: the async_register_cache
option and the workers' "CPU cache ready" report."""

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)

from vllm_patches._overlay import add, amend


@amend("F4", ">=0.19.0,<0.34.0")
class SimpleCPUOffloadWorkerMetadata:
    # async_register_cache only: ranks of the workers whose CPU KV cache became
    # usable (pinned, copy backend initialised) since their last report. Each
    # worker reports its rank once; aggregate() takes the union across workers.
    ready_ranks: frozenset[int] = frozenset()

    def aggregate(
        self, other: "KVConnectorWorkerMetadata"
    ) -> "KVConnectorWorkerMetadata":
        assert isinstance(other, SimpleCPUOffloadWorkerMetadata)
        merged = dict(self.completed_store_events)
        for k, v in other.completed_store_events.items():
            merged[k] = merged.get(k, 0) + v
        return SimpleCPUOffloadWorkerMetadata(
            completed_store_events=merged,
            ready_ranks=self.ready_ranks | other.ready_ranks,
        )


@add("F4", ">=0.19.0,<0.28.0")
def get_async_register_cache(vllm_config: VllmConfig | None) -> bool:
    """Return ``kv_connector_extra_config["async_register_cache"]``.

    When true, each worker pins its CPU KV cache in a background thread and
    the scheduler builds no CPU load or store until every worker has reported
    that its copy backend exists. The scheduler and the workers read the option
    from the same config, so they always agree on whether to wait.

    Only a real boolean is accepted (JSON ``true``/``false``). A string such as
    ``"false"`` is truthy in Python and would silently turn the option on, so
    it is rejected rather than interpreted.
    """
    if vllm_config is None or vllm_config.kv_transfer_config is None:
        return False
    extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    value = extra_config.get("async_register_cache", False)
    if not isinstance(value, bool):
        raise ValueError(
            "kv_connector_extra_config['async_register_cache'] must be a boolean "
            f"(true or false), got {value!r} of type {type(value).__name__}"
        )
    return value


@add("F4", ">=0.28.0,<0.34.0")
def get_async_register_cache(vllm_config: VllmConfig | None) -> bool:
    """Return ``kv_connector_extra_config["async_register_cache"]``.

    When true, each worker pins its CPU KV cache in a background thread and
    the scheduler builds no CPU load or store until every worker has reported
    that its copy backend exists. The scheduler and the workers read the option
    from the same config, so they always agree on whether to wait.

    Only a real boolean is accepted (JSON ``true``/``false``). A string such as
    ``"false"`` is truthy in Python and would silently turn the option on, so
    it is rejected rather than interpreted. The disk backend pins no CPU KV
    cache, so the option is rejected there too instead of being ignored.
    """
    if vllm_config is None or vllm_config.kv_transfer_config is None:
        return False
    extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    value = extra_config.get("async_register_cache", False)
    if not isinstance(value, bool):
        raise ValueError(
            "kv_connector_extra_config['async_register_cache'] must be a boolean "
            f"(true or false), got {value!r} of type {type(value).__name__}"
        )
    if value and extra_config.get("kv_offload_backend", "cpu") == "disk":
        raise ValueError(
            "kv_connector_extra_config['async_register_cache'] applies to "
            'kv_offload_backend="cpu" only; the disk backend pins no CPU KV cache.'
        )
    return value
