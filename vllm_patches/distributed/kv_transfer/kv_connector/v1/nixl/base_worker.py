# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``.

NIXL producer (prefill) release path (vllm-project/vllm#43509): F2 releases
parallel-sampling siblings together (``BestOfSiblings``), F3 stages notifications
that race registration (``EarlyPullNotifications``), F8 holds a prompt under a READ.
F17 (v0.22 - v0.30) lets the lease expiry release every lease that ran out, also
behind one renewed or held (vllm-project/vllm#58222, fixed in v0.31). F23 (v0.18 -
v0.29) reports a failed READ's request after its other READs (PR 56104, in v0.30).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable
from collections.abc import Set as AbstractSet
from functools import cached_property
from typing import Any

from vllm import envs

from vllm_patches._overlay import (
    add,
    amend,
    call_at_end_of,
    filter_call_in,
    filter_result_of,
)


@amend("F2", ">=0.24.0")
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
        """Release the siblings of ``req_id`` registered to send (the others when they
        register); ``pulled_now`` are siblings released already."""
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

    def _holds_back(self, notif: bytes) -> bool:
        """Whether a pull notification is one of the reads of a parallel-sampling
        sibling that other decode children still make (see BestOfSiblings.reads);
        such a notification does not count toward the sibling's release."""
        if b"_" not in notif or notif.startswith(b"HB:"):
            return False
        req_id, _, readers = notif.decode("utf-8").rpartition(":")
        if req_id not in self._reqs_to_process:
            return False
        notifications = self._notifications_per_reader(int(readers))
        held = not self._best_of_siblings.reads(
            req_id, 1, notifications, self._reqs_to_process
        )
        if held and self._best_of_siblings.child_read(req_id):
            self._lease_siblings_from_read(req_id)
        return held

    def _lease_siblings_from_read(self, req_id: ReqId) -> None:
        """Every request is released within one lease extension of its last reader
        unless a heartbeat renews it: a sibling kept after a read, and its siblings,
        live on the other children's heartbeats from now on."""
        extension = getattr(self, "_lease_extension", None)
        if extension is None:
            return
        latest = time.perf_counter() + extension
        leases = self._reqs_to_send
        for sibling in (req_id, *self._best_of_siblings.others(req_id, leases)):
            if leases.get(sibling, 0.0) > latest:
                leases[sibling] = latest

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


@amend("F2", ">=0.24.0")
class NixlBaseConnectorWorker:
    """F2: subclasses own the notification counters."""

    def _forget_sent_req(self, req_id: ReqId) -> None:
        """Drop a request whose KV this worker no longer holds from its
        bookkeeping. Subclasses own the notification counters."""
        raise NotImplementedError

    def _notifications_per_reader(self, readers: int) -> int:
        """How many notifications one decode request sends this worker, from the
        number its notifications carry. Subclasses own the notification format."""
        raise NotImplementedError


@amend("F8", ">=0.24.0")
@amend("F8", ">=0.22.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
class NixlBaseConnectorWorker:
    """F8: a prompt stays held while a decoder's READ of it is in flight."""

    # Marks a heartbeat entry "a READ of this request was posted": a decoder sends
    # "HB:<id>,<mark><id>" after posting its READ. A producer without this fix
    # looks the marked entry up as a request id, finds none and ignores it (the
    # plain entry renews the lease as any heartbeat does).
    _READ_POSTED_MARK = "read-posted/"

    @cached_property
    def _read_hold_limit(self) -> float:
        """Seconds a marked READ holds its prompt at most: what a READ that never
        notifies costs (kv_connector_extra_config["read_hold_limit"], 120; 0: off)."""
        config = getattr(self, "kv_transfer_config", None)
        if config is None:
            return 120.0
        return float(config.get_from_extra_config("read_hold_limit", 120))

    @call_at_end_of("_handle_heartbeat")
    def _hold_prompts_under_read(self, payload: str) -> None:
        """A request whose READ a decoder posted is not released by lease before the
        READ's notification or ``read_hold_limit`` seconds (heartbeats ride the
        decoder's steps, vllm-project/vllm#41383; NIXL notifies when the READ ends)."""
        mark = self._READ_POSTED_MARK
        if mark not in payload or self._read_hold_limit <= 0:
            return
        hold_until = time.perf_counter() + self._read_hold_limit
        siblings = getattr(self, "_best_of_siblings", None)
        for entry in payload.split(","):
            if not entry.startswith(mark):
                continue
            req_id = entry[len(mark) :]
            expires = self._reqs_to_send.get(req_id)
            if siblings is not None and siblings.child_read(req_id):
                # The READ's notifications are in (they can come before the mark:
                # the decoder posts its READs before it sends the step's
                # heartbeats, which repeat the mark while other children wait),
                # and the release of parallel-sampling siblings keeps the request
                # for those children: no READ to hold.
                continue
            if expires is not None and expires < hold_until:
                self._reqs_to_send[req_id] = hold_until
                logger.debug(
                    "Holding KV blocks of request %s for up to %.0f s: a decode "
                    "worker posted a READ of them.",
                    req_id,
                    self._read_hold_limit,
                )


@amend("F17", ">=0.24.0")
@amend("F17", ">=0.22.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
class NixlBaseConnectorWorker:
    """F17: every lease that has run out is released, wherever it sits (v0.22 -
    v0.30; upstream scans every lease from v0.31, vllm#58222)."""

    def _expired_leases_first(self, now: float) -> float:
        """Move the leases of ``_reqs_to_send`` that have run out by ``now`` ahead of
        the live ones, each group in its order, so that the lease expiry, which stops
        at the first live lease, releases all of them; return ``now``."""
        # Heartbeats and holds renew a lease in place: the dict's order is not the
        # expiry order. One min() per step; the O(leases) move only when one ran out.
        leases = self._reqs_to_send
        if not leases or now < min(leases.values()):
            return now
        for req_id in [req_id for req_id, expires in leases.items() if now < expires]:
            leases[req_id] = leases.pop(req_id)
        return now


@amend("F17", ">=0.24.0,<0.30.0")
@amend("F17", ">=0.22.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
class NixlBaseConnectorWorker:
    """F17: the expiry inside get_finished (v0.22 - v0.29)."""

    @filter_call_in("get_finished", "time.perf_counter")
    def _reap_every_expired_lease(self, now: float) -> float:
        """The clock reading the lease expiry uses, with the expired leases first."""
        return self._expired_leases_first(now)


@amend("F17", ">=0.30.0")
class NixlBaseConnectorWorker:
    """F17: the expiry inside get_transfer_results (v0.30)."""

    @filter_call_in("get_transfer_results", "time.perf_counter")
    def _reap_every_expired_lease(self, now: float) -> float:
        """The clock reading the lease expiry uses, with the expired leases first."""
        return self._expired_leases_first(now)


@amend("F23", ">=0.24.0")
@amend("F23", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F23", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlBaseConnectorWorker:
    """F23: a request with a failed READ is reported only once none of its READs is
    in flight (v0.18 - v0.29; upstream from v0.30, PR 56104)."""

    @cached_property
    def _failed_with_reads_in_flight(self) -> set[ReqId]:
        """Failed receives held back from get_finished while another READ of theirs
        (one per producer rank) may still write into their blocks."""
        return set()

    @filter_call_in("get_finished", "self._pop_done_transfers")
    def _hold_failures_until_reads_end(self, done_recving: set[ReqId]) -> set[ReqId]:
        """What the poll found done, after moving the queued failed receives whose
        request still has a READ in flight out of the queue get_finished drains next,
        and back into it the held ones whose last READ ended."""
        # Reported early, the scheduler frees or recomputes blocks a READ still
        # writes, and the READ's own completion then ends the worker on get_finished's
        # "assert meta is not None".
        held = self._failed_with_reads_in_flight
        # A set up to v0.21, a queue.Queue after; handshake callbacks add to it from
        # other threads, so it is drained one atomic take at a time.
        failed: Any = self._failed_recv_reqs
        in_a_set = isinstance(failed, set)
        while failed if in_a_set else not failed.empty():
            held.add(failed.pop() if in_a_set else failed.get_nowait())
        ended = [req_id for req_id in held if req_id not in self._recving_transfers]
        held.difference_update(ended)
        for req_id in ended:
            if in_a_set:
                failed.add(req_id)
            else:
                failed.put(req_id)
        return done_recving


@amend("F3", ">=0.24.0")
@amend("F3", ">=0.20.0,<0.24.0", into="worker.py", name="NixlConnectorWorker")
@amend(
    "F3", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorWorker"
)
class NixlBaseConnectorWorker:
    """F3: staging state and settling (every layout)."""

    # What the pull path released by pull notifications since the last report
    # of get_finished / get_transfer_results; None otherwise (a push worker's
    # _get_new_notifs is its own; tests build workers without __init__).
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

    def _note_pulls(self, req_ids: AbstractSet[ReqId]) -> None:
        """Note requests released because their pull completed, until the report."""
        pulled = self._pulled_now
        self._pulled_now = frozenset(req_ids) if pulled is None else pulled | req_ids

    def _remember_releases(self, done_sending: set[ReqId]) -> None:
        """Remember what the report releases, by how: a notification for a request
        released by its pull repeats a read (``_notif_not_held``); one for a
        request released otherwise (expired or lease reaped, siblings, aborted)
        is late. O(1) when only pulled requests are released."""
        pulled, self._pulled_now = self._pulled_now, None
        if pulled is None:
            return
        if pulled:
            self._early_notifs.released_by_pull(pulled)
        if len(done_sending) != len(pulled):
            self._early_notifs.released_without_pull(done_sending - pulled)

    def _notif_not_held(
        self, req_id: ReqId, expected: int, pulled_now: AbstractSet[ReqId]
    ) -> None:
        """A notification for a request this worker does not hold and did not
        release without its pull: it repeats a completed pull (``pulled_now``:
        released by notifications earlier in this call), or races the
        request's registration (staged until it registers)."""
        if (
            req_id in pulled_now
            or (self._pulled_now is not None and req_id in self._pulled_now)
            or self._early_notifs.is_repeat(req_id)
        ):
            logger.warning(
                "Ignoring a pull notification for request %s: its KV blocks were "
                "released when its pull completed, so a decode worker read them "
                "more times than this producer counted.",
                req_id,
            )
            return
        dropped = self._early_notifs.stage(req_id, expected)
        if dropped is not None:
            logger.warning(
                "Dropping early notification(s) for request %s, which has not "
                "registered with this producer; if it does, its KV blocks are "
                "released when they expire.",
                dropped,
            )

    def _settle_early_notifs(self, metadata: NixlConnectorMetadata) -> None:
        """No registered request has staged notifications: a registering request's
        count moves to ``consumer_notification_counts_by_req``, and a complete one is
        released once it registers to send. O(requests in ``metadata``)."""
        early = self._early_notifs
        if metadata.reqs_not_processed:
            early.released_without_pull(metadata.reqs_not_processed)
        if early.staged:
            early.drop(metadata.reqs_not_processed)
            for req_id, (expected, count) in early.take(metadata.reqs_in_batch):
                if req_id not in self._reqs_to_process:
                    continue
                count = self._best_of_siblings.reads(
                    req_id, count, expected, self._reqs_to_process
                )
                if count:
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
                self._note_pulls({req_id})
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
    def _remember_how_released(
        self, finished: tuple[set[str], set[str]]
    ) -> tuple[set[str], set[str]]:
        """Remember how get_finished released what it reports."""
        self._remember_releases(finished[0])
        return finished


@amend("F3", ">=0.30.0")
class NixlBaseConnectorWorker:
    """F3: late notifications, from v0.30 (get_transfer_results)."""

    @filter_result_of("get_transfer_results")
    def _remember_how_released(
        self, results: KVConnectorTransferResults
    ) -> KVConnectorTransferResults:
        """Remember how get_transfer_results released what it reports."""
        self._remember_releases(results.finished_sending or set())
        return results


@add("F2", ">=0.24.0")
@add("F2", ">=0.20.0,<0.24.0", into="worker.py")
@add("F2", ">=0.18.0,<0.20.0", into="../nixl_connector.py")
class BestOfSiblings:
    """Parallel-sampling siblings ``f"{i}_{parent}"`` of a prompt whose one named
    sibling every decode child reads: it is held until all children's reads are in
    (one child per other registered sibling), then released with the others.

    Releasing KV a decoder still reads corrupts its output, so a request counts as a
    sibling only if its id has exactly that shape, ``parent`` ends with the random
    ``-xxxxxxxx`` suffix while vLLM randomizes ids (so ``"2_job"`` never does), another
    sibling is registered here, and it is registered to send. A decoder that reads
    fewer times leaves them held until expiry or lease, never released early.
    """

    def __init__(self, enabled: bool, limit: int, randomized_ids: bool) -> None:
        self.enabled = enabled
        self.limit = limit
        self.randomized_ids = randomized_ids
        # Parents a decoder pulled through one of their siblings, oldest first.
        self.pulled_parents: OrderedDict[str, None] = OrderedDict()
        # Siblings being read: request -> (notifications still to hold back, the
        # notifications of one decode child).
        self._reads_to_hold: dict[str, tuple[int, int]] = {}

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

    def _siblings(
        self, req_id: str, *groups: Collection[str]
    ) -> tuple[str, list[list[str]]] | None:
        """``(parent, the siblings of req_id found in each of groups)``, or None. O(n):
        an index beyond the requests in ``groups`` is no sibling (a client's id
        costs no long search)."""
        split = self.split(req_id) if self.enabled else None
        if split is None or split[0] > sum(len(group) for group in groups):
            return None
        index, parent = split
        found: list[list[str]] = [[] for _ in groups]
        last, i = index, 0
        while i <= last + 1:
            sibling = f"{i}_{parent}"
            for group, hits in zip(groups, found):
                if i != index and sibling in group:
                    hits.append(sibling)
                    last = max(last, i)
                    break
            i += 1
        return parent, found

    def others(self, req_id: str, registered: Collection[str]) -> list[str]:
        """The siblings of ``req_id`` among ``registered``, itself left out."""
        found = self._siblings(req_id, registered)
        return found[1][0] if found else []

    def reads(
        self,
        req_id: str,
        notifications: int,
        per_reader: int,
        registered: Collection[str],
    ) -> int:
        """How many of ``notifications`` for ``req_id`` count toward its release:
        ``per_reader`` are held back for each other sibling in ``registered``, so
        upstream's count completes with the last child's."""
        held, _ = self._reads_to_hold.get(req_id, (None, per_reader))
        if held is None:
            held = len(self.others(req_id, registered)) * per_reader
            if len(self._reads_to_hold) >= self.limit:
                del self._reads_to_hold[next(iter(self._reads_to_hold))]
        holding = min(held, notifications)
        self._reads_to_hold[req_id] = (held - holding, per_reader)
        return notifications - holding

    def child_read(self, req_id: str) -> bool:
        """Whether the notifications of ``req_id`` held back so far (``reads``) are
        whole decode children's: every decode rank of the last child that read it
        has notified, and the request is kept for the other children."""
        entry = self._reads_to_hold.get(req_id)
        return entry is not None and entry[0] % entry[1] == 0

    def pulled(
        self,
        req_id: str,
        registered: Collection[str],
        pulled_now: Collection[str] = (),
    ) -> list[str]:
        """Every decoder read of ``req_id`` is in: its siblings among ``registered``
        (not ``pulled_now``); later ones come from ``late``."""
        self._reads_to_hold.pop(req_id, None)
        found = self._siblings(req_id, registered, pulled_now)
        if found is None:
            return []
        parent, (siblings, pulled_together) = found
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


@add("F3", ">=0.24.0")
@add("F3", ">=0.20.0,<0.24.0", into="worker.py")
@add("F3", ">=0.18.0,<0.20.0", into="../nixl_connector.py")
class EarlyPullNotifications:
    """Pull notifications that reached the producer before ``start_load_kv`` registered
    their request: counted in ``staged`` (at most ``limit`` requests, oldest dropped)
    until it registers. Those for requests released without their pull are late
    (upstream's error stays), those for requests released by their pull repeats.
    """

    REPEAT_REPORTS = 128

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.staged: OrderedDict[str, tuple[int, int]] = OrderedDict()
        # staged's keys as a set, kept in step by stage, take and drop: a step's
        # requests intersect a set about twice as fast as a dict's keys.
        self._staged_ids: set[str] = set()
        # Registered requests whose staged notifications were complete, waiting
        # to register to send: request -> expected notifications.
        self.complete: dict[str, int] = {}
        # Requests released without their pull completing, oldest first.
        self._released_without_pull: OrderedDict[str, None] = OrderedDict()
        # Requests released by their pull, one set per report, oldest first.
        self._released_by_pull: deque[AbstractSet[str]] = deque()
        self._released_by_pull_count = 0

    def released_by_pull(self, req_ids: AbstractSet[str]) -> None:
        """Remember the requests one report released because their pull completed."""
        self._released_by_pull.append(req_ids)
        self._released_by_pull_count += len(req_ids)
        while (
            self._released_by_pull_count > self.limit
            or len(self._released_by_pull) > self.REPEAT_REPORTS
        ):
            self._released_by_pull_count -= len(self._released_by_pull.popleft())

    def is_repeat(self, req_id: str) -> bool:
        """Whether ``req_id`` (not held) was released because its pull completed."""
        return any(req_id in report for report in self._released_by_pull)

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
