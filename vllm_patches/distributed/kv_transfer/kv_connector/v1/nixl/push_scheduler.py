# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py``.

NIXL push mode (v0.24+), decoder scheduler side:

- F9: a registration that the watchdog gives up on (``push_registration_timeout``)
  is a failed receive: ``build_connector_meta`` names it in the step's metadata
  (``push_expired_registrations``, ``nixl/metadata.py``) and the push workers
  report it through upstream's failed-receive path (``nixl/push_worker.py``), so
  that the scheduler applies ``kv_load_failure_policy`` and frees the blocks. A
  request aborted while its registration waits keeps its watchdog, so that its
  blocks, which the scheduler holds until the receive ends, are freed too.
"""

from functools import cached_property

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqId,
)
from vllm_patches._overlay import amend, filter_result_of, redirect_call_in


@amend("F9", ">=0.24.0")
class NixlPushConnectorScheduler:
    """F9: an unserved registration ends as a failed receive."""

    @cached_property
    def _report_expired_registrations(self) -> bool:
        """kv_connector_extra_config["fail_expired_push_registrations"] (default
        true); a cached property, so schedulers built without __init__ (tests)
        have it too."""
        vllm_config = getattr(self, "vllm_config", None)
        config = getattr(vllm_config, "kv_transfer_config", None)
        if config is None:
            return True
        return bool(
            config.get_from_extra_config("fail_expired_push_registrations", True)
        )

    @cached_property
    def _push_expired_registrations(self) -> set[ReqId]:
        """Requests whose registration the watchdog gave up on since the last
        metadata was built."""
        return set()

    @redirect_call_in("build_connector_meta", "self._push_registration_deadlines.pop")
    def _expire_push_registration(
        self, req_id: ReqId, default: float | None = None
    ) -> float | None:
        """The watchdog gives up on ``req_id``'s registration: the push cannot
        be relied on any more, so the request's receive is reported failed."""
        if self._report_expired_registrations:
            self._push_expired_registrations.add(req_id)
        return self._push_registration_deadlines.pop(req_id, default)

    @filter_result_of("build_connector_meta")
    def _with_expired_registrations(
        self, meta: KVConnectorMetadata
    ) -> KVConnectorMetadata:
        """The step's metadata names the expired registrations for the workers."""
        if self._push_expired_registrations:
            assert isinstance(meta, NixlConnectorMetadata)
            meta.push_expired_registrations = set(self._push_expired_registrations)
            self._push_expired_registrations.clear()
        return meta

    @redirect_call_in("request_finished", "self._push_registration_deadlines.pop")
    def _keep_watchdog_of_unserved(
        self, req_id: ReqId, default: float | None = None
    ) -> float | None:
        """A request that finishes with its deadline armed was aborted before its
        push completed (the completion clears the deadline): the scheduler holds
        its blocks until the workers report the receive done, which only the push
        or the watchdog can now cause. Keep the deadline so that the watchdog
        ends the receive; upstream drops it, and the blocks stay held."""
        if self._report_expired_registrations:
            return self._push_registration_deadlines.get(req_id, default)
        return self._push_registration_deadlines.pop(req_id, default)
