# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py``.

NIXL producer (prefill) release path, vllm PR 43509:

- F2: when a decoder pulled one parallel-sampling sibling (``n > 1``), release
  the siblings registered with it; siblings that register later are released
  when they register (``BestOfSiblings``).
- F3: a pull notification that arrives before ``start_load_kv`` registered the
  request is staged and applied at registration instead of being dropped
  (``EarlyPullNotifications``).

v0.20 - v0.23; from v0.24 the pull worker lives in ``nixl/pull_worker.py``
and its shared state in ``nixl/base_worker.py``. Members shared by every
release sit in one partial class per fix, the upstream methods they change
in one partial class per range of identical upstream text.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from vllm import envs
from vllm_patches._overlay import amend, call_at_end_of, filter_result_of


@amend("F2", ">=0.20.0,<0.24.0")
class NixlConnectorWorker:
    """F2: state and release helpers, v0.20 - v0.23."""

    # Requests start_load_kv released, reported by the next _get_new_notifs. The
    # class-level empty default serves workers built without __init__ (tests).
    _released_at_registration: set[ReqId] | frozenset[ReqId] = frozenset()

    @call_at_end_of("__init__")
    def _init_best_of_siblings(self) -> None:
        """Set up the release of parallel-sampling siblings (see BestOfSiblings)."""
        # Client-chosen ids reach the engine unchanged without randomization;
        # the shape of an id then proves nothing, so fan-out defaults to off.
        randomized_ids = not envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
        config = self.kv_transfer_config
        self._best_of_siblings = BestOfSiblings(
            enabled=bool(
                config.get_from_extra_config("release_best_of_siblings", randomized_ids)
            ),
            limit=int(config.get_from_extra_config("best_of_parents_limit", 8192)),
            randomized_ids=randomized_ids,
        )
        self._released_at_registration = set()

    def _release_best_of_siblings(
        self, req_id: ReqId, pulled_now: AbstractSet[ReqId] = frozenset()
    ) -> set[ReqId]:
        """Release the siblings of ``req_id``, whose shared KV a decoder pulled.

        ``pulled_now``: requests released with it, which count as its siblings
        but are released already. Returns the siblings released now: those
        registered to send. The others are released when they register to send.
        """
        siblings = self._best_of_siblings.pulled(
            req_id, self._reqs_to_process, pulled_now
        )
        released = {sibling for sibling in siblings if sibling in self._reqs_to_send}
        for sibling in released:
            self._forget_sent_req(sibling)
        if released:
            logger.debug(
                "Releasing KV blocks of %d parallel-sampling sibling(s) of "
                "request %s, which a decode worker pulled.",
                len(released),
                req_id,
            )
        return released

    def _release_late_best_of_siblings(self, metadata: NixlConnectorMetadata) -> None:
        """Release siblings that registered to send after their parent was pulled."""
        if not self._best_of_siblings.pulled_parents:
            return
        released = {
            req_id
            for req_id in self._best_of_siblings.late(metadata.reqs_to_send)
            if req_id in self._reqs_to_send
        }
        for req_id in released:
            self._forget_sent_req(req_id)
        self._released_at_registration |= released

    def _pop_released_at_registration(self) -> set[ReqId] | frozenset[ReqId]:
        released = self._released_at_registration
        if released:
            self._released_at_registration = set()
        return released

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
        pulled = [req_id for req_id in notified_req_ids if "_" in req_id]
        for req_id in pulled:
            notified_req_ids |= self._release_best_of_siblings(req_id, notified_req_ids)
        if self._released_at_registration:
            notified_req_ids |= self._pop_released_at_registration()
        return notified_req_ids

    def _forget_sent_req(self, req_id: ReqId) -> None:
        """Drop a request whose KV this worker no longer holds from its bookkeeping."""
        self._reqs_to_process.discard(req_id)
        self._reqs_to_send.pop(req_id, None)
        self.consumer_notification_counts_by_req.pop(req_id, None)


@amend("F3", ">=0.20.0,<0.24.0")
class NixlConnectorWorker:
    """F3: staging helpers, v0.20 - v0.23."""

    @call_at_end_of("__init__")
    def _init_early_pull_notifications(self) -> None:
        """Set up the staging of notifications that race registration."""
        self._early_notifs = EarlyPullNotifications(
            limit=int(
                self.kv_transfer_config.get_from_extra_config(
                    "early_notifications_limit", 8192
                )
            )
        )

    def _stage_early_notif(self, req_id: ReqId, expected: int) -> None:
        """Count a notification for a request that has not registered yet."""
        dropped = self._early_notifs.stage(req_id, expected)
        if dropped is not None:
            logger.warning(
                "Dropping early notification(s) for request %s, which has not "
                "registered with this producer; if it does, its KV blocks are "
                "released when they expire.",
                dropped,
            )

    def _settle_early_notifs(self, metadata: NixlConnectorMetadata) -> None:
        """Apply staged notifications to the requests registered in this step.

        Invariant: no registered request has staged notifications, so no
        release path (threshold, fan-out, expiry, lease) needs to look at them.
        A registering request's staged count moves to
        ``consumer_notification_counts_by_req``, where later notifications keep
        counting; one whose count is already complete is released as soon as
        it registers to send (finished: only then may the scheduler free its
        blocks), with its parallel-sampling siblings. Entries of aborted
        requests are dropped. Costs O(requests in ``metadata``), never a scan
        of the staged requests.
        """
        early = self._early_notifs
        early.registered(metadata.reqs_in_batch)
        if early.staged:
            for req_id in metadata.reqs_not_processed:
                early.staged.pop(req_id, None)
            # dict.keys: a plain view intersects faster than OrderedDict's.
            for req_id in dict.keys(early.staged) & metadata.reqs_in_batch:
                expected, count = early.staged.pop(req_id)
                if req_id in self._reqs_to_process:
                    self.consumer_notification_counts_by_req[req_id] += count
                    if count >= expected:
                        early.complete[req_id] = expected
        if not early.complete:
            return
        for req_id in metadata.reqs_not_processed:
            early.complete.pop(req_id, None)
        for req_id in early.complete.keys() & metadata.reqs_to_send.keys():
            del early.complete[req_id]
            if req_id in self._reqs_to_send:
                self._forget_sent_req(req_id)
                siblings = self._release_best_of_siblings(req_id)
                self._released_at_registration |= {req_id, *siblings}

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


@amend("F3", ">=0.20.0,<0.22.0")
class NixlConnectorWorker:
    """F3, v0.20 - v0.21 (expiry timeout)."""

    def _get_new_notifs(self) -> set[str]:
        """
        Get req_ids which got a remote xfer message. When multiple consumers
        are reading from the same producer (heterogeneous TP scenario), wait
        for all consumers to be done pulling.
        """
        assert self.transfer_topo is not None
        notified_req_ids: set[str] = set()
        for notifs in self.nixl_wrapper.get_new_notifs().values():
            for notif in notifs:
                req_id, tp_size = notif.decode("utf-8").rsplit(":", 1)
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
                    if not self._early_notifs.was_registered(req_id):
                        # The pull raced start_load_kv: count it until the
                        # request registers to send.
                        self._stage_early_notif(req_id, consumers_per_producer)
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
        return self._release_pulled_siblings(notified_req_ids)


@amend("F3", ">=0.22.0,<0.24.0")
class NixlConnectorWorker:
    """F3, v0.22 - v0.23 (lease, heartbeats)."""

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
        for notifs in self.nixl_wrapper.get_new_notifs().values():
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
                    if not self._early_notifs.was_registered(req_id):
                        # The pull raced start_load_kv: count it until the
                        # request registers to send.
                        self._stage_early_notif(req_id, consumers_per_producer)
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
        return self._release_pulled_siblings(notified_req_ids)
