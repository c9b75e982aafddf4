# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``.

NIXL producer (prefill) release path, vllm PR 43509:

- F2: when a decoder pulled one parallel-sampling sibling (``n > 1``), release
  the siblings registered with it; siblings that register later are released
  when they register (``BestOfSiblings``).
- F3: a pull notification that arrives before ``start_load_kv`` registered the
  request is staged and applied at registration instead of being dropped
  (``EarlyPullNotifications``).

From v0.24 the producer state lives here and the pull-specific methods
(``start_load_kv``, ``_get_new_notifs``) in ``nixl/pull_worker.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet

from vllm import envs
from vllm_patches._overlay import add, amend, call_at_end_of, filter_result_of


@amend("F2", ">=0.24.0,<0.34.0")
@amend("F2", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F2", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlBaseConnectorWorker:
    """F2: state and release helpers (every layout)."""

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


@amend("F2", ">=0.24.0,<0.34.0")
class NixlBaseConnectorWorker:
    """F2: subclasses own the notification counters."""

    def _forget_sent_req(self, req_id: ReqId) -> None:
        """Drop a request whose KV this worker no longer holds from its
        bookkeeping. Subclasses own the notification counters."""
        raise NotImplementedError


@amend("F3", ">=0.24.0,<0.34.0")
@amend("F3", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F3", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlBaseConnectorWorker:
    """F3: staging state and settling (every layout)."""

    # What the pull path's _get_new_notifs released by notifications in this
    # step, until get_finished / get_transfer_results reports; None otherwise
    # (a push worker's _get_new_notifs is its own; tests build workers without
    # __init__).
    _pulled_now: frozenset[ReqId] | None = None

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

    def _remember_releases_without_pull(self, done_sending: set[ReqId]) -> None:
        """Remember the requests reported released other than by this step's pull
        notifications (expired or lease reaped, siblings, released at
        registration): a notification for one is late. O(1) when there are none."""
        pulled, self._pulled_now = self._pulled_now, None
        if pulled is not None and len(done_sending) != len(pulled):
            self._early_notifs.released_without_pull(done_sending - pulled)

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
        if metadata.reqs_not_processed:
            early.released_without_pull(metadata.reqs_not_processed)
        if early.staged:
            early.drop(metadata.reqs_not_processed)
            for req_id, (expected, count) in early.take(metadata.reqs_in_batch):
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


@amend("F3", ">=0.24.0,<0.30.0")
@amend("F3", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F3", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlBaseConnectorWorker:
    """F3: late notifications, up to v0.29 (expiry inside get_finished)."""

    @filter_result_of("get_finished")
    def _remember_released_without_pull(
        self, finished: tuple[set[str], set[str]]
    ) -> tuple[set[str], set[str]]:
        """Remember what get_finished released other than by a pull notification."""
        self._remember_releases_without_pull(finished[0])
        return finished


@amend("F3", ">=0.30.0,<0.34.0")
class NixlBaseConnectorWorker:
    """F3: late notifications, from v0.30 (get_transfer_results)."""

    @filter_result_of("get_transfer_results")
    def _remember_released_without_pull(
        self, results: KVConnectorTransferResults
    ) -> KVConnectorTransferResults:
        """Remember what get_transfer_results released other than by a pull
        notification."""
        self._remember_releases_without_pull(results.finished_sending or set())
        return results


@add("F2", ">=0.24.0,<0.34.0")
@add("F2", ">=0.20.0,<0.24.0", into="worker.py")
@add("F2", ">=0.18.0,<0.20.0", into="../nixl_connector.py")
class BestOfSiblings:
    """Parallel-sampling siblings of requests a NIXL producer's decoders pulled.

    With ``n > 1`` the engine splits a prompt into siblings ``f"{i}_{parent}"``
    (``ParentRequest.get_child_info``) that share the prompt's KV. The response
    telling a decoder where that KV lives carries the ``kv_transfer_params`` of
    one sibling only, so a decoder pulls one sibling and the producer held the
    other ``n - 1`` until their expiry or lease ran out.

    When a decoder pulled one sibling, the others are released with it: no
    decoder can pull them, their block ids never left this engine. Releasing
    KV that a decoder still reads corrupts its output, so a request only counts
    as a sibling when all of these hold:

    - its id has the exact shape ``f"{index}_{parent}"`` (decimal index
      without leading zeros);
    - while vLLM randomizes request ids (the default), ``parent`` ends with the
      ``-xxxxxxxx`` suffix that ``InputProcessor.assign_request_id`` appends, so
      ids a client chose (``"2_job"``) never qualify;
    - at least two siblings of ``parent`` are registered with this producer, so
      a lone id of that shape releases nothing;
    - it is registered to send (finished, its blocks kept for a decoder); one
      still being scheduled is released once it registers to send.

    ``enabled`` comes from ``kv_connector_extra_config["release_best_of_siblings"]``
    (default: on, unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` lets client
    ids reach the engine unchanged). Pulled parents are kept in a FIFO of
    ``limit`` entries; a forgotten one falls back to the expiry or lease.
    """

    def __init__(self, enabled: bool, limit: int, randomized_ids: bool) -> None:
        self.enabled = enabled
        self.limit = limit
        self.randomized_ids = randomized_ids
        # Parents a decoder pulled through one of their siblings, oldest first.
        self.pulled_parents: OrderedDict[str, None] = OrderedDict()

    def split(self, req_id: str) -> tuple[int, str] | None:
        """``(index, parent)`` if ``req_id`` is shaped like a sibling, else None."""
        index, sep, parent = req_id.partition("_")
        # At most 6 digits: n < 10**6, and int() of a long client-chosen index
        # must stay cheap (it raises beyond 4300 digits).
        if not (sep and parent and index.isascii() and index.isdecimal()):
            return None
        if len(index) > 6 or (len(index) > 1 and index[0] == "0"):
            return None
        if self.randomized_ids and not (
            len(parent) > 9
            and parent[-9] == "-"
            and not parent[-8:].strip("0123456789abcdef")
        ):
            return None
        return int(index), parent

    def pulled(
        self,
        req_id: str,
        registered: Collection[str],
        pulled_now: Collection[str] = (),
    ) -> list[str]:
        """A decoder pulled ``req_id``: its siblings among ``registered``.

        ``pulled_now``: requests pulled in the same step, released already; they
        are siblings too (the parent is remembered for them) but not returned.
        Siblings are looked up by index, up to one past the highest index seen,
        so O(n). If any is found the parent is remembered, and its siblings that
        register to send later are returned by ``late``.
        """
        split = self.split(req_id) if self.enabled else None
        if split is None:
            return []
        index, parent = split
        # Siblings 0..n-1 register together: an index beyond the number of
        # registered requests belongs to no live group (and must not make a
        # client-chosen id cost a long search).
        if index > len(registered) + len(pulled_now):
            return []
        siblings, pulled_together = [], False
        last, i = index, 0
        while i <= last + 1:
            sibling = f"{i}_{parent}"
            if i != index and sibling in registered:
                siblings.append(sibling)
                last = max(last, i)
            elif i != index and sibling in pulled_now:
                pulled_together = True
                last = max(last, i)
            i += 1
        if siblings or pulled_together:
            self.pulled_parents[parent] = None
            if len(self.pulled_parents) > self.limit:
                self.pulled_parents.popitem(last=False)
        return siblings

    def late(self, registered_to_send: Iterable[str]) -> list[str]:
        """The requests among ``registered_to_send`` whose parent was pulled."""
        if not self.pulled_parents:
            return []
        late = []
        for req_id in registered_to_send:
            split = self.split(req_id) if "_" in req_id else None
            if split is not None and split[1] in self.pulled_parents:
                late.append(req_id)
        return late


@add("F3", ">=0.24.0,<0.34.0")
@add("F3", ">=0.20.0,<0.24.0", into="worker.py")
@add("F3", ">=0.18.0,<0.20.0", into="../nixl_connector.py")
class EarlyPullNotifications:
    """Pull notifications for requests a NIXL producer has not registered yet.

    A decoder's pull-complete notification can reach the producer before
    ``start_load_kv`` registered the request. Such notifications are counted
    here (``staged``: request -> (expected notifications, notifications so
    far)) and move to the worker's counters when the request registers; a
    request whose notifications were already complete is released when it
    registers to send (``complete``).

    ``staged`` is changed only through ``stage``, ``take`` and ``drop``, which
    keep ``_staged_ids`` (its keys as a set) in step: a set intersects with the
    requests of a step about twice as fast as a dict's keys (cold caches, 256
    lookups into 8192 entries: about 10 us instead of 22 us).

    At most ``limit`` requests are staged; the oldest is dropped first, and if
    it registers after all it waits for its expiry or lease, like a request
    whose notification was lost.

    A notification for a request the producer released without that request's
    own pull completing (expired or lease reaped, aborted, released as a
    parallel-sampling sibling or at registration) is late, not early: it keeps
    upstream's error and is not staged. The last ``limit`` such requests are
    remembered. Few requests are released that way (nearly all by their pull),
    so the check holds across an expiry of 480 s unless more than ``limit``
    were since; remembering them costs nothing in a step that releases none. A
    duplicate of a notification that completed a pull is staged like an early
    one, and dropped with a warning once evicted.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.staged: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._staged_ids: set[str] = set()
        # Registered requests whose staged notifications were complete, waiting
        # to register to send: request -> expected notifications.
        self.complete: dict[str, int] = {}
        # Requests released without their pull completing, oldest first.
        self._released_without_pull: OrderedDict[str, None] = OrderedDict()

    def released_without_pull(self, req_ids: Iterable[str]) -> None:
        """Remember requests released (or aborted) without their pull completing."""
        # Sorted: which of several is forgotten first must not depend on hashing.
        for req_id in sorted(req_ids):
            self._released_without_pull[req_id] = None
        while len(self._released_without_pull) > self.limit:
            self._released_without_pull.popitem(last=False)

    def is_late(self, req_id: str) -> bool:
        """Whether a notification for ``req_id`` (not held) comes too late."""
        return req_id in self._released_without_pull

    def stage(self, req_id: str, expected: int) -> str | None:
        """Count one notification for ``req_id``.

        Returns the request dropped to stay within ``limit``, if any.
        """
        dropped = None
        _, count = self.staged.get(req_id, (expected, 0))
        if not count:
            if len(self.staged) >= self.limit:
                dropped, _ = self.staged.popitem(last=False)
                self._staged_ids.discard(dropped)
            self._staged_ids.add(req_id)
        # Every reader reports the same expected count. Tuples of ints are not
        # tracked by the garbage collector.
        self.staged[req_id] = (expected, count + 1)
        return dropped

    def take(self, req_ids: AbstractSet[str]) -> list[tuple[str, tuple[int, int]]]:
        """Remove the staged requests among ``req_ids``: (request, (expected,
        count)) each. Costs O(min(len(req_ids), staged))."""
        found = self._staged_ids.intersection(req_ids)
        if not found:
            return []
        self._staged_ids -= found
        return [(req_id, self.staged.pop(req_id)) for req_id in found]

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget the staged notifications of ``req_ids`` (aborted requests)."""
        for req_id in req_ids:
            if self.staged.pop(req_id, None) is not None:
                self._staged_ids.discard(req_id)
