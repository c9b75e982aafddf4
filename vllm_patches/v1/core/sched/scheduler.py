# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/core/sched/scheduler.py: a step without requests when the
KV connector has something that only a step carries.

A connector whose ``idle_step_wait()`` is due counts as finished work, so an engine
without requests runs one empty step, which carries the workers' reports.
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
