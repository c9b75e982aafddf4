# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py``.

NIXL producer (prefill) release path, vllm PR 43509:

- F2: a decode engine reads the one parallel-sampling sibling (``n > 1``) it was
  told about once per child: hold that sibling until all its reads are in, then
  release it with the siblings registered with it; siblings that register
  later are released when they register (``BestOfSiblings``).
- F3: a pull notification that arrives before ``start_load_kv`` registered the
  request is staged and applied at registration instead of being dropped
  (``EarlyPullNotifications``).

Only the pull-specific methods live here; state and helpers are added to
``NixlBaseConnectorWorker`` (``nixl/base_worker.py``). Each changed upstream
method has one partial class per range in which its upstream text is the
same.
"""

from __future__ import annotations

from vllm_patches._overlay import amend, call_at_end_of, filter_call_in, filter_result_of


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


@amend("F2", ">=0.29.0,<0.34.0")
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


@amend("F2", ">=0.24.0,<0.34.0")
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
        """Hold back the notifications of a parallel-sampling sibling's reads
        until every decode child reading it has notified (``_holds_back``).

        Sees the NIXL notifications before _get_new_notifs counts them; costs
        one search of the joined messages when none names a sibling.
        """
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
        """Add to the requests ``_get_new_notifs`` releases their parallel-sampling
        siblings (the KV a decoder pulled is theirs too) and the requests
        ``start_load_kv`` released when they registered."""
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


@amend("F3", ">=0.24.0,<0.34.0")
@amend("F3", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F3", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlPullConnectorWorker:
    """F3: settle staged notifications on registration (every layout)."""

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


@amend("F3", ">=0.24.0,<0.29.0")
class NixlPullConnectorWorker:
    """F3: _get_new_notifs, the text of v0.28.0."""

    def _get_new_notifs(self) -> set[str]:
        """
        Get req_ids which got a remote xfer message. When multiple consumers
        are reading from the same producer (heterogeneous TP scenario), wait
        for all consumers to be done pulling.

        Also handles heartbeat notifications ("HB:req1,req2,...") by
        extending the lease on the referenced requests.
        """
        assert self.transfer_topo is not None
        notified_req_ids: set[str] = set()
        for notifs in self._sibling_reads(self.nixl_wrapper.get_new_notifs()).values():
            for notif in notifs:
                msg = notif.decode("utf-8")

                # Handle heartbeat messages from D-side.
                if msg.startswith("HB:"):
                    self._handle_heartbeat(msg[3:])
                    continue

                req_id, tp_size = msg.rsplit(":", 1)
                # NOTE: `tp_ratio` is the opposite when swapping local<>remote
                n_consumers = int(tp_size)
                tp_ratio = self.transfer_topo.tp_ratio(n_consumers)

                # Number of reads *per producer* to wait for.
                # When remote D TP > local P TP we expect `tp_ratio` reads.
                consumers_per_producer = (
                    -tp_ratio if n_consumers > self.world_size else 1
                )

                if (
                    req_id not in self._reqs_to_send
                    and req_id not in self._reqs_to_process
                ):
                    if not self._early_notifs.is_late(req_id):
                        # The pull raced start_load_kv (staged until the request
                        # registers to send) or repeats a completed one.
                        self._notif_not_held(
                            req_id, consumers_per_producer, notified_req_ids
                        )
                        continue
                    logger.error(
                        "Potentially invalid KV blocks for "
                        "unrecognized request %s were retrieved by "
                        "a decode worker. They may have expired.",
                        req_id,
                    )
                    continue

                self.consumer_notification_counts_by_req[req_id] += 1
                # Wait all consumers (D) to be done reading before freeing.
                if (
                    self.consumer_notification_counts_by_req[req_id]
                    == consumers_per_producer
                ):
                    notified_req_ids.add(req_id)
                    del self.consumer_notification_counts_by_req[req_id]
                    self._reqs_to_process.remove(req_id)
                    self._reqs_to_send.pop(req_id, None)
        self._note_pulls(notified_req_ids)
        return self._release_pulled_siblings(notified_req_ids)


@amend("F3", ">=0.29.0,<0.31.0")
class NixlPullConnectorWorker:
    """F3: _get_new_notifs, the text of v0.30.0."""

    def _get_new_notifs(self) -> set[str]:
        """
        Get req_ids which got a remote xfer message. When multiple consumers
        are reading from the same producer (heterogeneous TP or DCP
        scenario), wait for all consumers to be done pulling.

        Also handles heartbeat notifications ("HB:req1,req2,...") by
        extending the lease on the referenced requests.
        """
        assert self.transfer_topo is not None
        notified_req_ids: set[str] = set()
        for notifs in self._sibling_reads(self.nixl_wrapper.get_new_notifs()).values():
            for notif in notifs:
                msg = notif.decode("utf-8")

                # Handle heartbeat messages from D-side.
                if msg.startswith("HB:"):
                    self._handle_heartbeat(msg[3:])
                    continue

                req_id, expected_consumers = msg.rsplit(":", 1)
                if (
                    req_id not in self._reqs_to_send
                    and req_id not in self._reqs_to_process
                ):
                    if not self._early_notifs.is_late(req_id):
                        # The pull raced start_load_kv (staged until the request
                        # registers to send) or repeats a completed one.
                        self._notif_not_held(
                            req_id, int(expected_consumers), notified_req_ids
                        )
                        continue
                    logger.error(
                        "Potentially invalid KV blocks for "
                        "unrecognized request %s were retrieved by "
                        "a decode worker. They may have expired.",
                        req_id,
                    )
                    continue

                # Every reader of this req_id reports the same count (it's
                # derived from aggregate topology, not the specific rank),
                # so repeated notifications never disagree on it.
                self.expected_consumer_notifications_by_req[req_id] = int(
                    expected_consumers
                )

                self.consumer_notification_counts_by_req[req_id] += 1
                # Wait all consumers (D) to be done reading before freeing.
                if (
                    self.consumer_notification_counts_by_req[req_id]
                    == self.expected_consumer_notifications_by_req[req_id]
                ):
                    notified_req_ids.add(req_id)
                    del self.consumer_notification_counts_by_req[req_id]
                    del self.expected_consumer_notifications_by_req[req_id]
                    self._reqs_to_process.remove(req_id)
                    self._reqs_to_send.pop(req_id, None)
        self._note_pulls(notified_req_ids)
        return self._release_pulled_siblings(notified_req_ids)


@amend("F3", ">=0.31.0,<0.32.0")
class NixlPullConnectorWorker:
    """F3: _get_new_notifs, the text of v0.31.0."""

    def _get_new_notifs(self) -> set[str]:
        """Get req_ids which got a remote xfer message. When multiple consumers
        are reading from the same producer (heterogeneous TP or DCP
        scenario), wait for all consumers to be done pulling.

        Also handles heartbeat notifications ("HB:req1,req2,...") by
        extending the lease on the referenced requests.
        """
        assert self.transfer_topo is not None
        notified_req_ids: set[str] = set()
        for notifs in self._sibling_reads(self.nixl_wrapper.get_new_notifs()).values():
            for notif in notifs:
                msg = notif.decode("utf-8")

                # Handle heartbeat messages from D-side.
                if msg.startswith("HB:"):
                    self._handle_heartbeat(msg[3:])
                    continue

                req_id, expected_consumers = msg.rsplit(":", 1)
                if (
                    req_id not in self._reqs_to_send
                    and req_id not in self._reqs_to_process
                ):
                    if not self._early_notifs.is_late(req_id):
                        # The pull raced start_load_kv (staged until the request
                        # registers to send) or repeats a completed one.
                        self._notif_not_held(
                            req_id, int(expected_consumers), notified_req_ids
                        )
                        continue
                    logger.error(
                        "Potentially invalid KV blocks for "
                        "unrecognized request %s were retrieved by "
                        "a decode worker. They may have expired.",
                        req_id,
                    )
                    continue

                # Every reader of this req_id reports the same count (it's
                # derived from aggregate topology, not the specific rank),
                # so repeated notifications never disagree on it.
                self.expected_consumer_notifications_by_req[req_id] = int(
                    expected_consumers
                )

                self.consumer_notification_counts_by_req[req_id] += 1
                # Wait all consumers (D) to be done reading before freeing.
                if (
                    self.consumer_notification_counts_by_req[req_id]
                    == self.expected_consumer_notifications_by_req[req_id]
                ):
                    notified_req_ids.add(req_id)
                    del self.consumer_notification_counts_by_req[req_id]
                    del self.expected_consumer_notifications_by_req[req_id]
                    self._reqs_to_process.remove(req_id)
                    self._reqs_to_send.pop(req_id, None)
        self._note_pulls(notified_req_ids)
        return self._release_pulled_siblings(notified_req_ids)


@amend("F3", ">=0.32.0,<0.34.0")
class NixlPullConnectorWorker:
    """F3: _get_new_notifs, the text of v0.33.0."""

    def _get_new_notifs(self) -> set[str]:
        """Get req_ids which got a remote xfer message. When multiple consumers
        are reading from the same producer (heterogeneous TP or DCP
        scenario), wait for all consumers to be done pulling.

        Also handles heartbeat notifications ("HB:req1,req2,...") by
        extending the lease on the referenced requests.
        """
        assert self.transfer_topo is not None
        notified_req_ids: set[str] = set()
        for notifs in self._sibling_reads(self.nixl_wrapper.get_new_notifs()).values():
            for notif in notifs:
                msg = notif.decode("utf-8")

                # Handle heartbeat messages from D-side.
                if msg.startswith("HB:"):
                    self._handle_heartbeat(msg[3:])
                    continue

                req_id, expected_consumers = msg.rsplit(":", 1)
                if (
                    req_id not in self._reqs_to_send
                    and req_id not in self._reqs_to_process
                ):
                    if not self._early_notifs.is_late(req_id):
                        # The pull raced start_load_kv (staged until the request
                        # registers to send) or repeats a completed one.
                        self._notif_not_held(
                            req_id, int(expected_consumers), notified_req_ids
                        )
                        continue
                    self.xfer_stats.record_notification_after_expiry()
                    logger.error(
                        "Potentially invalid KV blocks for "
                        "unrecognized request %s were retrieved by "
                        "a decode worker. They may have expired.",
                        req_id,
                    )
                    continue

                # Every reader of this req_id reports the same count (it's
                # derived from aggregate topology, not the specific rank),
                # so repeated notifications never disagree on it.
                self.expected_consumer_notifications_by_req[req_id] = int(
                    expected_consumers
                )

                self.consumer_notification_counts_by_req[req_id] += 1
                # Wait all consumers (D) to be done reading before freeing.
                if (
                    self.consumer_notification_counts_by_req[req_id]
                    == self.expected_consumer_notifications_by_req[req_id]
                ):
                    notified_req_ids.add(req_id)
                    del self.consumer_notification_counts_by_req[req_id]
                    del self.expected_consumer_notifications_by_req[req_id]
                    self._reqs_to_process.remove(req_id)
                    self._reqs_to_send.pop(req_id, None)
        self._note_pulls(notified_req_ids)
        return self._release_pulled_siblings(notified_req_ids)
