# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL pull mode with KV leases (v0.22+): a prompt stays held on the producer while
a decoder's READ of it is in flight.

Reproduces a gap in the lease protocol of PR 41383. Heartbeats ride the decoder's
steps, and a READ is one-sided: the producer hears of it only from the READ's own
notification, which NIXL delivers when the transfer completes. A decoder that
posts a READ and then takes no step for longer than the lease extension sends no
heartbeat, so the producer releases, and may reuse, blocks the READ still reads.
The decoder's scheduler now sends, in the step that schedules a READ, a heartbeat
entry that marks it (``read-posted/<remote request id>``), repeated in later
heartbeats, and the producer holds a marked request until the READ's notification
releases it, or ``read_hold_limit`` seconds pass.
"""

import time

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (
    NixlConnectorWorker,
)
from vllm.v1.core.sched.output import SchedulerOutput

from .utils import create_request, create_scheduler, create_vllm_config

pytestmark = pytest.mark.cpu_test

REMOTE_ID = "0_cmpl-prompt-3f2a91c7"
LEASE_EXTENSION = 20  # the producer's, for the default 30 s lease
HOLD_LIMIT = 120  # read_hold_limit's default


def decoder(**extra_config) -> tuple:
    """A decode engine's scheduler with the NIXL connector (default lease: a
    heartbeat interval of 5 s) and its scheduler-side connector."""
    vllm_config = create_vllm_config(kv_connector_extra_config=extra_config)
    scheduler = create_scheduler(vllm_config)
    return scheduler, scheduler.connector.connector_scheduler


def schedule_read(scheduler, request_id: int):
    """Add a request whose prompt a producer holds and schedule it: (the step's
    NIXL connector metadata, which READs the prompt; the remote request id)."""
    block_size = scheduler.cache_config.block_size
    request = create_request(
        request_id=request_id,
        block_size=block_size,
        num_tokens=block_size * 2 + 5,
        do_remote_prefill=True,
    )
    scheduler.add_request(request)
    meta = scheduler.schedule().kv_connector_metadata
    recv = meta.reqs_to_recv[request.request_id]
    assert any(recv.local_block_ids), "the step schedules no READ of the prompt"
    return meta, recv.remote.request_id


def heartbeat_entries(meta) -> set[str]:
    """The entries of the heartbeats a step's metadata sends."""
    return {
        entry for info in meta.heartbeat_by_engine.values() for entry in info.req_ids
    }


def producer_holding(**expiry_from_now: float) -> NixlConnectorWorker:
    """A producer worker holding requests for a decoder, each expiring that many
    seconds from now (built as upstream's heartbeat tests build one)."""
    worker = object.__new__(NixlConnectorWorker)
    now = time.perf_counter()
    worker._reqs_to_send = {
        req_id: now + seconds for req_id, seconds in expiry_from_now.items()
    }
    worker._reqs_to_process = set(expiry_from_now)
    worker._lease_extension = LEASE_EXTENSION
    return worker


def test_decoder_marks_each_read_it_schedules():
    """The step that schedules a READ carries a heartbeat naming the prompt and
    marking it as being READ, even between heartbeat intervals (the worker sends
    the step's heartbeats after posting its READs); later heartbeats repeat the
    mark while the prompt is heartbeated."""
    scheduler, connector = decoder()
    first, first_remote = schedule_read(scheduler, 1)
    assert f"read-posted/{first_remote}" in heartbeat_entries(first)
    # Within the heartbeat interval: upstream sends no heartbeat in this step.
    second, second_remote = schedule_read(scheduler, 2)
    entries = heartbeat_entries(second)
    assert {second_remote, f"read-posted/{second_remote}"} <= entries, (
        f"the step that schedules the READ of {second_remote} sends the producer "
        f"{sorted(entries) or 'no heartbeat'}: a decoder that does not step again "
        f"for longer than the lease extension lets the lease lapse under its READ"
    )
    connector._last_heartbeat_time = 0.0  # the next heartbeat is due
    regular = connector.build_connector_meta(SchedulerOutput.make_empty())
    assert {
        f"read-posted/{first_remote}",
        f"read-posted/{second_remote}",
    } <= heartbeat_entries(regular)
    assert not {
        entry
        for info in connector._heartbeat_by_engine.values()
        for entry in info.req_ids
        if entry.startswith("read-posted/")
    }, "the marks went into the scheduler's own heartbeat bookkeeping"


def test_prompt_held_while_its_read_is_in_flight():
    """A marked request outlives the lease extension (the decoder may send no
    heartbeat until its next step) by the hold limit; an unmarked one in the same
    heartbeat is renewed as upstream renews it. The READ's notification, not the
    clock, then releases the marked one (upstream's count of reads)."""
    worker = producer_holding(**{REMOTE_ID: 5, "other": 5})
    before = time.perf_counter()
    worker._handle_heartbeat(f"{REMOTE_ID},read-posted/{REMOTE_ID},other")
    held_for = worker._reqs_to_send[REMOTE_ID] - before
    assert held_for >= HOLD_LIMIT, (
        f"a request whose READ is in flight is held {held_for:.0f} s, the lease "
        f"extension: a decoder step longer than that frees it under the READ"
    )
    assert worker._reqs_to_send["other"] - before < HOLD_LIMIT


def test_a_longer_lease_is_kept_and_unknown_marks_are_ignored():
    worker = producer_holding(long=HOLD_LIMIT * 2)
    expires = worker._reqs_to_send["long"]
    worker._handle_heartbeat("read-posted/long,read-posted/gone,read-posted/")
    assert worker._reqs_to_send == {"long": expires}


def test_read_hold_limit_zero_turns_both_sides_off():
    scheduler, _ = decoder(read_hold_limit=0)
    meta, remote_id = schedule_read(scheduler, 1)
    assert f"read-posted/{remote_id}" not in heartbeat_entries(meta)
    worker = producer_holding(**{REMOTE_ID: 5})
    worker._read_hold_limit = 0
    before = time.perf_counter()
    worker._handle_heartbeat(f"read-posted/{REMOTE_ID}")
    assert worker._reqs_to_send[REMOTE_ID] - before <= 5
