# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py``.

NIXL producer (prefill) release path, vllm PR 43509:

- F2: a decode engine reads the one parallel-sampling sibling (``n > 1``) it was
  told about once per child: hold that sibling until all its reads are in, then
  release it with the siblings registered with it; siblings that register
  later are released when they register (``BestOfSiblings``).
- F3: a pull notification that arrives before ``start_load_kv`` registered the
  request is staged and applied at registration instead of being dropped
  (``EarlyPullNotifications``).

The connector is one module up to v0.19 (``nixl/`` from v0.20).
"""

from __future__ import annotations


from vllm_patches._overlay import amend


@amend("F2", ">=0.18.0,<0.20.0")
class NixlConnectorWorker:
    """F2: notifications per decode reader, v0.18 - v0.19 (from the decoder's TP)."""

    def _notifications_per_reader(self, tp_size: int) -> int:
        """How many notifications one decode request sends this worker: one per
        decode rank reading from it (what _get_new_notifs waits for)."""
        assert self.kv_topo is not None
        tp_ratio = self.kv_topo.tp_ratio(tp_size)
        return -tp_ratio if tp_size > self.world_size else 1


@amend("F3", ">=0.18.0,<0.20.0")
class NixlConnectorWorker:
    """F3: _get_new_notifs, v0.18 - v0.19."""

    def _get_new_notifs(self) -> set[str]:
        """
        Get req_ids which got a remote xfer message. When multiple consumers
        are reading from the same producer (heterogeneous TP scenario), wait
        for all consumers to be done pulling.
        """
        assert self.kv_topo is not None
        notified_req_ids: set[str] = set()
        for notifs in self._sibling_reads(self.nixl_wrapper.get_new_notifs()).values():
            for notif in notifs:
                req_id, tp_size = notif.decode("utf-8").rsplit(":", 1)
                # NOTE: `tp_ratio` is the opposite when swapping local<>remote
                n_consumers = int(tp_size)
                tp_ratio = self.kv_topo.tp_ratio(n_consumers)

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
