# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``.

NIXL decode scheduler heartbeats (KV leases, from v0.22; ``NixlConnectorScheduler``
in ``nixl/scheduler.py`` up to v0.23): F6 keeps a shared prompt heartbeated until its
last child stops, F7 keeps a bound on each prompt's lease, F8 marks posted READs.
F7's switch is here on every layout (``nixl/scheduler.py`` up to v0.23,
``nixl_connector.py`` up to v0.19).
"""

import dataclasses
import time
from collections import Counter
from functools import cached_property
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.utils import EngineId
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqId,
)

from vllm_patches._overlay import (
    amend,
    call_at_end_of,
    filter_call_in,
    filter_result_of,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request


@amend("F6", ">=0.24.0")
@amend("F6", ">=0.22.0,<0.24.0", into="scheduler.py", name="NixlConnectorScheduler")
class NixlBaseConnectorScheduler:
    """F6: a remote request stays in the heartbeats while any request needs it."""

    @cached_property
    def _heartbeat_holders(self) -> Counter[tuple[EngineId, ReqId]]:
        """How many tracked requests need the heartbeat of each remote request, by
        (remote engine id, remote request id): one per request, and n for the n
        children of a parallel-sampling request. Made on first use, so that
        schedulers built without __init__ (tests) have it too."""
        return Counter()

    @call_at_end_of("on_new_request")
    def _hold_heartbeat(self, request: "Request") -> None:
        """Count the request when on_new_request started tracking it."""
        key = self._heartbeat_req_engine.get(request.request_id)
        if key is not None:
            self._heartbeat_holders[key] += 1

    @filter_call_in("_stop_heartbeat", "self._heartbeat_req_engine.pop")
    def _last_heartbeat_holder(
        self, key: tuple[EngineId, ReqId] | None
    ) -> tuple[EngineId, ReqId] | None:
        """The remote request of a request that stops heartbeating, passed to upstream's
        removal only when no other tracked request needs it. O(1)."""
        if key is None:
            return None
        holders = self._heartbeat_holders
        holders[key] -= 1
        if holders[key] > 0:
            return None
        del holders[key]
        return key


@amend("F7", ">=0.24.0")
@amend("F7", ">=0.20.0,<0.24.0", into="scheduler.py", name="NixlConnectorScheduler")
@amend(
    "F7", ">=0.18.0,<0.20.0", into="../nixl_connector.py", name="NixlConnectorScheduler"
)
class NixlBaseConnectorScheduler:
    """F7's switch, read the same way on every layout."""

    def _recomputes_after_lapsed_lease(self) -> bool:
        """Whether a prompt the producer may have released is computed, not READ:
        kv_connector_extra_config["recompute_after_lapsed_lease"], true unless set
        false (also for a scheduler built without __init__, in tests)."""
        vllm_config = getattr(self, "vllm_config", None)
        config = getattr(vllm_config, "kv_transfer_config", None)
        return config is None or bool(
            config.get_from_extra_config("recompute_after_lapsed_lease", True)
        )


@amend("F7", ">=0.24.0")
@amend("F7", ">=0.22.0,<0.24.0", into="scheduler.py", name="NixlConnectorScheduler")
class NixlBaseConnectorScheduler:
    """F7: the time until which the decoder can vouch for each prompt's lease."""

    @cached_property
    def _lease_vouch_window(self) -> float | None:
        """Seconds after a renewal the producer surely holds the lease: its extension
        (lease * 2 // 3) less the heartbeat interval (lease // 6); None when
        recompute_after_lapsed_lease is off or no window is left."""
        if not self._recomputes_after_lapsed_lease():
            return None
        lease = self._kv_lease_duration
        window = lease * 2 // 3 - lease // 6
        return window if window > 0 else None

    @cached_property
    def _lease_vouched_until(self) -> dict[tuple[EngineId, ReqId], float]:
        """By (remote engine id, remote request id): the perf_counter time until which
        the producer surely holds the lease; -inf once it lapsed (a lapsed lease is
        never renewed)."""
        return {}

    def _lease_may_have_lapsed(self, key: tuple[EngineId, ReqId]) -> bool:
        """Whether the decoder can no longer vouch for the lease of prompt ``key``: its
        bound passed (for every request of it, whenever that request arrived)."""
        until = self._lease_vouched_until.get(key)
        return until is not None and time.perf_counter() > until

    def _request_lease_may_have_lapsed(self, req_id: ReqId) -> bool:
        """Whether the decoder can no longer vouch for the lease of the prompt request
        ``req_id`` reads (False for a request that reads none)."""
        key = self._heartbeat_req_engine.get(req_id)
        return key is not None and self._lease_may_have_lapsed(key)

    @call_at_end_of("on_new_request")
    def _start_lease_vouch(self, request: "Request") -> None:
        """A prompt the decoder starts tracking: the producer holds it for a full
        extension from the decode request's arrival (the proxy forwards it as the
        prefill finishes; kv_transfer_params carry no producer time to check by)."""
        key = self._heartbeat_req_engine.get(request.request_id)
        if key is None or key in self._lease_vouched_until:
            return
        window = self._lease_vouch_window
        if window is not None:
            # Counted from the front end's arrival stamp (time.time(), same host), not
            # from now: a stalled or busy engine core takes no input, and a request
            # that waited in its queue past the lease must not be read.
            queued = max(0.0, time.time() - request.arrival_time)
            self._lease_vouched_until[key] = time.perf_counter() - queued + window

    @cached_property
    def _left_after_lapse(self) -> set[ReqId]:
        """Requests that finished after their prompt's lease may have lapsed, until
        the next metadata is built (pull_scheduler.py notes them)."""
        return set()

    @filter_result_of("build_connector_meta")
    def _apply_lease_bounds(self, meta: NixlConnectorMetadata) -> NixlConnectorMetadata:
        """The step's metadata, less the empty receive of each request that left
        unscheduled once its prompt's lease may have lapsed (its notification would
        name blocks the producer may have freed: "Potentially invalid KV blocks"),
        and after moving on the bound of every prompt whose heartbeat it carries and
        whose bound has not passed (once per heartbeat interval)."""
        left = self._left_after_lapse
        for req_id in left:
            recv = meta.reqs_to_recv.get(req_id)
            if recv is not None and not any(recv.local_block_ids):
                del meta.reqs_to_recv[req_id]
        left.clear()
        if not meta.heartbeat_by_engine:
            return meta
        window = self._lease_vouch_window
        vouched_until = self._lease_vouched_until
        now = time.perf_counter()
        for engine_id, info in meta.heartbeat_by_engine.items():
            for remote_id in info.req_ids:
                until = vouched_until.get((engine_id, remote_id))
                if until is not None and window is not None and now <= until:
                    vouched_until[(engine_id, remote_id)] = now + window
        return meta

    @filter_call_in("_stop_heartbeat", "self._heartbeat_req_engine.pop")
    def _forget_lease_vouch(
        self, key: tuple[EngineId, ReqId] | None
    ) -> tuple[EngineId, ReqId] | None:
        """The prompt whose heartbeat stops (None while another request still needs
        it) leaves the bounds too."""
        if key is not None:
            self._lease_vouched_until.pop(key, None)
        return key


@amend("F8", ">=0.24.0")
@amend("F8", ">=0.22.0,<0.24.0", into="scheduler.py", name="NixlConnectorScheduler")
class NixlBaseConnectorScheduler:
    """F8: the heartbeats mark the prompts whose READ was scheduled."""

    # The heartbeat entry that marks a READ of <remote request id> as posted; the
    # producer's worker reads it (nixl/base_worker.py, the same mark).
    _READ_POSTED_MARK = "read-posted/"

    @cached_property
    def _marks_reads(self) -> bool:
        """Whether heartbeats mark READs: kv_connector_extra_config
        ["read_hold_limit"] is not 0. Made on first use, so that schedulers built
        without __init__ (tests) have it too."""
        vllm_config = getattr(self, "vllm_config", None)
        config = getattr(vllm_config, "kv_transfer_config", None)
        return config is None or bool(
            float(config.get_from_extra_config("read_hold_limit", 120))
        )

    @cached_property
    def _marked_reads(self) -> set[tuple[EngineId, ReqId]]:
        """(remote engine id, remote request id) of the prompts whose READ this
        scheduler scheduled, while they are heartbeated: a prompt whose heartbeat
        stopped is dropped at the next regular heartbeat. O(prompts read and
        heartbeated within the last interval)."""
        return set()

    @filter_result_of("build_connector_meta")
    def _mark_scheduled_reads(
        self, meta: NixlConnectorMetadata
    ) -> NixlConnectorMetadata:
        """The step's metadata, with a heartbeat marking each READ it schedules: the
        worker sends it after posting the READs, so the producer holds the prompt from
        then on. Later heartbeats repeat the mark. Upstream's heartbeat dict is not
        changed."""
        if not self._marks_reads:
            return meta
        marked = self._marked_reads
        tracked = self._heartbeat_by_engine
        scheduled: dict[EngineId, set[ReqId]] = {}
        for recv in meta.reqs_to_recv.values():
            remote = recv.remote
            if remote is None or not any(recv.local_block_ids):
                continue  # no READ: a notification only
            info = tracked.get(remote.engine_id)
            # Only a heartbeated prompt: its mark leaves with its heartbeat.
            if info is not None and remote.request_id in info.req_ids:
                marked.add((remote.engine_id, remote.request_id))
                scheduled.setdefault(remote.engine_id, set()).add(remote.request_id)
        if meta.heartbeat_by_engine:
            # A regular heartbeat: forget the marks of prompts no longer heartbeated.
            marked.intersection_update(
                (engine_id, remote_id)
                for engine_id, info in tracked.items()
                for remote_id in info.req_ids
            )
        if not marked or not (scheduled or meta.heartbeat_by_engine):
            return meta
        heartbeats = dict(meta.heartbeat_by_engine)
        for engine_id in scheduled.keys() - heartbeats.keys():
            heartbeats[engine_id] = dataclasses.replace(
                tracked[engine_id], req_ids=set(scheduled[engine_id])
            )
        mark = self._READ_POSTED_MARK
        for engine_id, info in heartbeats.items():
            marks = {
                f"{mark}{remote_id}"
                for remote_id in info.req_ids
                if (engine_id, remote_id) in marked
            }
            if marks:
                heartbeats[engine_id] = dataclasses.replace(
                    info, req_ids=info.req_ids | marks
                )
        meta.heartbeat_by_engine = heartbeats
        return meta
