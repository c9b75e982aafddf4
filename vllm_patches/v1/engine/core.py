# SPDX-License-Identifier: Apache-2.0
"""Overlay of vllm/v1/engine/core.py. From v0.20.0: v0.19.x's engine/core.py is not
ruff-formatted under regen's ruff, so no splice passes.

F4: an idle engine wakes for the KV connector's idle steps. The blocking get of
_process_input_queue() waits at most until the connector's idle step is due, so that
the workers' reports travel without traffic.
F20: an engine stepping only for blocks the KV connector holds pauses between steps.
"""

from vllm_patches._overlay import amend, filter_call_in, redirect_call_in


@amend("F4", ">=0.20.0")
class EngineCoreProc:
    @redirect_call_in("_process_input_queue", "self.input_queue.get")
    def _get_input_or_idle_step(self, block: bool = True, timeout: float | None = None):
        """Upstream's ``self.input_queue.get``; while the scheduler's KV connector
        waits for an idle step (``idle_step_wait``: seconds until it is due, None
        when it needs none), a blocking get waits at most that long and then
        raises queue.Empty, which makes the busy loop step the engine."""
        connector = self.scheduler.get_kv_connector()
        idle_step_wait = getattr(connector, "idle_step_wait", None)
        wait = idle_step_wait() if block and idle_step_wait is not None else None
        if wait is None:
            return self.input_queue.get(block=block, timeout=timeout)
        if timeout is not None:
            wait = min(wait, timeout)
        return self.input_queue.get(block=True, timeout=max(wait, 0.0))


@amend("F20", ">=0.20.0")
class EngineCoreProc:
    @filter_call_in("_process_engine_step", "self.scheduler.has_unfinished_requests")
    def _or_held_blocks(self, unfinished: bool) -> bool:
        """Upstream's condition for the short sleep after a step that ran no model,
        widened to every request the scheduler keeps, those whose blocks the KV
        connector holds included: such steps only poll the connector, and without
        the sleep they would spin and starve its background threads."""
        return unfinished or self.scheduler.has_requests()
