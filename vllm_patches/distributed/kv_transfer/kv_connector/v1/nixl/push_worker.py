# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py``.

NIXL push mode (v0.24+), worker side:

- F9 (decoder side): each request the step's metadata names in ``push_expired_registrations``
  (its registration timed out on the scheduler) is reported as a failed receive,
  as the worker reports a registration it could not send: up to v0.29 through
  ``_handle_failed_transfer`` (its blocks are invalid and it is done receiving),
  from v0.30 through ``_failed_recv_reqs`` (``failed_recving``).
- F10 (producer side): a heartbeat renews the lease of each held request that
  the registration of the heartbeated id would be paired with: the id itself,
  or else every held request with the same id once the per-engine random suffix
  is stripped (``get_base_request_id``, the key ``_pop_matching_registration``
  and ``_pop_matching_finished_blocks`` use). A push decoder's heartbeats also
  name its own request ids (``nixl/push_scheduler.py``).
"""

from functools import cached_property

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqId,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id
from vllm_patches._overlay import amend, call_at_end_of, redirect_call_in


@amend("F9", ">=0.24.0")
class NixlPushConnectorWorker:
    """F9: a registration the scheduler gave up on is a failed receive."""

    @call_at_end_of("start_load_kv")
    def _fail_expired_registrations(self, metadata: NixlConnectorMetadata) -> None:
        """Report each expired registration this worker is receiving for as a
        failed receive; the scheduler then applies kv_load_failure_policy (or
        frees the blocks of a request already finished)."""
        for req_id in getattr(metadata, "push_expired_registrations", ()):
            if req_id in self._recving_metadata:
                self._fail_expired_receive(req_id)


@amend("F9", ">=0.24.0,<0.30.0")
class NixlPushConnectorWorker:
    """F9: the failed-receive path up to v0.29."""

    def _fail_expired_receive(self, req_id: ReqId) -> None:
        """Mark the request's blocks invalid and report it done receiving."""
        self._handle_failed_transfer(req_id, None)


@amend("F9", ">=0.30.0")
class NixlPushConnectorWorker:
    """F9: the failed-receive path from v0.30."""

    def _fail_expired_receive(self, req_id: ReqId) -> None:
        """Count a failed transfer and report the request in failed_recving."""
        self.xfer_stats.record_failed_transfer()
        self._failed_recv_reqs.put(req_id)


@amend("F10", ">=0.24.0")
class NixlPushConnectorWorker:
    """F10: heartbeats renew the leases their registrations would be served from."""

    @cached_property
    def _renew_push_leases(self) -> bool:
        """kv_connector_extra_config["renew_push_leases"] (default true); a cached
        property, so workers built without __init__ (tests) have it too."""
        config = getattr(self, "kv_transfer_config", None)
        if config is None:
            return True
        return bool(config.get_from_extra_config("renew_push_leases", True))

    @redirect_call_in("_get_new_notifs", "self._handle_heartbeat")
    def _renew_paired_leases(self, payload: str) -> None:
        """Renew, through upstream's _handle_heartbeat, the held requests the
        heartbeat's ids name as a push registration names them.

        In push mode the decoder cannot know the producer's request ids (both
        legs leave the proxy at once), so the remote request id it heartbeats is
        the proxy's X-Request-Id, which names no held request: the lease ran out
        while the decoder, still waiting for a seat, heartbeated it, and the
        registration that followed found the blocks released. A registration is
        paired with a held request by its id, or else by the id without the
        random suffix (get_base_request_id); a heartbeat id now renews exactly
        the requests such a registration could be served from. The heartbeat's
        own ids stay in the payload (upstream renews those held as they are),
        the paired ones are added. O(held requests) per heartbeat, only when one
        of its ids is not held as it is."""
        if self._renew_push_leases:
            paired = self._paired_held_requests(payload.split(","))
            if paired:
                payload = ",".join([payload, *paired])
        self._handle_heartbeat(payload)

    def _paired_held_requests(self, req_ids: list[str]) -> list[str]:
        """The held requests (``_reqs_to_send``) that the ids not held as they
        are pair with by base id, each once, none of the ids themselves."""
        held = self._reqs_to_send
        unheld = [req_id for req_id in req_ids if req_id not in held]
        if not unheld or not held:
            return []
        by_base: dict[str, list[str]] = {}
        for held_id in held:
            by_base.setdefault(get_base_request_id(held_id), []).append(held_id)
        named = set(req_ids)
        paired = (
            held_id
            for req_id in unheld
            for held_id in by_base.get(get_base_request_id(req_id), ())
        )
        return [held_id for held_id in dict.fromkeys(paired) if held_id not in named]
