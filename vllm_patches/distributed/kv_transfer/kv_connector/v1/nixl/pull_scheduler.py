# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``.

F7: a READ only while the decoder can vouch that the producer holds the remote prompt;
past that bound, 0 tokens, and neither a notification nor heartbeats for the request,
also one that ends before it was scheduled. With KV leases (v0.22+) the bound is kept
in ``nixl/base_scheduler.py``; before, against the producer's fixed timeout, it is a
request's arrival plus half that timeout (``nixl/scheduler.py``, ``nixl_connector.py``
up to v0.19).
"""

import math
import time
from typing import TYPE_CHECKING, Any

from vllm import envs

from vllm_patches._overlay import (
    amend,
    call_at_end_of,
    filter_result_of,
    redirect_call_in,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request


@amend("F7", ">=0.24.0")
@amend("F7", ">=0.22.0,<0.24.0", into="scheduler.py", name="NixlConnectorScheduler")
class NixlPullConnectorScheduler:
    """F7: no READ of a prompt whose lease may have lapsed on the producer."""

    @filter_result_of("get_num_new_matched_tokens")
    def _unless_lease_lapsed(
        self, answer: tuple[int, bool], request: "Request"
    ) -> tuple[int, bool]:
        """The answer for ``request``, or 0 external tokens for a READ of a prompt whose
        lease the decoder can no longer vouch for: the prompt is computed locally and
        the request sends the producer nothing more (_notify_nothing_after_lapse).
        One WARNING per prompt."""
        num_tokens, load_async = answer
        params = request.kv_transfer_params
        if not load_async or not num_tokens or not params:
            return answer
        if not params.get("do_remote_prefill"):
            return answer
        key = (
            str(params.get("remote_engine_id")),
            str(params.get("remote_request_id")),
        )
        if not self._lease_may_have_lapsed(key):
            return answer
        until = self._lease_vouched_until[key]
        if until > -math.inf:
            logger.warning(
                "Not reading the KV of remote request %s for request %s: no "
                "heartbeat renewed its lease on the producer in time (%.1f s past "
                "what the decoder can vouch for), so the producer may have "
                "released its blocks. Computing the prompt locally.",
                key[1],
                request.request_id,
                time.perf_counter() - until,
            )
            self._lease_vouched_until[key] = -math.inf
        return 0, False

    @call_at_end_of("update_state_after_alloc")
    def _notify_nothing_after_lapse(
        self, request: "Request", num_external_tokens: int
    ) -> None:
        """A request that computes a prompt whose lease may have lapsed (also one that
        takes it from the prefix cache after a sibling computed it) sends the producer
        no notification, which would name blocks the producer may have freed, and no
        more heartbeats: the producer's lease frees the prompt."""
        if num_external_tokens or not self._request_lease_may_have_lapsed(
            request.request_id
        ):
            return
        self._reqs_need_recv.pop(request.request_id, None)
        self._stop_heartbeat(request.request_id)

    @redirect_call_in("request_finished", "self._stop_heartbeat")
    def _stop_heartbeat_noting_lapse(self, req_id: str) -> None:
        """Upstream's stop, after noting a request whose prompt may have lapsed
        (the stop of a prompt's last request forgets its bound): the next metadata
        drops the empty receive it stages if it ends unscheduled."""
        if self._request_lease_may_have_lapsed(req_id):
            self._left_after_lapse.add(req_id)
        self._stop_heartbeat(req_id)


@amend("F7", ">=0.20.0,<0.22.0", into="scheduler.py", name="NixlConnectorScheduler")
@amend(
    "F7", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorScheduler"
)
class NixlPullConnectorScheduler:
    """F7 before v0.22: no READ of a prompt the producer may have freed by its fixed
    timeout, which nothing renews; judged per request from its arrival, no state."""

    def _timeout_vouch_window(self) -> float | None:
        """Seconds after a decode request's arrival at the front end that the producer
        surely holds its prompt: half of VLLM_NIXL_ABORT_REQUEST_TIMEOUT, which the
        producer counts from the prefill's end (the other half covers the proxy's hop
        and the READ); both sides are assumed to share it. None when
        recompute_after_lapsed_lease is off."""
        if not self._recomputes_after_lapsed_lease():
            return None
        return envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT / 2

    def _past_timeout_bound(self, request: "Request") -> bool:
        """Whether the producer may have freed the prompt decode request ``request``
        reads by timeout. Counted from the front end's arrival stamp (time.time(), same
        host): a busy or stalled engine core takes no input."""
        window = self._timeout_vouch_window()
        if window is None or (request.kv_transfer_params or {}).get("do_remote_decode"):
            return False
        return time.time() - request.arrival_time > window

    @filter_result_of("get_num_new_matched_tokens")
    def _unless_timeout_may_have_passed(
        self, answer: tuple[int, bool], request: "Request"
    ) -> tuple[int, bool]:
        """The answer for ``request``, or 0 external tokens for a READ past the bound:
        the prompt is computed locally, and the request is marked done with the
        producer as upstream marks one after its transfer (do_remote_prefill false), so
        it notifies nothing. One WARNING per request."""
        num_tokens, load_async = answer
        params = request.kv_transfer_params
        if not (
            load_async and num_tokens and params and params.get("do_remote_prefill")
        ):
            return answer
        if not self._past_timeout_bound(request):
            return answer
        logger.warning(
            "Not reading the KV of remote request %s for request %s: it arrived %.1f s "
            "ago, past half of VLLM_NIXL_ABORT_REQUEST_TIMEOUT (%d s), so the producer "
            "may have released its blocks. Computing the prompt locally.",
            params.get("remote_request_id"),
            request.request_id,
            time.time() - request.arrival_time,
            envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT,
        )
        params["do_remote_prefill"] = False
        return 0, False

    @redirect_call_in("build_connector_meta", "self._reqs_need_recv.items")
    def _receives_in_time(self) -> list[tuple[str, tuple["Request", Any]]]:
        """The step's receives, less each empty one (a notification only: a full
        prefix hit, a request that ended unscheduled, a sibling F5 releases) of a
        request past the bound: it would name blocks the producer may have freed
        ("Potentially invalid KV blocks"); the timeout frees the prompt."""
        return [
            (req_id, (request, block_ids))
            for req_id, (request, block_ids) in self._reqs_need_recv.items()
            if any(block_ids) or not self._past_timeout_bound(request)
        ]
