# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/engine/core.py: an idle engine wakes for the KV
connector's idle steps.

With ``async_register_cache`` the workers' registration reports (ready or failed)
reach the scheduler, and its release order reaches the workers, only with a step.
An engine without requests blocks in _process_input_queue() on its input queue
and never steps, so a failed pin kept every other rank's tier pinned until the
first request. The blocking get is redirected to a get that waits at most until
the connector's next idle step is due; upstream's own ``except queue.Empty:
break`` then leaves the loop and the engine steps (the scheduler's
has_finished_requests() says there is something to send, see
vllm_patches/v1/core/sched/scheduler.py). No upstream method is copied.

From v0.20.0: v0.19.x's engine/core.py is not ruff-formatted under the ruff that
regen checks with (a walrus inside a lambda is laid out otherwise), so no splice
of that file passes; on v0.19.x reports still wait for a step, as before.
"""

from vllm_patches._overlay import amend, redirect_call_in


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
