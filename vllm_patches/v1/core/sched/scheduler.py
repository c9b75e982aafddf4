# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/v1/core/sched/scheduler.py: steps without requests when the KV
connector has something that only a step carries.

F4: a connector whose ``idle_step_wait()`` is due counts as finished work, so an engine
without requests runs one empty step, which carries the workers' reports.
F20: so does a finished request whose blocks the connector still holds, until a
step's report frees them.
"""

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
