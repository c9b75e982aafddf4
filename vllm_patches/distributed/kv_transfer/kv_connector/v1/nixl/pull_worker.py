# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py``.

NIXL producer release path, pull-specific methods of F2 and F3; their state lives in
``nixl/base_worker.py``.
"""

from __future__ import annotations

from vllm_patches._overlay import (
    amend,
    call_at_end_of,
    filter_call_in,
    filter_result_of,
    guard_branch_in,
    redirect_call_in,
)


@amend("F2", ">=0.24.0,<0.29.0")
@amend("F2", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F2", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlPullConnectorWorker:
    """F2: the notification counters, up to v0.28."""

    def _forget_sent_req(self, req_id: str) -> None:
        """Drop a request whose KV this worker no longer holds from its bookkeeping."""
        self._reqs_to_process.discard(req_id)
        self._reqs_to_send.pop(req_id, None)
        self.consumer_notification_counts_by_req.pop(req_id, None)


@amend("F2", ">=0.24.0,<0.29.0")
@amend("F2", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
class NixlPullConnectorWorker:
    """F2: notifications per decode reader, v0.20 - v0.28 (from the decoder's TP)."""

    def _notifications_per_reader(self, tp_size: int) -> int:
        """How many notifications one decode request sends this worker: one per
        decode rank reading from it (what _get_new_notifs waits for)."""
        assert self.transfer_topo is not None
        tp_ratio = self.transfer_topo.tp_ratio(tp_size)
        return -tp_ratio if tp_size > self.world_size else 1


@amend("F2", ">=0.29.0")
class NixlPullConnectorWorker:
    """F2: the notification counters, from v0.29 (expected count in the notification)."""

    def _forget_sent_req(self, req_id: str) -> None:
        """Drop a request whose KV this worker no longer holds from its bookkeeping."""
        self._reqs_to_process.discard(req_id)
        self._reqs_to_send.pop(req_id, None)
        self.consumer_notification_counts_by_req.pop(req_id, None)
        self.expected_consumer_notifications_by_req.pop(req_id, None)

    def _notifications_per_reader(self, expected_consumers: int) -> int:
        """How many notifications one decode request sends this worker: the
        decoder writes it into each notification."""
        return expected_consumers


@amend("F2", ">=0.24.0")
@amend("F2", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F2", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlPullConnectorWorker:
    """F2: hooks into start_load_kv and _get_new_notifs (every layout)."""

    # Whether the notifications of the current _get_new_notifs name a request
    # shaped like a sibling (vLLM's own request ids hold no "_"): set by
    # _sibling_reads, read by _release_pulled_siblings. The class default serves
    # workers built without __init__ (upstream's tests build some).
    _siblings_notified = False

    @filter_call_in("_get_new_notifs", "self.nixl_wrapper.get_new_notifs")
    def _sibling_reads(self, notifs: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        """Hold back a parallel-sampling sibling's notifications until every decode
        child reading it notified. One search of the joined messages when none names a
        sibling."""
        siblings = getattr(self, "_best_of_siblings", None)
        self._siblings_notified = (
            siblings is not None
            and siblings.enabled
            and any(b"_" in b"".join(messages) for messages in notifs.values())
        )
        if not self._siblings_notified:
            return notifs
        return {
            agent: [notif for notif in messages if not self._holds_back(notif)]
            for agent, messages in notifs.items()
        }

    @call_at_end_of("start_load_kv")
    def _settle_producer_registrations(self, metadata: NixlConnectorMetadata) -> None:
        """Release what the requests registered by ``start_load_kv`` made releasable.

        Runs whenever ``start_load_kv`` returns; costs O(requests in ``metadata``).
        """
        if not (
            metadata.reqs_in_batch
            or metadata.reqs_to_send
            or metadata.reqs_not_processed
        ):
            return
        self._release_late_best_of_siblings(metadata)

    @filter_result_of("_get_new_notifs")
    def _release_pulled_siblings(self, notified_req_ids: set[str]) -> set[str]:
        """Add to the requests ``_get_new_notifs`` releases those released with them
        (``_add_released_with_pulls``)."""
        return self._add_released_with_pulls(notified_req_ids)

    def _add_released_with_pulls(self, notified_req_ids: set[str]) -> set[str]:
        """Add to the requests upstream's loop in ``_get_new_notifs`` released by
        their pull their parallel-sampling siblings (the KV a decoder pulled is
        theirs too) and the requests ``start_load_kv`` released when they
        registered."""
        # What _get_new_notifs released it released by the notifications
        # _sibling_reads saw: no sibling among them unless those named one.
        if self._siblings_notified:
            pulled = [req_id for req_id in notified_req_ids if "_" in req_id]
            for req_id in pulled:
                notified_req_ids |= self._release_best_of_siblings(
                    req_id, notified_req_ids
                )
        if self._released_at_registration:
            notified_req_ids |= self._pop_released_at_registration()
        return notified_req_ids


@amend("F2", ">=0.24.0")
@amend("F2", ">=0.22.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
class NixlPullConnectorWorker:
    """F2: siblings share the advertised sibling's lease (v0.22+, lease heartbeats)."""

    @redirect_call_in("_get_new_notifs", "self._handle_heartbeat")
    def _heartbeat_with_siblings(self, payload: str) -> None:
        """Renew the leases a heartbeat names and, with a renewed sibling, its
        registered siblings: no sibling's lease ends before the advertised one's, and
        all expire together when the decoder stops heartbeating."""
        self._handle_heartbeat(payload)
        siblings = getattr(self, "_best_of_siblings", None)
        if siblings is None or not siblings.enabled or "_" not in payload:
            return
        leases = self._reqs_to_send
        for req_id in payload.split(","):
            expiry = leases.get(req_id) if "_" in req_id else None
            if expiry is None:
                continue
            for sibling in siblings.others(req_id, leases):
                leases[sibling] = max(leases[sibling], expiry)


@amend("F3", ">=0.24.0")
@amend("F3", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F3", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlPullConnectorWorker:
    """F3: stage notifications on arrival, settle them on registration (every layout)."""

    @guard_branch_in("_get_new_notifs", "logger.error")
    def _is_late_notif(
        self, req_id: str, notif: bytes, notified_req_ids: set[str]
    ) -> bool:
        """Whether upstream's branch for a request it does not hold runs: for a late
        notification only. Others are taken here: a repeat ignored, an early one
        staged."""
        if self._early_notifs.is_late(req_id):
            return True
        expected = self._notifications_per_reader(int(notif.rpartition(b":")[2]))
        self._notif_not_held(req_id, expected, notified_req_ids)
        return False

    def _release_pulled_siblings(self, notified_req_ids: set[str]) -> set[str]:
        """The parallel-sampling filter of what ``_get_new_notifs`` releases, noting
        first what upstream's loop released: requests whose pull completed
        (``_note_pulls``), unlike the siblings and the registrations the filter adds."""
        self._note_pulls(notified_req_ids)
        return self._add_released_with_pulls(notified_req_ids)

    def _settle_producer_registrations(self, metadata: NixlConnectorMetadata) -> None:
        """Release what the requests registered by ``start_load_kv`` made releasable.

        Runs whenever ``start_load_kv`` returns; costs O(requests in ``metadata``).
        """
        if not (
            metadata.reqs_in_batch
            or metadata.reqs_to_send
            or metadata.reqs_not_processed
        ):
            return
        self._settle_early_notifs(metadata)
        self._release_late_best_of_siblings(metadata)
