# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``.

NIXL consumer (decode) scheduler side, heartbeats (KV leases, from v0.22):

- F6: the children of a parallel-sampling request (``n > 1``) each carry the
  prefill's ``kv_transfer_params``, so all of them name one remote request, which
  the heartbeats keep once (a set per remote engine). Upstream drops it from the
  heartbeats when the first child stops (its KV arrived, or it finished) while
  the others still wait to read; a count of the tracked requests per remote
  request keeps it until the last one stops.

From v0.24 ``NixlBaseConnectorScheduler``, shared by the pull and push
schedulers; v0.22 - v0.23 ``NixlConnectorScheduler`` in ``nixl/scheduler.py``
(``into=``). Upstream methods are changed through hooks only.
"""

from collections import Counter
from functools import cached_property
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.utils import EngineId
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import ReqId
from vllm_patches._overlay import amend, call_at_end_of, filter_call_in

if TYPE_CHECKING:
    from vllm.v1.request import Request


@amend("F6", ">=0.24.0")
@amend("F6", ">=0.22.0,<0.24.0", into="scheduler.py", name="NixlConnectorScheduler")
class NixlBaseConnectorScheduler:
    """F6: a remote request stays in the heartbeats while any request needs it."""

    @cached_property
    def _heartbeat_holders(self) -> Counter[tuple[EngineId, ReqId]]:
        """How many tracked requests need the heartbeat of each remote request, by
        (remote engine id, remote request id): one per request, and n for the n
        children of a parallel-sampling request. Made on first use, so that
        schedulers built without __init__ (tests) have it too."""
        return Counter()

    @call_at_end_of("on_new_request")
    def _hold_heartbeat(self, request: "Request") -> None:
        """Count the request when on_new_request started tracking it."""
        key = self._heartbeat_req_engine.get(request.request_id)
        if key is not None:
            self._heartbeat_holders[key] += 1

    @filter_call_in("_stop_heartbeat", "self._heartbeat_req_engine.pop")
    def _last_heartbeat_holder(
        self, key: tuple[EngineId, ReqId] | None
    ) -> tuple[EngineId, ReqId] | None:
        """The remote request of a request that stops heartbeating (its KV arrived,
        or it finished or was aborted), passed on to upstream's removal only when
        no other tracked request needs it. The remote request id so stays in the
        heartbeats while any child of its prompt still waits to read, and leaves
        with the last one: a prompt nobody needs any more is not renewed, and its
        lease on the producer expires. O(1)."""
        if key is None:
            return None
        holders = self._heartbeat_holders
        holders[key] -= 1
        if holders[key] > 0:
            return None
        del holders[key]
        return key
