# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/v1/core/sched/scheduler.py: steps without requests when the KV
connector has something that only a step carries.

F4: a connector whose ``idle_step_wait()`` is due counts as finished work, so an engine
without requests runs one empty step, which carries the workers' reports.
F20: so does a finished request whose blocks the connector still holds, until a
step's report frees them.
F24 (v0.30): an async KV load is admitted only with room for the first speculative
step of every load in flight and its own (PR 57104, in v0.31).
"""

from vllm.utils.math_utils import cdiv

from vllm_patches._overlay import amend, filter_result_of


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
