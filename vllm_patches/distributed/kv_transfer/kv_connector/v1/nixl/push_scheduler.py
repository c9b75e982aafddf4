# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py``.

NIXL push mode (v0.24+), decoder scheduler side:

- F15 (up to v0.25): a decode leg has ``remote_block_ids`` from its arrival.
- F9: a registration the watchdog gives up on is named in the step's metadata, for
  the workers to fail (deadlines are watched from update_state_after_alloc: the
  watchdog's pops are inside build_connector_meta, which calls ``super()``).
- F10: heartbeats also name the decoder's own request ids.
- F12: a request that takes its whole prompt from the prefix cache stages the empty
  receive that releases the producer's copy, as the pull scheduler does.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqId,
)

from vllm_patches._overlay import (
    amend,
    call_at_end_of,
    filter_result_of,
    redirect_call_in,
)

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@amend("F15", ">=0.24.0")
class NixlPushConnectorScheduler:
    """F15: a decode request aborted before it is scheduled does not end the
    engine."""

    def on_new_request(self, request: Request) -> None:
        """Keep: a push decode leg has ``remote_block_ids`` from its arrival, so that
        the empty receive request_finished stages for it builds (upstream seeds it there
        from v0.26.0; before, build_connector_meta's KeyError ended the EngineCore)."""
        super().on_new_request(request)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            params.setdefault("remote_block_ids", ())


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
    def _push_watched_registrations(self) -> set[ReqId]:
        """Requests whose registration deadline is armed, until their push
        completes or the watchdog drops the deadline."""
        return set()

    @call_at_end_of("update_state_after_alloc")
    def _watch_registration(self, request: Request) -> None:
        """Watch the deadline that update_state_after_alloc armed for a request."""
        if (
            self._report_expired_registrations
            and request.request_id in self._push_registration_deadlines
        ):
            self._push_watched_registrations.add(request.request_id)

    @call_at_end_of("update_connector_output")
    def _unwatch_served(self, connector_output: KVConnectorOutput) -> None:
        """A completed push clears the deadline: nothing to report."""
        for req_id in connector_output.finished_recving or ():
            self._push_watched_registrations.discard(req_id)

    @filter_result_of("build_connector_meta")
    def _with_expired_registrations(
        self, meta: KVConnectorMetadata
    ) -> KVConnectorMetadata:
        """The watchdog in build_connector_meta drops the deadlines that passed;
        a watched request whose deadline is gone is one it gave up on, and the
        step's metadata names it for the workers, which report its receive
        failed."""
        watched = self._push_watched_registrations
        if not watched:
            return meta
        expired = {r for r in watched if r not in self._push_registration_deadlines}
        if expired:
            watched.difference_update(expired)
            assert isinstance(meta, NixlConnectorMetadata)
            meta.push_expired_registrations = expired
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


@amend("F10", ">=0.24.0")
class NixlPushConnectorScheduler:
    """F10: the heartbeats name what the producer can pair with its requests."""

    @cached_property
    def _heartbeat_own_request_ids(self) -> bool:
        """kv_connector_extra_config["renew_push_leases"] (default true); a cached
        property, so schedulers built without __init__ (tests) have it too."""
        vllm_config = getattr(self, "vllm_config", None)
        config = getattr(vllm_config, "kv_transfer_config", None)
        if config is None:
            return True
        return bool(config.get_from_extra_config("renew_push_leases", True))

    @filter_result_of("build_connector_meta")
    def _with_own_heartbeat_ids(self, meta: KVConnectorMetadata) -> KVConnectorMetadata:
        """Add to each remote engine's heartbeat the ids of this decoder's requests that
        heartbeat it (vllm-project/vllm#53095); the step's metadata gets copies,
        upstream's remote ids stay. O(tracked requests) per heartbeat interval."""
        assert isinstance(meta, NixlConnectorMetadata)
        if not meta.heartbeat_by_engine or not self._heartbeat_own_request_ids:
            return meta
        own: dict[str, set[str]] = {}
        for req_id, (engine_id, _) in self._heartbeat_req_engine.items():
            own.setdefault(engine_id, set()).add(req_id)
        meta.heartbeat_by_engine = {
            engine_id: dataclasses.replace(
                info, req_ids=info.req_ids | own.get(engine_id, set())
            )
            for engine_id, info in meta.heartbeat_by_engine.items()
        }
        return meta


@amend("F12", ">=0.28.0")
class NixlPushConnectorScheduler:
    """F12: a decode request served from the local prefix cache releases the
    producer's prompt at once."""

    @cached_property
    def _release_prompt_of_local_hit(self) -> bool:
        """kv_connector_extra_config["write_prompt_once"] (default true); a cached
        property, so schedulers built without __init__ (tests) have it too."""
        vllm_config = getattr(self, "vllm_config", None)
        config = getattr(vllm_config, "kv_transfer_config", None)
        if config is None:
            return True
        return bool(config.get_from_extra_config("write_prompt_once", True))

    @call_at_end_of("update_state_after_alloc")
    def _release_remote_prompt_of_local_hit(self, request: Request) -> None:
        """A request still marked do_remote_prefill after update_state_after_alloc took
        its prompt from the prefix cache: stage now the empty receive that releases the
        producer's copy (its decode may outlast the lease), and unmark it."""
        params = request.kv_transfer_params
        if (
            not self._release_prompt_of_local_hit
            or not params
            or not params.get("do_remote_prefill")
        ):
            return
        params["remote_block_ids"] = ()
        self._reqs_need_recv[request.request_id] = (request, [], (), False)
        self._stop_heartbeat(request.request_id)
        params["do_remote_prefill"] = False
