# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a producer reports a push done once its WRITEs completed.

A push producer holds a prompt's blocks under a KV lease until its WRITEs to the
decoder complete; get_transfer_results polls their handles. Since PR 56104
returns failed requests apart from that poll, v0.30.0 reports a completed WRITE
done only for a request in _recving_metadata, which a producer never has for
what it pushes: every pushed prompt was held until its lease ran out ("Releasing
expired KV blocks ... retrieved by 0 remote worker(s)"). PR 58188 restores the
report (v0.31.0). A failed send is still never reported done.

These tests drive upstream's stub push worker (test_nixl_push_connector.py),
whose NIXL agent reports each WRITE handle in the state the test lists.
"""

import time
from typing import Any

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

from . import test_nixl_push_connector as push_suite

pytestmark = pytest.mark.cpu_test

PROMPT = "cmpl-push-done-0-aaaaaaaa"
LEASE = 30


def producer(writes: int) -> Any:
    """A push producer's worker holding PROMPT under its lease, with a WRITE of it
    posted to each of ``writes`` decoder ranks."""
    worker = push_suite.TestPushWriterNotifs._pollable_worker()
    # Read when a lease runs out; upstream's stub has it from v0.31 only.
    worker.expected_consumer_notifications_by_req = {}
    worker._reqs_to_process.add(PROMPT)
    worker._reqs_to_send[PROMPT] = time.perf_counter() + LEASE
    worker._sending_transfers[PROMPT] = [f"write-{rank}" for rank in range(writes)]
    return worker


def finished(worker: Any) -> set[str]:
    return worker.get_transfer_results().finished_sending


@pytest.mark.parametrize("writes", [1, 2])
def test_completed_push_is_reported_done(writes):
    """The poll that sees the last WRITE complete reports the prompt done sending
    (its blocks are freed), once, without its lease running out; with two decoder
    ranks the first WRITE completes a poll before the second."""
    worker = producer(writes)
    states = ["DONE"] if writes == 1 else ["DONE", "PROC", "DONE"]
    worker.nixl_wrapper.check_xfer_state.side_effect = states
    if writes > 1:
        assert finished(worker) == set()
        assert PROMPT in worker._reqs_to_send
    assert PROMPT in finished(worker), (
        "a push whose WRITEs all completed was not reported done sending"
    )
    assert PROMPT not in worker._reqs_to_send
    assert PROMPT not in worker._reqs_to_process
    worker.xfer_stats.record_kv_expired_req.assert_not_called()
    assert worker._evict_finished_inbox.get_nowait() == PROMPT
    assert finished(worker) == set()
    assert worker._evict_finished_inbox.empty()


def fail_to_post_a_write(worker: Any) -> None:
    """The WRITE to one decoder rank fails as it is posted (_xfer_blocks)."""
    worker.transfer_topo.block_size_ratio.return_value = 1
    worker._apply_prefix_caching = lambda **kwargs: ([[1]], [[1]])
    worker._compute_desc_ids = lambda **kwargs: [0]
    worker.dst_num_blocks = {worker.engine_id: 8}
    worker.dst_region_num_blocks[worker.engine_id] = [8]
    worker.dst_region_group_ids[worker.engine_id] = [0]
    worker.dst_uses_region_group_mapping[worker.engine_id] = False
    worker.nixl_wrapper.transfer.side_effect = RuntimeError("submit")
    handle = worker._xfer_blocks(
        read_spec=ReadSpec(0, [[1]], [[1]]),
        dst_engine_id=worker.engine_id,
        request_id=PROMPT,
        remote_request_id="cmpl-push-done-0-bbbbbbbb",
        local_xfer_side_handle=1,
        remote_xfer_side_handle=2,
    )
    assert handle is None


@pytest.mark.parametrize("failed", ["polled", "posting"])
def test_failed_push_is_left_to_its_lease(failed):
    """A WRITE fails (NIXL reports it, or it could not be posted) and the WRITE to
    the other decoder rank completes, later: the prompt is not reported done
    until its lease runs out."""
    if failed == "polled":
        worker = producer(2)
        worker.nixl_wrapper.check_xfer_state.side_effect = ["ERR", "PROC", "DONE"]
        assert finished(worker) == set()
    else:
        worker = producer(1)
        fail_to_post_a_write(worker)
        worker.nixl_wrapper.check_xfer_state.side_effect = ["DONE"]
    assert finished(worker) == set(), "a failed push was reported done sending"
    assert PROMPT not in worker._sending_transfers
    assert PROMPT in worker._reqs_to_send
    worker._reqs_to_send[PROMPT] = time.perf_counter() - 1
    assert finished(worker) == {PROMPT}
    assert finished(worker) == set()


def test_push_completed_after_release_is_not_reported_again():
    """A WRITE that completes after its prompt was released (its lease ran out)
    does not report the prompt done a second time."""
    worker = producer(1)
    worker.nixl_wrapper.check_xfer_state.side_effect = ["PROC", "DONE"]
    assert finished(worker) == set()
    del worker._reqs_to_send[PROMPT]
    worker._reqs_to_process.discard(PROMPT)
    assert finished(worker) == set()
    assert PROMPT not in worker._sending_transfers
