# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/core/sched/scheduler.py: a step without requests when the
KV connector has something that only a step carries.

EngineCore steps only while the scheduler has_requests(); a KV connector with an
``idle_step_wait()`` (SimpleCPUOffloadConnector with ``async_register_cache``,
until every worker's registration report arrived and, after a failure, the
release order went out) counts as finished work once its idle step is due, so an
engine without traffic still runs one empty step: schedule() builds the
connector's metadata, the workers bind it and report through
kv_connector_no_forward(), and update_from_output() hands the reports back.
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
