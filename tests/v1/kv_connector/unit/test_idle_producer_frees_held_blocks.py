# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An engine keeps stepping while the KV connector holds a finished request's blocks.

A NIXL producer holds a finished prefill's blocks until the decoder's READ is
reported done by a later step. Before upstream PR vllm-project/vllm#43433 (v0.22.0),
an idle producer stopped stepping once the finished request was sent to the
workers, so it neither heard of the READ nor freed the blocks until the next
request arrived. These tests fail on stock v0.18.0 .. v0.21.0 and pass with the fix.
"""

from typing import Any, cast

import pytest

from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from .utils import (
    assert_scheduler_empty,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

# Steps an idle engine may take before the decoder's READ is reported done; the
# report comes in the last of them.
READ_DONE_AT_STEP = 3


def _producer_with_held_prefill():
    """A producer whose only request finished its prefill and was sent to the
    workers as finished, its blocks held for the decoder's READ."""
    vllm_config = create_vllm_config()
    scheduler = create_scheduler(vllm_config)
    block_size = vllm_config.cache_config.block_size
    request = create_request(
        request_id=1,
        block_size=block_size,
        max_tokens=1,
        num_tokens=block_size * 2,
        do_remote_decode=True,
    )
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, create_model_runner_output(reqs=[request]))
    assert request.is_finished()
    # The step that tells the workers the request finished.
    output = scheduler.schedule()
    scheduler.update_from_output(output, EMPTY_MODEL_RUNNER_OUTPUT)
    assert request.request_id in scheduler.requests
    assert not scheduler.has_unfinished_requests()
    return scheduler, request


def test_idle_producer_steps_until_held_blocks_are_freed():
    """The engine's loop condition holds until the READ is reported, then drops."""
    scheduler, request = _producer_with_held_prefill()
    steps = 0
    while scheduler.has_requests() and steps < READ_DONE_AT_STEP:
        steps += 1
        output = scheduler.schedule()
        if steps == READ_DONE_AT_STEP:
            report = create_model_runner_output(
                reqs=[], finished_sending={request.request_id}
            )
        else:
            report = EMPTY_MODEL_RUNNER_OUTPUT
        scheduler.update_from_output(output, report)
    assert steps == READ_DONE_AT_STEP
    assert_scheduler_empty(scheduler)
    assert not scheduler.has_requests()


def test_idle_engine_core_has_work_while_blocks_are_held():
    """EngineCoreProc does not wait for input while a finished request's blocks
    are held: the busy loop steps the engine, which polls the connector."""
    scheduler, _ = _producer_with_held_prefill()
    core = cast(Any, object.__new__(EngineCoreProc))
    core.scheduler = scheduler
    core.engines_running = False
    core.batch_queue = None
    assert core.has_work()
