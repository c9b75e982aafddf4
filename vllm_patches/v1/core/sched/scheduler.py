# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/v1/core/sched/scheduler.py: steps without requests when the KV
connector has something that only a step carries.

F4: a connector whose ``idle_step_wait()`` is due counts as finished work, so an engine
without requests runs one empty step, which carries the workers' reports.
F20: so does a finished request whose blocks the connector still holds, until a
step's report frees them.
F24 (v0.30): an async KV load is admitted only with room for the first speculative
step of every load in flight and its own (PR 57104, in v0.31).
F25 (v0.18 - v0.22): an async KV load is admitted only into blocks that the loads and
prefills in flight do not still need (PR 44560, in v0.23).
F26 (v0.18 - v0.20): a rejection notice ends as it is added, which runs its KV
connector's request_finished (PR 41269, in v0.21).
F5 (v0.18 - v0.21): the KV connector hears of each request as it queues
(on_new_request, which upstream's add_request calls from v0.22).
"""

from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv
from vllm.v1.request import KVTransferRejection, RequestStatus

from vllm_patches._overlay import (
    amend,
    call_at_end_of,
    filter_result_of,
    redirect_call_in,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


@amend("F4", ">=0.20.0")
class Scheduler:
    @filter_result_of("has_finished_requests")
    def _or_idle_step(self, finished: bool) -> bool:
        """Also true while the KV connector's idle step is due."""
        if finished or self.connector is None:
            return finished
        idle_step_wait = getattr(self.connector, "idle_step_wait", None)
        if idle_step_wait is None:
            return False
        wait = idle_step_wait()
        return wait is not None and wait <= 0


@amend("F5", ">=0.18.0,<0.22.0", after="_enqueue_waiting_request")
class Scheduler:
    """F5 before v0.22: upstream's on_new_request, called where a request joins the
    waiting queue, away from the lines other fixes change in add_request."""

    @call_at_end_of("_enqueue_waiting_request")
    def _tell_connector_of_arrival(self, request: "Request") -> None:
        """The connector hears of every request as it queues, seated or not: a child
        that arrives after its prompt's READ releases the producer's blocks at once,
        not when a decoder short of seats admits it, past the producer's timeout. (A
        streaming request queues again; its remote prefill is behind it by then.)"""
        if self.connector is not None:
            self.connector.on_new_request(request)


@amend("F5", ">=0.22.0")
class Scheduler:
    """F5 from v0.22: upstream's add_request tells the connector of each arrival."""


@amend("F20", ">=0.18.0")
class Scheduler:
    @filter_result_of("has_finished_requests")
    def _or_blocks_held(self, finished: bool) -> bool:
        """Also true while the KV connector holds a finished request's blocks."""
        if finished or self.connector is None:
            return finished
        # request_finished() asked to delay the free: the request left every queue
        # but stays in self.requests until a step reports its transfer done.
        queued = len(self.running) + len(self.waiting) + len(self.skipped_waiting)
        return len(self.requests) > queued


@amend("F24", ">=0.30.0")
class Scheduler:
    """F24: no async KV load is admitted into blocks that a loaded request's first
    speculative step needs (v0.30; upstream from v0.31, PR 57104)."""

    def _spec_step_blocks(self) -> int:
        """Blocks a speculative decode step may add past a request's tokens: its
        own token, the draft tokens and the lookahead; none without drafts."""
        if not self.num_spec_tokens:
            return 0
        return cdiv(
            1 + self.num_spec_tokens + self.num_lookahead_tokens, self.block_size
        )

    @filter_result_of("_request_remaining_blocks")
    def _with_spec_step(self, blocks: int) -> int:
        """What a request in flight still needs, its first speculative step too."""
        # A load that finished is promoted only if that step fits; when the loads
        # in flight took those blocks, nothing runs to preempt, and every load
        # waits for the others (a deadlock).
        return blocks + self._spec_step_blocks()

    # Its one caller is the admission of an async load in schedule(); not a hook on
    # that call, which a plugin wrapping schedule() would refuse (CONTRIBUTING.md).
    @filter_result_of("_inflight_prefill_reserved_blocks")
    def _and_own_spec_step(self, reserved: int) -> int:
        """The reservation an async load is admitted under: the loads in flight's,
        and its own first speculative step."""
        return reserved + self._spec_step_blocks()


@amend("F25", ">=0.18.0")
class Scheduler:
    """F25: an async KV load never takes the blocks that the loads and prefills in
    flight still need to finish (v0.18 - v0.22; upstream from v0.23, PR 44560)."""

    # The requests admitted as async loads, until they leave the waiting states.
    _async_loads: "frozenset[Request]" = frozenset()

    def _blocks_to_finish(self, request: "Request") -> int:
        """Blocks ``request`` must still allocate to hold its whole sequence."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        return self.kv_cache_manager.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=num_tokens,
            new_computed_blocks=self.kv_cache_manager.empty_kv_cache_blocks.blocks,
            num_encoder_tokens=0,
            total_computed_tokens=request.num_computed_tokens,
            num_tokens_main_model=num_tokens,
        )

    def _blocks_reserved_in_flight(self) -> int:
        """What the async loads (loading, or loaded and not yet scheduled) and the
        running prefills still need: blocks no new async load may take."""
        # A load admitted in this step is in none of the scheduler's queues yet.
        self._async_loads = frozenset(
            request
            for request in self._async_loads
            if request.status
            in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING)
        )
        prefills = [
            request
            for request in self.running
            if request.num_computed_tokens < request.num_prompt_tokens
        ]
        return sum(
            self._blocks_to_finish(request)
            for request in (*self._async_loads, *prefills)
        )

    # Only the admission of a waiting request passes delay_cache_blocks: the running
    # requests' allocations, one each every step, do not come through here.
    @redirect_call_in(
        "schedule", "self.kv_cache_manager.allocate_slots(delay_cache_blocks=...)"
    )
    def _allocate_slots_beside_in_flight(
        self, request: "Request", num_new_tokens: int, **kwargs: Any
    ) -> "KVCacheBlocks | None":
        """KVCacheManager.allocate_slots; None for an async load whose blocks would
        leave fewer free than those in flight still need."""
        if not kwargs["delay_cache_blocks"]:  # true for an async load only
            return self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, **kwargs
            )
        # Admitted into blocks a load in flight needs after its transfer, the loads
        # park one another, with nothing running to preempt: a deadlock (vllm#45388).
        reserved = self._blocks_reserved_in_flight()
        if reserved and self._blocks_admitted(request, num_new_tokens, kwargs) > (
            self.kv_cache_manager.block_pool.get_num_free_blocks() - reserved
        ):
            return None
        blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, **kwargs)
        if blocks is not None:
            self._async_loads |= {request}
        return blocks

    def _blocks_admitted(
        self, request: "Request", num_new_tokens: int, allocation: dict[str, Any]
    ) -> int:
        """The blocks allocate_slots takes for ``request`` with these arguments."""
        computed = min(
            request.num_computed_tokens
            + allocation.get("num_new_computed_tokens", 0)
            + allocation.get("num_external_computed_tokens", 0),
            self.max_model_len,
        )
        new_computed = allocation.get("new_computed_blocks")
        if new_computed is None:
            new_computed = self.kv_cache_manager.empty_kv_cache_blocks
        return self.kv_cache_manager.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id,
            num_tokens=min(
                computed + num_new_tokens + allocation.get("num_lookahead_tokens", 0),
                self.max_model_len,
            ),
            new_computed_blocks=new_computed.blocks,
            num_encoder_tokens=allocation.get("num_encoder_tokens", 0),
            total_computed_tokens=computed,
            num_tokens_main_model=computed + num_new_tokens,
        )


@amend("F26", ">=0.18.0")
class Scheduler:
    @call_at_end_of("add_request")
    def _finish_kv_transfer_rejection(self, request: "Request") -> None:
        """A rejection notice is finished as it is added: never scheduled, it makes the
        KV connector free what its remote prefill holds (NIXL notifies the producer
        with an empty receive)."""
        if KVTransferRejection.is_notice(request):
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
