# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/distributed/kv_transfer/kv_connector/v1/simple_cpu_offload_connector.py:
document async_register_cache and hold scheduler-side calls behind the manager's
gate until every worker has registered its CPU KV cache.

The gate sits in the connector's one-line delegations (identical v0.19 .. v0.33)
rather than in SimpleCPUOffloadScheduler's long methods, which change in almost
every release.
"""

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

from vllm_patches._overlay import amend

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


@amend("F4", ">=0.19.0")
class SimpleCPUOffloadConnector:
    __doc__ = """CPU KV cache offloading with custom kernel transfers and BlockPool LRU.

    ``kv_connector_extra_config["async_register_cache"]`` (bool, default false)
    pins the CPU KV cache in a background thread instead of inside
    register_kv_caches(). cudaHostRegister over the whole CPU tier takes
    minutes at hundreds of GB, and until it returns engine startup, and with it
    the health check, is blocked. With the option the engine serves as soon as
    the GPU KV cache is ready: each worker pins once it finished warm-up and
    CUDA-graph capture (pinning from another thread during a capture fails or
    breaks it), in chunks of at most 2 GiB, logging its progress; requests
    scheduled meanwhile use the GPU KV cache only, and CPU offload (loads and
    stores) starts once every worker has registered its CPU cache. If pinning
    fails on a worker, the error is logged, CPU offload stays off on every
    worker, and every worker unregisters its CPU KV cache and returns its
    memory. Turn it on for CPU tiers of hundreds of GB and more; small tiers
    pin in seconds and gain nothing. Only a JSON boolean is accepted (a string
    such as "false" is rejected); ``async_init`` (upstream PR 54792's name) is
    accepted as the same option.
    """

    def start_async_register_cache(self) -> None:
        """Start the deferred background pin of this worker's CPU KV cache; the GPU
        worker calls this when it finished warm-up and CUDA-graph capture."""
        if self.worker_handler is not None:
            self.worker_handler.start_async_register_cache()

    def idle_step_wait(self) -> float | None:
        """Seconds until an engine without requests should step, so that the
        workers' registration reports and the release order after a failed pin
        (async_register_cache) do not wait for the first request; None when no
        step is needed. EngineCoreProc and Scheduler read it."""
        if self.scheduler_manager is None:
            return None
        return self.scheduler_manager.idle_step_wait()

    def get_num_new_matched_tokens(
        self,
        request: "Request",
        num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        # Until every worker has registered its CPU KV cache
        # (async_register_cache), requests are served from the GPU only.
        if self.scheduler_manager is not None and self.scheduler_manager.is_ready():
            return self.scheduler_manager.get_num_new_matched_tokens(
                request, num_computed_tokens
            )
        return 0, False

    def update_state_after_alloc(
        self,
        request: "Request",
        blocks: "KVCacheBlocks",
        num_external_tokens: int,
    ) -> None:
        # A request admitted before the gate opens is not tracked for stores
        # either: it stays GPU-only, so nothing must be released for it later.
        if self.scheduler_manager is not None and self.scheduler_manager.is_ready():
            self.scheduler_manager.update_state_after_alloc(
                request, blocks, num_external_tokens
            )

    def build_connector_meta(
        self,
        scheduler_output: SchedulerOutput,
    ) -> KVConnectorMetadata:
        # No load or store may reach a worker whose copy backend may not exist.
        # After a worker's pin failed, one step's metadata asks all to free theirs.
        manager = self.scheduler_manager
        if manager is None:
            return SimpleCPUOffloadMetadata()
        manager.note_step()
        if manager.is_ready():
            return manager.build_connector_meta(scheduler_output)
        release = manager.take_release_request()
        return SimpleCPUOffloadMetadata(release_cpu_cache=release)

    def update_connector_output(
        self,
        connector_output: KVConnectorOutput,
    ) -> None:
        if self.scheduler_manager is not None:
            self.scheduler_manager.update_ready_workers(connector_output)
            self.scheduler_manager.update_connector_output(connector_output)
