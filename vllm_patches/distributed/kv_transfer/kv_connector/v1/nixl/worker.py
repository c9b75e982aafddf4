# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py``.

NIXL producer (prefill) release path, vllm PR 43509:

- F2: a decode engine reads the one parallel-sampling sibling (``n > 1``) it was
  told about once per child: hold that sibling until all its reads are in, then
  release it with the siblings registered with it; siblings that register
  later are released when they register (``BestOfSiblings``).
- F3: a pull notification that arrives before ``start_load_kv`` registered the
  request is staged and applied at registration instead of being dropped
  (``EarlyPullNotifications``).

v0.20 - v0.23; from v0.24 the pull worker lives in ``nixl/pull_worker.py``
and its shared state in ``nixl/base_worker.py``. Members shared by every
release sit in one partial class per fix, the upstream methods they change
in one partial class per range of identical upstream text.
"""

from __future__ import annotations


from vllm_patches._overlay import amend


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
        for notifs in self._sibling_reads(self.nixl_wrapper.get_new_notifs()).values():
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
