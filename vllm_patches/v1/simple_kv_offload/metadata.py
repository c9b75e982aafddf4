# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/simple_kv_offload/metadata.py: the async_register_cache
option, the workers' "CPU cache ready" report and the scheduler's "release it"
order."""

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorWorkerMetadata,
)

from vllm_patches._overlay import add, amend


@amend("F4", ">=0.19.0")
class SimpleCPUOffloadMetadata:
    # async_register_cache only: set in one step's metadata after a worker reported
    # that its background pin failed. Every worker then unregisters its CPU KV cache
    # and returns its pages to the OS, so no rank keeps a pinned tier that CPU
    # offload, off on every rank from then on, will never use (vllm#51762).
    release_cpu_cache: bool = False


@amend("F4", ">=0.19.0")
class SimpleCPUOffloadWorkerMetadata:
    # async_register_cache only: ranks of the workers whose CPU KV cache became
    # usable (pinned, copy backend initialised) since their last report, and of
    # those whose background pin failed. Each worker reports its rank once, in
    # one of the two; aggregate() takes the unions across workers.
    ready_ranks: frozenset[int] = frozenset()
    failed_ranks: frozenset[int] = frozenset()

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
            failed_ranks=self.failed_ranks | other.failed_ranks,
        )


@add("F4", ">=0.19.0")
def get_async_register_cache(vllm_config: VllmConfig | None) -> bool:
    """``kv_connector_extra_config["async_register_cache"]`` (or its alias
    ``"async_init"``, upstream PR 54792's name; both given must agree). Only a real
    boolean is accepted (``"false"`` is truthy); the disk backend and elastic EP are
    rejected."""
    if vllm_config is None or vllm_config.kv_transfer_config is None:
        return False
    extra_config = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    # "async_init" is the name in upstream's open PR 54792 (same meaning); accepted
    # so a config written for that PR works here and once upstream ships it.
    names = ("async_register_cache", "async_init")
    given = {k: extra_config[k] for k in names if k in extra_config}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise ValueError(
                f"kv_connector_extra_config[{key!r}] must be a boolean "
                f"(true or false), got {value!r} of type {type(value).__name__}"
            )
    if len(set(given.values())) > 1:
        raise ValueError(
            "kv_connector_extra_config['async_register_cache'] and ['async_init'] "
            f"disagree ({given}); give one of them"
        )
    value = any(given.values())
    if value and extra_config.get("kv_offload_backend", "cpu") == "disk":
        raise ValueError(
            "kv_connector_extra_config['async_register_cache'] applies to "
            'kv_offload_backend="cpu" only; the disk backend pins no CPU KV cache.'
        )
    if value and getattr(vllm_config.parallel_config, "enable_elastic_ep", False):
        raise ValueError(
            "kv_connector_extra_config['async_register_cache'] cannot be used with "
            "elastic EP, which captures CUDA graphs again while the CPU KV cache "
            "may still be pinning (vllm#46933)."
        )
    return value
