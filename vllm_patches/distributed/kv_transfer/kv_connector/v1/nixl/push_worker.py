# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Overlay of ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py``.

NIXL push mode (v0.24+), worker side:

- F16 (producer, up to v0.29): a failed WRITE is no failed receive.
- F9 (decoder): a registration the watchdog gave up on is a failed receive.
- F10 (producer): a heartbeat renews what the heartbeated id's registration pairs with.
- F11 (both): a decode request that never registers releases the producer's prompt
  (``PushReleases``).
- F13 (producer): no lease releases blocks a WRITE is reading (``WriteHolds``).
- F14 (both): a registration past its decoder's timeout is dropped
  (``ParkedRegistrations``).
- F18 (producer side, v0.30.0; upstream since v0.31.0): a request each of whose
  WRITEs completed is reported done sending in the poll that sees it, where
  upstream reported only requests it receives for, so every pushed prompt was held
  until its lease. A request with a failed WRITE (posted or not) is not reported,
  even when a sibling WRITE completes later: its lease releases it.
- F19 (producer side, up to v0.27; upstream since v0.28.0): a decoder with a partial
  prefix hit registers only its blocks after the cached prefix, and they get the
  producer's last blocks of the prompt; upstream's _xfer_blocks paired them with its
  first ones, so the decoder decoded from the start of the prompt's KV in place of
  its end (vllm-project/vllm#48633). Where a logical block holds a different number
  of kernel blocks on the two sides (heterogeneous TP of a hybrid model), an
  attention group's surplus is allocation rounding at the end, and blocks of another
  size are mapped by _xfer_blocks itself: both keep upstream's pairing.
- F21 (producer side, up to v0.25; upstream since v0.26.0): a request's WRITEs (one
  per decoder rank) are posted one at a time, and the poll may run between two
  posts; a request is not reported done while the writer is still posting its
  WRITEs, even if those posted so far completed.
"""

import heapq
import queue
import time
from concurrent.futures import Future
from dataclasses import replace
from functools import cached_property
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqId,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import (
    ReadSpec,
    _is_ssm_spec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from vllm_patches._overlay import (
    add,
    amend,
    call_at_end_of,
    filter_call_in,
    filter_result_of,
    redirect_call_in,
)


@amend("F16", ">=0.24.0")
class NixlPushConnectorWorker:
    """F16: a failed WRITE does not end the producer's worker."""

    @cached_property
    def _failed_writes(self) -> set[ReqId]:
        """Requests whose WRITE NIXL reported failed in the running poll of
        _sending_transfers, until that poll leaves them out of what it returns."""
        return set()

    def _handle_failed_transfer(self, req_id: str, handle: int | None) -> None:
        """Only a request this worker receives for is a failed receive: a failed WRITE
        of its own is released and counted here, and its lease releases the request (the
        base method's queue ended the worker on ``assert meta is not None``)."""
        if req_id not in self._sending_transfers:
            super()._handle_failed_transfer(req_id, handle)
            return
        self._failed_writes.add(req_id)
        if handle is not None:
            self.nixl_wrapper.release_xfer_handle(handle)
        self.xfer_stats.record_failed_transfer()

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> set[str]:
        """The base poll, less the requests whose WRITE failed in it: their push did
        not complete, so they are not done sending."""
        done = super()._pop_done_transfers(transfers)
        failed = self._failed_writes
        if not failed:
            return done
        done -= failed
        failed.clear()
        return done


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


@amend("F10", ">=0.24.0")
class NixlPushConnectorWorker:
    """F10: heartbeats renew the leases their registrations would be served from."""

    @cached_property
    def _renew_push_leases(self) -> bool:
        """kv_connector_extra_config["renew_push_leases"] (default true); a cached
        property, so workers built without __init__ (tests) have it too."""
        config = getattr(self, "kv_transfer_config", None)
        if config is None:
            return True
        return bool(config.get_from_extra_config("renew_push_leases", True))

    @redirect_call_in("_get_new_notifs", "self._handle_heartbeat")
    def _renew_paired_leases(self, payload: str) -> None:
        """Renew the held requests a heartbeat id pairs with as a registration does
        (the id, or the id less its random suffix), besides the ids themselves
        (vllm-project/vllm#53095). O(held requests), only when an id is not held."""
        if self._renew_push_leases:
            paired = self._paired_held_requests(payload.split(","))
            if paired:
                payload = ",".join([payload, *paired])
        self._handle_heartbeat(payload)

    def _paired_held_requests(self, req_ids: list[str]) -> list[str]:
        """The held requests (``_reqs_to_send``) that the ids not held as they
        are pair with by base id, each once, none of the ids themselves."""
        held = self._reqs_to_send
        unheld = [req_id for req_id in req_ids if req_id not in held]
        if not unheld or not held:
            return []
        by_base: dict[str, list[str]] = {}
        for held_id in held:
            by_base.setdefault(get_base_request_id(held_id), []).append(held_id)
        named = set(req_ids)
        paired = (
            held_id
            for req_id in unheld
            for held_id in by_base.get(get_base_request_id(req_id), ())
        )
        return [held_id for held_id in dict.fromkeys(paired) if held_id not in named]


@add("F11", ">=0.24.0")
class PushReleases:
    """Releases of decoder requests that never register, paired as their registration
    would be; one that pairs with nothing yet waits up to ``hold`` seconds, and each
    decoder request id is acted on once (every decoder rank sends it)."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        # Decoder request ids acted on, with their deadline; insertion order is
        # deadline order (the hold is constant, the clock monotonic).
        self._seen: dict[str, float] = {}
        # Staged decoder request ids by their base id, oldest first.
        self._staged: dict[str, list[str]] = {}

    def first(self, decoder_req_id: str, now: float) -> bool:
        """Whether this release is the first for ``decoder_req_id`` (recorded)."""
        self.expire(now)
        if decoder_req_id in self._seen:
            return False
        self._seen[decoder_req_id] = now + self.hold
        return True

    def stage(self, decoder_req_id: str) -> None:
        """Keep a release that pairs with no finished request yet."""
        base = get_base_request_id(decoder_req_id)
        self._staged.setdefault(base, []).append(decoder_req_id)

    def claim(self, request_id: str, now: float) -> str | None:
        """The staged release a newly finished request pairs with (taken), if any."""
        if not self._staged:
            return None
        self.expire(now)
        base = get_base_request_id(request_id)
        staged = self._staged.get(base)
        if not staged:
            return None
        decoder_req_id = request_id if request_id in staged else staged[0]
        staged.remove(decoder_req_id)
        if not staged:
            del self._staged[base]
        return decoder_req_id

    def expire(self, now: float) -> None:
        """Forget the releases whose hold passed; staged ones are dropped (the
        producer's lease then frees what they would have released)."""
        seen = self._seen
        while seen:
            decoder_req_id, deadline = next(iter(seen.items()))
            if deadline > now:
                return
            del seen[decoder_req_id]
            base = get_base_request_id(decoder_req_id)
            staged = self._staged.get(base)
            if staged and decoder_req_id in staged:
                staged.remove(decoder_req_id)
                if not staged:
                    del self._staged[base]


@amend("F11", ">=0.24.0")
class NixlPushConnectorWorker:
    """F11: a decoder request that never registers releases the producer's prompt."""

    # A release is a heartbeat entry with this mark: "HB:<mark><decoder request
    # id>". A producer without this fix looks the entry up as a request id it
    # holds, finds none and ignores it, as it ignores any heartbeat for a request
    # it does not hold.
    _PUSH_RELEASE_MARK = "push-release/"

    @cached_property
    def _push_release_enabled(self) -> bool:
        """kv_connector_extra_config["release_unregistered_push_requests"]
        (default true); off, a decoder sends no release and a producer lets the
        ones it receives through to _handle_heartbeat, which ignores them."""
        config = getattr(self, "kv_transfer_config", None)
        if config is None:
            return True
        return bool(
            config.get_from_extra_config("release_unregistered_push_requests", True)
        )

    @cached_property
    def _push_release_outbox(self) -> queue.Queue[tuple[str, tuple[Any, ...]]]:
        """Decoder: releases to send, from the engine thread to the writer."""
        return queue.Queue()

    @cached_property
    def _push_released(self) -> queue.Queue[str]:
        """Producer: requests the writer released, for the engine thread."""
        return queue.Queue()

    @cached_property
    def _push_releases(self) -> "PushReleases":
        """Producer, writer thread: the releases received, each kept for at
        most the producer's own lease (kv_lease_duration)."""
        config = getattr(self, "kv_transfer_config", None)
        if config is None:
            return PushReleases(hold=30.0)
        lease = config.get_from_extra_config("kv_lease_duration", 30)
        return PushReleases(hold=float(lease))

    @cached_property
    def _push_release_claimed(self) -> list[str]:
        """Producer, writer thread: finished requests a staged release claimed in
        this pass of the writer loop."""
        return []

    @call_at_end_of("__init__")
    def _init_push_releases(self) -> None:
        """Make the state both threads share before the writer starts (the
        properties above also serve workers built without __init__)."""
        _ = (self._push_release_enabled, self._push_release_outbox)
        _ = (self._push_released, self._push_releases, self._push_release_claimed)

    # --- Decoder side --------------------------------------------------- #

    @call_at_end_of("start_load_kv")
    def _release_unregistered(self, metadata: NixlConnectorMetadata) -> None:
        """Drop the receive request_finished stages for a request that never
        registers (no blocks, no registration this step), and release its prompt on
        the producer."""
        queued = False
        for req_id, meta in metadata.reqs_to_recv.items():
            if req_id in metadata.push_registrations or any(meta.local_block_ids):
                continue
            if self._recving_metadata.pop(req_id, None) is None:
                continue
            if not self._push_release_enabled or meta.remote is None:
                continue
            remote = meta.remote
            target = (
                remote.engine_id,
                remote.host,
                remote.port,
                meta.tp_size,
                getattr(meta, "pp_size", 1),
            )
            self._push_release_outbox.put((req_id, target))
            queued = True
        if queued:
            self._push_writer_wake.set()

    def _send_push_releases(self) -> None:
        """Writer thread: send the queued releases, each once the handshake with
        its producer is done (started here if needed, as for a registration)."""
        while True:
            try:
                req_id, target = self._push_release_outbox.get_nowait()
            except queue.Empty:
                return
            self._send_push_release(req_id, target)

    def _send_push_release(self, req_id: str, target: tuple[Any, ...]) -> None:
        engine_id = target[0]
        fut = self._push_release_handshake(*target)
        if fut is not None:

            def _on_handshake(
                f: Future[Any], rid: str = req_id, tgt: tuple[Any, ...] = target
            ) -> None:
                if f.exception() is not None:
                    # Logged by the handshake; the producer's lease frees the prompt.
                    return
                self._push_release_outbox.put((rid, tgt))
                self._push_writer_wake.set()

            fut.add_done_callback(_on_handshake)
            return
        with self._handshake_lock:
            agents = list((self._remote_agents.get(engine_id) or {}).values())
        notif_msg = f"HB:{self._PUSH_RELEASE_MARK}{req_id}".encode()
        for agent_name in agents:
            try:
                self.nixl_wrapper.send_notif(agent_name, notif_msg=notif_msg)
            except Exception:
                logger.debug(
                    "Failed to send the release of request %s to engine %s",
                    req_id,
                    engine_id,
                    exc_info=True,
                )
        logger.debug("Sent the release of request %s to engine %s", req_id, engine_id)

    # --- Producer side -------------------------------------------------- #

    @filter_call_in("_push_writer_loop", "self.nixl_wrapper.get_new_notifs")
    def _take_push_releases(
        self, notifs: dict[str, list[bytes]]
    ) -> dict[str, list[bytes]]:
        """Writer thread, once per pass: release what staged releases claimed,
        take the releases among the new notifications (the rest go on as
        upstream routes them), and send this engine's own releases."""
        for request_id in self._push_release_claimed:
            if self._push_finished_blocks.pop(request_id, None) is not None:
                self._release_pushed_request(request_id)
        self._push_release_claimed.clear()
        kept = notifs
        if self._push_release_enabled:
            kept = self._without_push_releases(notifs)
        try:
            self._send_push_releases()
        except Exception:
            # Never lose the notifications this pass fetched; the producer's lease
            # frees what a release that was not sent would have freed.
            logger.exception("Sending KV releases to a producer failed")
        return kept

    def _without_push_releases(
        self, notifs: dict[str, list[bytes]]
    ) -> dict[str, list[bytes]]:
        """Act on the releases among ``notifs``; the notifications without them."""
        mark = b"HB:" + self._PUSH_RELEASE_MARK.encode()
        if not any(n.startswith(mark) for msgs in notifs.values() for n in msgs):
            return notifs
        kept: dict[str, list[bytes]] = {}
        for agent_name, messages in notifs.items():
            rest = []
            for notif in messages:
                if not notif.startswith(mark):
                    rest.append(notif)
                    continue
                plain = self._on_push_release(notif)
                if plain:
                    # Heartbeat entries sent with the release still renew leases.
                    rest.append(("HB:" + ",".join(plain)).encode())
            kept[agent_name] = rest
        return kept

    def _on_push_release(self, notif: bytes) -> list[str]:
        """Release the finished request each marked entry's decoder request
        (which will never register) pairs with, or stage the release if none
        does yet; returns the entries that are not releases."""
        entries = notif[3:].decode("utf-8", errors="replace").split(",")
        mark = self._PUSH_RELEASE_MARK
        now = time.perf_counter()
        plain = []
        for entry in entries:
            if not entry.startswith(mark):
                plain.append(entry)
                continue
            decoder_req_id = entry[len(mark) :]
            if not self._push_releases.first(decoder_req_id, now):
                continue
            match = self._pop_matching_finished_blocks(decoder_req_id)
            if match is None:
                self._push_releases.stage(decoder_req_id)
            else:
                self._release_pushed_request(match[0])
        return plain

    @redirect_call_in("_push_writer_loop", "self._pop_matching_registration")
    def _pair_or_claim(self, request_id: str) -> dict[str, Any] | None:
        """A newly finished request is pushed to the registration it pairs with;
        with none, a staged release may claim it (released in this pass)."""
        registration = self._pop_matching_registration(request_id)
        claimed = None
        if registration is None:
            claimed = self._push_releases.claim(request_id, time.perf_counter())
        if claimed is not None:
            self._push_release_claimed.append(request_id)
        return registration

    def _release_pushed_request(self, request_id: str) -> None:
        """Hand a request no decoder will register for to the engine thread."""
        logger.debug(
            "Releasing KV blocks for request %s: its decode request finished "
            "without registering.",
            request_id,
        )
        self._push_released.put(request_id)

    @filter_result_of("_get_new_notifs")
    def _with_released_requests(self, notified: set[str]) -> set[str]:
        """Engine thread: report the released requests done sending (their
        blocks are freed), unless their lease already released them."""
        released = self._push_released
        while not released.empty():
            try:
                request_id = released.get_nowait()
            except queue.Empty:
                break
            if self._reqs_to_send.pop(request_id, None) is None:
                continue
            self._reqs_to_process.discard(request_id)
            self.consumer_notification_counts_by_req.pop(request_id, None)
            notified.add(request_id)
        return notified


@amend("F11", ">=0.24.0,<0.26.0")
class NixlPushConnectorWorker:
    """F11: the handshake a release needs, up to v0.25."""

    def _push_release_handshake(
        self, engine_id: str, host: str, port: int, tp_size: int, pp_size: int
    ) -> Future[Any] | None:
        return self._ensure_handshake(engine_id, host, port, tp_size)


@amend("F11", ">=0.26.0,<0.27.0")
class NixlPushConnectorWorker:
    """F11: the handshake a release needs, v0.26 (as a registration's)."""

    def _push_release_handshake(
        self, engine_id: str, host: str, port: int, tp_size: int, pp_size: int
    ) -> Future[Any] | None:
        return self._ensure_handshake(
            engine_id,
            host,
            port,
            tp_size,
            pp_size=pp_size,
            notif_agents_only=pp_size > 1,
        )


@amend("F11", ">=0.27.0")
class NixlPushConnectorWorker:
    """F11: the handshake a release needs, from v0.27 (as a registration's:
    notification agents only)."""

    def _push_release_handshake(
        self, engine_id: str, host: str, port: int, tp_size: int, pp_size: int
    ) -> Future[Any] | None:
        return self._ensure_handshake(
            engine_id,
            host,
            port,
            tp_size,
            pp_size=pp_size,
            notif_agents_only=True,
        )


@add("F13", ">=0.24.0")
class WriteHolds:
    """Leases held while a posted WRITE, which cannot be aborted, may still read the
    blocks (vllm-project/vllm#58188): ``limit`` seconds from when it was first seen,
    then the lease it had is back unless a heartbeat renewed it past the hold."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        # Held request -> (the lease it had, the lease the hold set); None once
        # its hold ended, until the request leaves the leases (never held twice).
        self._held: dict[ReqId, tuple[float, float] | None] = {}

    def update(
        self, leases: dict[ReqId, float], writing: set[ReqId], now: float
    ) -> list[ReqId]:
        """Hold in ``leases`` each request of ``writing``, end the other holds, and
        return those still written to when the limit passed (their lease is back)."""
        held = self._held
        for req_id in [r for r in held if r not in leases]:
            del held[req_id]
        for req_id in writing:
            if req_id in leases and req_id not in held:
                lease = leases.pop(req_id)
                leases[req_id] = max(lease, now + self.limit)
                held[req_id] = (lease, leases[req_id])
        outlasted = []
        for req_id, hold in held.items():
            if hold is None:
                continue
            lease, held_to = hold
            still_writing = req_id in writing
            if still_writing and now < held_to:
                continue
            held[req_id] = None
            if leases[req_id] == held_to:
                leases[req_id] = lease
            if still_writing:
                outlasted.append(req_id)
        return outlasted


@amend("F13", ">=0.24.0")
class NixlPushConnectorWorker:
    """F13: no lease runs out under a WRITE in flight from the request's blocks."""

    @cached_property
    def _write_holds(self) -> "WriteHolds":
        """The holds; kv_connector_extra_config["write_hold_limit"] seconds (120,
        0: none), made on first use."""
        config = getattr(self, "kv_transfer_config", None)
        if config is None:
            return WriteHolds(120.0)
        return WriteHolds(float(config.get_from_extra_config("write_hold_limit", 120)))

    @filter_result_of("_get_new_notifs")
    def _hold_under_writes(self, notified: set[ReqId]) -> set[ReqId]:
        """No request is released by lease while a WRITE from its blocks is in flight
        (in _sending_transfers), for at most write_hold_limit seconds. Runs where
        _get_new_notifs returns, right before expired leases are released."""
        holds = self._write_holds
        if holds.limit <= 0:
            return notified
        with self._sending_transfers_lock:
            writing = {
                req_id for req_id, handles in self._sending_transfers.items() if handles
            }
        for req_id in holds.update(self._reqs_to_send, writing, time.perf_counter()):
            logger.warning(
                "A WRITE of the KV blocks of request %s is still in flight after "
                "%.0f s (write_hold_limit); releasing them by lease.",
                req_id,
                holds.limit,
            )
        return notified


@add("F14", ">=0.24.0")
class ParkedRegistrations:
    """When decoder registrations expire: at the decoder's ``expires_at`` (wall clock;
    an idle producer's writer reads registrations late, so it cannot time them), or
    ``timeout`` after it was read when a registration carries none."""

    KEY = "expires_at"

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        # (deadline on the local monotonic clock, decoder request id), a heap.
        self._deadlines: list[tuple[float, str]] = []

    def stamp(self, registration: dict[str, Any], wall_now: float) -> None:
        """Decoder: say when this registration's decoder gives up on it (kept when
        the registration is stamped already: it comes back after a handshake)."""
        registration.setdefault(self.KEY, wall_now + self.timeout)

    def expires_at(self, registration: dict[str, Any]) -> float | None:
        """When the registration's decoder gives up on it (wall clock), or None
        when the registration does not say (a decoder without the fix)."""
        expires_at = registration.get(self.KEY)
        return float(expires_at) if isinstance(expires_at, (int, float)) else None

    def outlived(self, registration: dict[str, Any], wall_now: float) -> bool:
        """Whether the registration's decoder gave up on it already."""
        expires_at = self.expires_at(registration)
        return expires_at is not None and expires_at <= wall_now

    def arrived(
        self, registration: dict[str, Any], now: float, wall_now: float
    ) -> None:
        """Producer: start watching a registration that was just read."""
        req_id = registration.get("request_id")
        if not isinstance(req_id, str):
            return
        expires_at = self.expires_at(registration)
        if expires_at is None:
            deadline = now + self.timeout
        else:
            deadline = now + (expires_at - wall_now)
        heapq.heappush(self._deadlines, (deadline, req_id))

    def expired(self, now: float) -> list[str]:
        """The decoder request ids whose deadline passed (forgotten here)."""
        deadlines = self._deadlines
        out = []
        while deadlines and deadlines[0][0] <= now:
            out.append(heapq.heappop(deadlines)[1])
        return out


@amend("F14", ">=0.24.0")
class NixlPushConnectorWorker:
    """F14: no decoder registration is served or parked past its decoder's timeout."""

    @cached_property
    def _parked_registrations(self) -> "ParkedRegistrations | None":
        """Writer thread: when registrations expire (push_registration_timeout), or
        None when kv_connector_extra_config["expire_push_registrations"] is false."""
        config = getattr(self, "kv_transfer_config", None)
        if config is None:
            return ParkedRegistrations(480.0)
        if not config.get_from_extra_config("expire_push_registrations", True):
            return None
        ttl = config.get_from_extra_config("decoder_kv_blocks_ttl", 480)
        timeout = config.get_from_extra_config("push_registration_timeout", ttl)
        return ParkedRegistrations(float(timeout))

    # --- Decoder side --------------------------------------------------- #

    @redirect_call_in("_push_writer_loop", "self._send_registration_to_p")
    def _send_stamped_registration(self, req_id: str, reg_data: dict) -> None:
        """Stamp a registration with when this decoder gives up on it, then send
        it (a producer without the fix ignores the key)."""
        parked = self._parked_registrations
        if parked is not None:
            parked.stamp(reg_data, time.time())
        self._send_registration_to_p(req_id, reg_data)

    # --- Producer side -------------------------------------------------- #

    @filter_call_in("_handle_push_reg_notif", "msgspec.msgpack.decode")
    def _registration_arrived(self, reg_data: Any) -> Any:
        """Watch each registration as it is read (it is served at once or
        parked), and drop the parked ones that expired."""
        parked = self._parked_registrations
        if parked is None or not isinstance(reg_data, dict):
            return reg_data
        now = time.perf_counter()
        self._drop_expired_registrations(now)
        parked.arrived(reg_data, now, time.time())
        return reg_data

    @redirect_call_in("_handle_push_reg_notif", "self._do_start_push_kv")
    def _write_unless_outlived(
        self, request_id: str, blocks: Any, reg_data: dict[str, Any]
    ) -> None:
        """WRITE a request's prompt to a registration that pairs with it as it
        arrives, unless its decoder gave up on it before it was read: then the
        request keeps waiting for a registration, and this one is dropped."""
        parked = self._parked_registrations
        if parked is not None and parked.outlived(reg_data, time.time()):
            self._push_finished_blocks[request_id] = blocks
            self._log_dropped_registration(reg_data.get("request_id"))
            return
        self._do_start_push_kv(request_id, blocks, reg_data)

    @filter_call_in("_push_writer_loop", "self._finished_blocks_inbox.get_nowait")
    def _before_pairing(self, finished: tuple[str, Any]) -> tuple[str, Any]:
        """No prompt is WRITTEN to a registration whose decoder gave up on it: drop
        the expired ones before pairing a newly finished request (upstream parks
        them for good, and a client's retry pairs with the oldest)."""
        if self._parked_registrations is not None:
            self._drop_expired_registrations(time.perf_counter())
        return finished

    def _drop_expired_registrations(self, now: float) -> None:
        parked = self._parked_registrations
        assert parked is not None
        for req_id in parked.expired(now):
            if self._pending_d_registrations.pop(req_id, None) is not None:
                self._log_dropped_registration(req_id)

    def _log_dropped_registration(self, req_id: Any) -> None:
        logger.warning(
            "Dropping the KV registration of decode request %s: its decoder gave "
            "up on it (push_registration_timeout) before a request of this "
            "producer paired with it.",
            req_id,
        )


@amend("F19", ">=0.24.0")
class NixlPushConnectorWorker:
    """F19: a decoder's partial prefix hit gets the tail of the prompt."""

    @redirect_call_in("_xfer_blocks_for_req", "self._xfer_blocks")
    def _xfer_uncached_tail(
        self, read_spec: ReadSpec, dst_engine_id: str, **kwargs: Any
    ) -> Any:
        """WRITE one decoder rank its blocks, paired from the end of the prompt."""
        spec = self._pair_from_the_end(read_spec, dst_engine_id)
        return self._xfer_blocks(read_spec=spec, dst_engine_id=dst_engine_id, **kwargs)

    def _pair_from_the_end(self, spec: ReadSpec, engine_id: str) -> ReadSpec:
        """Where this producer holds more blocks of a group than the decoder
        registered, only its last ones: the decoder's prefix cache holds the rest
        (kept as it is where the two sides' kernel blocks differ in size or layout)."""
        assert self.transfer_topo is not None
        remote = self.transfer_topo.get_engine_info(engine_id)
        if self.transfer_topo.block_size_ratio(remote.remote_block_size) != 1:
            return spec
        same_layout = (
            remote.remote_physical_blocks_per_logical
            == self._physical_blocks_per_logical_kv_block
        )
        ours = list(spec.local_block_ids)
        for group, theirs in enumerate(spec.remote_block_ids[: len(ours)]):
            surplus = len(ours[group]) - len(theirs)
            if surplus <= 0:
                continue
            if same_layout or _is_ssm_spec(self._group_spec_types[group]):
                ours[group] = list(ours[group][surplus:])
        return replace(spec, local_block_ids=ours)


@amend("F18", ">=0.30.0")
class NixlPushConnectorWorker:
    """F18: a push whose every WRITE completed is reported done sending."""

    @cached_property
    def _push_failures(self) -> set[ReqId]:
        """Requests with a WRITE that failed, posted or not, until none of their
        WRITEs is in flight or they were released. Read and written under
        _sending_transfers_lock (the writer thread adds to it)."""
        return set()

    @cached_property
    def _completed_pushes(self) -> set[ReqId]:
        """Engine thread: the requests whose every WRITE completed in the running
        get_transfer_results, for it to report done sending."""
        return set()

    def _pop_done_transfers(
        self, transfers: dict[str, list[int]]
    ) -> tuple[set[str], set[str]]:
        """The base poll; of the push WRITEs (_sending_transfers, polled under
        its lock), note each held request whose WRITEs all completed.

        A request released already (its lease ran out) is not noted: it was
        reported once. One with a failed WRITE, in this poll or an earlier one,
        is not noted either: a failed push must not be reported done, and a
        sibling WRITE (one per decoder rank) may complete after it failed."""
        done, failed = NixlBaseConnectorWorker._pop_done_transfers(self, transfers)
        if transfers is not self._sending_transfers:
            return done, failed
        failures = self._push_failures
        failures |= failed
        held = self._reqs_to_send.keys() | self._reqs_to_process
        self._completed_pushes.update((done - failures) & held)
        failures -= done
        return done, failed

    @filter_result_of("get_transfer_results")
    def _report_completed_pushes(
        self, results: KVConnectorTransferResults
    ) -> KVConnectorTransferResults:
        """Report done sending the requests whose push completed in this call,
        as upstream does for a request it is done with (its lease and
        notification count dropped, the writer told to forget it).

        Invariant: a producer's request whose every WRITE completed, none
        failed, is reported done sending in the get_transfer_results call
        whose poll sees it, and its blocks are freed. Upstream reports a
        completed WRITE only for a request in _recving_metadata, which holds
        what this worker receives, never what it pushes: every pushed prompt
        was held until its lease ran out ("Releasing expired KV blocks ...
        retrieved by 0 remote worker(s)")."""
        completed = self._completed_pushes
        finished = results.finished_sending
        for req_id in completed:
            self._reqs_to_send.pop(req_id, None)
            self._reqs_to_process.discard(req_id)
            self.consumer_notification_counts_by_req.pop(req_id, None)
            finished.add(req_id)
            self._evict_finished_inbox.put(req_id)
        if completed:
            completed.clear()
            self._push_writer_wake.set()
        if finished:
            # A request released with a WRITE still in flight is never reported
            # again: forget its failure.
            with self._sending_transfers_lock:
                self._push_failures.difference_update(finished)
        return results

    @redirect_call_in("_xfer_blocks", "self._handle_failed_transfer")
    def _note_failed_submission(self, request_id: str, handle: int | None) -> bool:
        """Writer thread: a WRITE that could not be posted is a failed push,
        even when the request's other WRITEs are posted and complete."""
        with self._sending_transfers_lock:
            self._push_failures.add(request_id)
        return self._handle_failed_transfer(request_id, handle)


@amend("F21", ">=0.24.0")
class NixlPushConnectorWorker:
    """F21: no request is done sending while its WRITEs are being posted."""

    @cached_property
    def _posting(self) -> set[ReqId]:
        """Requests whose WRITEs the writer thread is posting, read and written
        under _sending_transfers_lock."""
        return set()

    @redirect_call_in("_do_start_push_kv", "self._xfer_blocks_for_req")
    def _post_writes_as_one(self, req_id: str, meta: ReqMeta) -> None:
        """Writer thread: post the request's WRITEs, one per decoder rank, with the
        request marked as posting until the last is posted or has failed."""
        with self._sending_transfers_lock:
            self._posting.add(req_id)
        try:
            self._xfer_blocks_for_req(req_id=req_id, meta=meta)
        finally:
            with self._sending_transfers_lock:
                self._posting.discard(req_id)

    @filter_call_in("get_finished", "self._pop_done_transfers")
    def _hold_back_requests_in_posting(self, done: set[str]) -> set[str]:
        """Engine thread, under _sending_transfers_lock: a request is done sending
        only once its last WRITE was posted and completed (PR 45880). One still
        posting keeps an entry, so that a later poll reports it."""
        posting = done & self._posting
        for req_id in posting:
            self._sending_transfers.setdefault(req_id, [])
        return done - posting
