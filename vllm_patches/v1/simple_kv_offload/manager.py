# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/simple_kv_offload/manager.py: the scheduler-side gate
that keeps CPU offload off until every worker has registered its CPU KV cache."""

import time

from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadWorkerMetadata,
    get_async_register_cache,
)

from vllm_patches._overlay import amend, call_at_end_of


@amend("F4", ">=0.19.0")
class SimpleCPUOffloadScheduler:
    # How often an engine without requests steps while a registration report or
    # the release order is outstanding: the gate opens, or the order goes out, at
    # most this long after the last worker reported, at one empty step (a collective
    # RPC of no work) per interval while the tier pins.
    IDLE_STEP_S = 1.0

    @call_at_end_of("__init__")
    def _init_register_gate(self) -> None:
        """Close the offload gate until all ``_expected_worker_count`` workers reported
        their CPU KV cache pinned: no CPU hit, load or store before. A failure keeps it
        closed and orders every worker to release its cache. Open from the start without
        the option."""
        self._ready_worker_ranks: set[int] = set()
        self._failed_worker_ranks: set[int] = set()
        self._release_pending = False
        self._workers_ready = not get_async_register_cache(self.vllm_config)
        self._gate_created = time.monotonic()
        self._last_step = self._gate_created

    def is_ready(self) -> bool:
        """Whether every worker can run CPU offload transfers."""
        return self._workers_ready

    def idle_step_wait(self) -> float | None:
        """Seconds until an engine without requests should step once more (0 or
        less: now), so that the workers' reports and the release order travel
        without traffic; None when nothing is outstanding: the option is off,
        every worker reported ready, or a failure was reported and the release
        order went out."""
        if self._workers_ready or (
            self._failed_worker_ranks and not self._release_pending
        ):
            return None
        return self._last_step + self.IDLE_STEP_S - time.monotonic()

    def note_step(self) -> None:
        """A step built metadata (with requests or idle): the next idle step is
        due IDLE_STEP_S later."""
        self._last_step = time.monotonic()

    def take_release_request(self) -> bool:
        """True exactly once, after the first failed report: the metadata built now
        asks every worker to unregister and free its CPU KV cache. Once suffices,
        since every worker receives every step's metadata."""
        pending, self._release_pending = self._release_pending, False
        return pending

    def update_ready_workers(self, connector_output: KVConnectorOutput) -> None:
        """Record the workers' ready reports; open the gate once all reported."""
        meta = connector_output.kv_connector_worker_meta
        if self._workers_ready or not isinstance(meta, SimpleCPUOffloadWorkerMetadata):
            return
        if meta.failed_ranks and not self._failed_worker_ranks:
            logger.error(
                "SimpleCPUOffloadScheduler: worker rank(s) %s failed to register "
                "their CPU KV cache; CPU offload stays off on every rank, and every "
                "worker unregisters and frees its CPU KV cache.",
                sorted(meta.failed_ranks),
            )
            self._release_pending = True
        self._failed_worker_ranks.update(meta.failed_ranks)
        # A set: a rank reported twice counts once.
        self._ready_worker_ranks.update(meta.ready_ranks)
        if (
            self._failed_worker_ranks
            or len(self._ready_worker_ranks) < self._expected_worker_count
        ):
            return
        self._workers_ready = True
        logger.info(
            "SimpleCPUOffloadScheduler: all %d workers registered their CPU KV "
            "cache; CPU offload is enabled, %.1f s after the scheduler started.",
            self._expected_worker_count,
            time.monotonic() - self._gate_created,
        )
