# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py``.

NIXL push mode (v0.24+), decoder worker side:

- F9: each request the step's metadata names in ``push_expired_registrations``
  (its registration timed out on the scheduler) is reported as a failed receive,
  as the worker reports a registration it could not send: up to v0.29 through
  ``_handle_failed_transfer`` (its blocks are invalid and it is done receiving),
  from v0.30 through ``_failed_recv_reqs`` (``failed_recving``).
"""

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqId,
)
from vllm_patches._overlay import amend, call_at_end_of


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
