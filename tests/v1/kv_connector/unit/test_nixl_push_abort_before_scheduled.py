# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a decode request that finishes before it is scheduled must
not end the decoder's engine.

A push proxy sends the decode leg with the producer's coordinates and no
``remote_block_ids`` (the producer learns the decoder's blocks from its
registration). When such a request finishes before it is scheduled (its client
left while it waited for a seat or for KV space), request_finished stages an
empty receive so that the producer can release the prompt, and the next
schedule() built its metadata with ``kv_transfer_params["remote_block_ids"]``:
KeyError, which the EngineCore reports as a fatal error. Upstream seeds the key
from v0.26.0; v0.24.0 .. v0.25.1 crash.

These tests drive a push decoder's scheduler only: the crash is on the
scheduler's side, before any worker sees the step.
"""

from typing import Any

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from vllm.v1.request import Request, RequestStatus

from .nixl_harness import push_decode_leg
from .utils import create_scheduler, create_vllm_config

pytestmark = pytest.mark.cpu_test

NUM_TOKENS = 100
# Too few blocks for one prompt: a decode request waits for KV space.
WAITING_BLOCKS = 5
ROOMY_BLOCKS = 64
PRODUCER_ENGINE = "producer-engine"


def make_decoder(num_blocks: int) -> Any:
    vllm_config = create_vllm_config(kv_connector="NixlPushConnector")
    return create_scheduler(vllm_config, num_blocks=num_blocks)


def add_decode_leg(scheduler: Any, req_id: str) -> Request:
    """A decode leg as a push proxy sends it, of PRODUCER_ENGINE's prompt."""
    remote = {
        "remote_engine_id": PRODUCER_ENGINE,
        "remote_request_id": "push-abort",
        "remote_port": 5600,
    }
    block_size = scheduler.cache_config.block_size
    request = push_decode_leg(block_size, NUM_TOKENS, req_id, remote)
    scheduler.add_request(request)
    return request


@pytest.mark.parametrize("waited", ["for_kv_space", "not_at_all"])
def test_decode_leg_aborted_before_scheduled_keeps_the_engine(waited):
    """The abort stages the empty receive; the next step schedules without an
    error and names the receive, with no blocks, for the worker."""
    if waited == "for_kv_space":
        scheduler = make_decoder(WAITING_BLOCKS)
        request = add_decode_leg(scheduler, "0_cmpl-push-abort-0-0badcafe")
        output = scheduler.schedule()
        assert not output.num_scheduled_tokens, "the decoder had room after all"
        assert request.status == RequestStatus.WAITING
    else:
        scheduler = make_decoder(ROOMY_BLOCKS)
        request = add_decode_leg(scheduler, "0_cmpl-push-abort-0-0badcafe")

    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()

    metadata = output.kv_connector_metadata
    assert isinstance(metadata, NixlConnectorMetadata)
    receive = metadata.reqs_to_recv[request.request_id]
    assert all(not group for group in receive.local_block_ids)
    assert request.request_id not in scheduler.requests


def test_other_requests_go_on_after_the_abort():
    """A request that arrived beside the aborted one is scheduled and
    registers as before."""
    scheduler = make_decoder(ROOMY_BLOCKS)
    gone = add_decode_leg(scheduler, "0_cmpl-push-abort-0-0badcafe")
    scheduler.finish_requests(gone.request_id, RequestStatus.FINISHED_ABORTED)
    staying = add_decode_leg(scheduler, "1_cmpl-push-abort-0-0badcafe")

    scheduler.schedule()

    assert staying.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert staying.kv_transfer_params is not None
    assert staying.kv_transfer_params["remote_block_ids"] == ()
