"""Test-only probe for the real-engine lane: what the KV-cache path did, when.

Loaded into every vLLM process of an e2e run as a second ``vllm.general_plugins`` entry
point (``tests/e2e/harness.py`` writes its dist-info; nothing is pip-installed), in stock
and fixed runs alike. It wraps only code that no fix changes, and appends one JSON line
per event to ``$VLLM_PATCHES_E2E_PROBE`` with ``time.monotonic()`` (one system-wide
clock on Linux, so the lines of the scheduler and the worker processes compare):

- scheduler (``KVCacheManager.free``): ``free``: a request's block ids per KV-cache
  group when its blocks are freed, which of them reached ref_cnt 0 there (went back to
  the free queue, reusable by any request), and the blocks still in use after it;
- scheduler (``Scheduler._update_from_kv_xfer_finished``): ``finished_sending``: the
  requests the workers reported released (the scheduler frees them right after);
- scheduler (``Scheduler.schedule``): ``step``: KV usage and blocks in use, at each step
  that schedules work or changes them; and ``stall``/``stalled``: the one change the
  probe makes to a scheduler, on request only: a decode leg whose ``kv_transfer_params``
  carry ``STALL_KEY`` stops the engine core from stepping that many seconds, once, when
  it first waits (the fault matrix's slow decoder; no other request carries the key);
- worker (NIXL agent ``get_new_notifs``): ``notifs``: every pull notification as the
  producer's worker reads it, before vLLM (or a fix) interprets it;
- worker (NIXL agent ``make_prepped_xfer``, ``send_notif``): ``read``/``notif_sent``:
  each READ a decoder posts (descriptors, its notification) and each bare notification;
  with ``VLLM_PATCHES_E2E_SLOW_WRITE=<name>=<seconds>`` the probe also changes one
  thing: the producer's WRITEs whose notification names <name> are reported in flight
  (``check_xfer_state``) that long after they are posted, as on a slow link, although
  their bytes have landed (``write_slow`` at the post, ``write_slow_end`` when their
  real state is reported again);
- worker (``NixlConnector.get_transfer_results``, or ``get_finished`` where it has none: what
  the model runner calls): ``nixl_state``: requests the producer holds and, where a fix
  stages early notifications, how many are staged (when it changes);
- worker (the model runner's ``execute_model``, wrapped once a NIXL connector, pull or
  push, registers the KV caches): ``prompt_kv``: the KV a request holds for its prompt,
  read from the registered caches right after the step that completed its prompt: a
  digest of each block of it that its last token is not in (every layer).

The NIXL probes are installed only with ``VLLM_PATCHES_E2E_PROBE_NIXL=1``. With
``VLLM_PATCHES_E2E_NIXL_KV_CORE=C`` the CPU NIXL worker keeps its main thread on core C
(``_reserve_kv_core``) instead of moving it to the machine's last core. With
``VLLM_PATCHES_E2E_NIXL_POLL_US=N`` the probe also changes one thing: NIXL's progress
thread waits N microseconds between polls instead of spinning (the ``nixl_agent``
Python API hard-codes a delay of 0, and vLLM cannot set it). A spinning progress thread
takes most of a core per engine, which on a 2-core machine slows every engine process
several-fold; a notification is then delivered up to N us later, for stock and fixed
alike.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

PROBE_ENV = "VLLM_PATCHES_E2E_PROBE"
# "<name>=<seconds>": the producer's WRITEs whose notification contains <name> are
# reported in flight for <seconds> after they are posted (a slow link; see _probe_nixl).
SLOW_WRITE_ENV = "VLLM_PATCHES_E2E_SLOW_WRITE"

_fd: int | None = None


def emit(event: str, **fields: Any) -> None:
    """Append one event; a single O_APPEND write keeps lines of processes whole."""
    global _fd
    if _fd is None:
        _fd = os.open(os.environ[PROBE_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    line = json.dumps({"t": time.monotonic(), "pid": os.getpid(), "event": event, **fields})
    os.write(_fd, line.encode() + b"\n")


def wrap(owner: type, name: str, make: Any) -> None:
    """Replace ``owner.name`` (defined there or inherited) by ``make(original)``, keeping
    its metadata."""
    original = next(vars(cls)[name] for cls in owner.__mro__ if name in vars(cls))
    setattr(owner, name, functools.wraps(original)(make(original)))


def _used_blocks(pool: Any) -> int:
    """Blocks held by requests (the null block is never free, never counted)."""
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def _block_ids(manager: Any, request_id: str) -> list[list[int]]:
    return [list(group) for group in manager.get_block_ids(request_id)]


def _probe_scheduler() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def make_free(original: Any) -> Any:
        def free(self: Any, request: Any) -> None:
            groups = _block_ids(self, request.request_id)
            original(self, request)
            pool = self.block_pool
            freed = sorted({b for group in groups for b in group
                            if b and pool.blocks[b].ref_cnt == 0})
            emit("free", req=request.request_id, blocks=groups, freed=freed,
                 usage=self.usage, used_blocks=_used_blocks(pool))
        return free

    def make_xfer_finished(original: Any) -> Any:
        def update(self: Any, kv_connector_output: Any) -> Any:
            sending = sorted(kv_connector_output.finished_sending or ())
            recving = sorted(kv_connector_output.finished_recving or ())
            if sending or recving:
                emit("finished_sending", reqs=sending, recving=recving)
            return original(self, kv_connector_output)
        return update

    last_step: dict[str, Any] = {}

    stalled: set[str] = set()

    def make_schedule(original: Any) -> Any:
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            _stall_for_waiting(self, stalled)
            output = original(self, *args, **kwargs)
            state = {"used_blocks": _used_blocks(self.kv_cache_manager.block_pool),
                     "scheduled": len(output.num_scheduled_tokens),
                     "requests": len(self.requests)}
            # A step that schedules nothing (a decoder waiting for remote KV loops so)
            # is recorded only when the state changed.
            if state["scheduled"] or state != last_step:
                last_step.clear()
                last_step.update(state)
                emit("step", usage=self.kv_cache_manager.usage, **state)
            return output
        return schedule

    wrap(KVCacheManager, "free", make_free)
    wrap(Scheduler, "_update_from_kv_xfer_finished", make_xfer_finished)
    wrap(Scheduler, "schedule", make_schedule)


# A test-only key of a decode leg's kv_transfer_params: the engine core stops stepping
# this many seconds the first time it schedules with such a request waiting (once per
# remote request), as a decoder starved of CPU or stuck in a long step does.
STALL_KEY = "e2e_stall_s"


def _stall_for_waiting(scheduler: Any, stalled: set[str]) -> None:
    for request in list(scheduler.waiting):
        params = getattr(request, "kv_transfer_params", None) or {}
        remote = params.get("remote_request_id")
        if params.get(STALL_KEY) and remote not in stalled:
            stalled.add(remote)
            emit("stall", req=request.request_id, remote=remote, s=params[STALL_KEY])
            time.sleep(params[STALL_KEY])
            emit("stalled", req=request.request_id, remote=remote)
            return


def _probe_nixl() -> None:
    # Through vLLM's own loader: it sets UCX's environment before NIXL is imported.
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    from vllm.distributed.nixl_utils import NixlWrapper

    def make_get_new_notifs(original: Any) -> Any:
        def get_new_notifs(self: Any) -> Any:
            notifs = original(self)
            # errors="replace": push mode's PUSH_REG notifications carry msgpack.
            messages = [m.decode(errors="replace") for batch in notifs.values() for m in batch]
            if messages:
                emit("notifs", msgs=messages)
            return notifs
        return get_new_notifs

    # A WRITE whose notification names SLOW_WRITE_ENV's request is reported in flight
    # (``check_xfer_state`` "PROC") for that many seconds after it is posted: handle ->
    # (notification, when its real state is reported again).
    slow_name, _, slow_s = os.environ.get(SLOW_WRITE_ENV, "").partition("=")
    slow: dict[Any, tuple[str, float]] = {}

    def make_prepped_xfer(original: Any) -> Any:
        def prepped_xfer(self: Any, operation: Any, local_handle: Any, local_ids: Any,
                         remote_handle: Any, remote_ids: Any, *args: Any,
                         **kwargs: Any) -> Any:
            notif = kwargs.get("notif_msg", args[0] if args else b"")
            notif = notif.decode() if isinstance(notif, bytes) else str(notif)
            emit("read", op=str(operation), descs=len(remote_ids), notif=notif)
            handle = original(self, operation, local_handle, local_ids, remote_handle,
                              remote_ids, *args, **kwargs)
            if slow_name and slow_name in notif and "WRITE" in str(operation):
                slow[handle] = (notif, time.monotonic() + float(slow_s))
                emit("write_slow", notif=notif, until=slow[handle][1])
            return handle
        return prepped_xfer

    def make_check_xfer_state(original: Any) -> Any:
        def check_xfer_state(self: Any, handle: Any) -> Any:
            if handle in slow:
                notif, until = slow[handle]
                if time.monotonic() < until:
                    return "PROC"
                del slow[handle]
                emit("write_slow_end", notif=notif)
            return original(self, handle)
        return check_xfer_state

    def make_send_notif(original: Any) -> Any:
        def send_notif(self: Any, remote_agent_name: Any, *args: Any, **kwargs: Any) -> Any:
            notif = kwargs.get("notif_msg", args[0] if args else b"")
            emit("notif_sent", notif=notif.decode(errors="replace") if isinstance(notif, bytes)
                 else str(notif))
            return original(self, remote_agent_name, *args, **kwargs)
        return send_notif

    last_state: dict[str, Any] = {}

    # The model runner asks for the transfer results; newer NIXL connectors (v0.32)
    # answer that themselves, no longer through get_finished.
    finished = ("get_transfer_results" if hasattr(NixlConnector, "get_transfer_results")
                else "get_finished")

    def make_get_finished(original: Any) -> Any:
        def get_finished(self: Any, finished_req_ids: Any) -> Any:
            result = original(self, finished_req_ids)
            sending = result[0] if isinstance(result, tuple) else result.finished_sending
            worker = self.connector_worker
            early = getattr(worker, "_early_notifs", None)
            state = {
                "to_send": len(worker._reqs_to_send),
                "to_process": len(worker._reqs_to_process),
                "counting": len(worker.consumer_notification_counts_by_req),
                "staged": None if early is None else len(early.staged),
                "done_sending": sorted(sending or ()),
            }
            if state != last_state:
                last_state.clear()
                last_state.update(state)
                emit("nixl_state", **state)
            return result
        return get_finished

    def make_register_kv_caches(original: Any) -> Any:
        def register_kv_caches(self: Any, kv_caches: Any) -> Any:
            _probe_prompt_kv(kv_caches)
            return original(self, kv_caches)
        return register_kv_caches

    poll_us = os.environ.get("VLLM_PATCHES_E2E_NIXL_POLL_US")
    if poll_us:
        _poll_nixl_progress_every(NixlWrapper, int(poll_us))
    kv_core = os.environ.get("VLLM_PATCHES_E2E_NIXL_KV_CORE")
    if kv_core:
        _reserve_kv_core(int(kv_core))
    wrap(NixlWrapper, "get_new_notifs", make_get_new_notifs)
    wrap(NixlWrapper, "make_prepped_xfer", make_prepped_xfer)
    if slow_name:
        wrap(NixlWrapper, "check_xfer_state", make_check_xfer_state)
    wrap(NixlWrapper, "send_notif", make_send_notif)
    wrap(NixlConnector, finished, make_get_finished)
    # On the base class where there is one (v0.24+), so that the push connector's
    # engines record their prompts' KV too; NixlConnector is the pull connector there.
    connectors = sys.modules[NixlConnector.__module__]
    wrap(getattr(connectors, "NixlBaseConnector", NixlConnector), "register_kv_caches",
         make_register_kv_caches)


def prompt_digest(token_ids: Any) -> str:
    """What ``prompt_kv`` events name a prompt by: a digest of its token ids."""
    import hashlib

    return hashlib.sha1(repr(list(token_ids)).encode()).hexdigest()[:16]


def _probe_prompt_kv(kv_caches: dict[str, Any]) -> None:
    """Record ``prompt_kv`` for each request of this worker (see the module docstring).

    Installed from the worker process once its KV caches exist, so the model runner's
    module is already loaded there and no other process imports it. Reads whole blocks
    of the one KV-cache group of a plain attention model (each layer's cache has one
    axis of ``num_blocks``; how a kernel lays out the slots inside a block is its own).
    Full blocks only: a decoder computes the prompt's last token again (and F5's other
    children the whole partial last block), and on CPU that result depends on the batch
    it ran in, so the partial block need not equal the producer's bit for bit (a clean
    CI run showed it differ, where other runs had it equal).
    """
    import hashlib

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    layers = [kv_caches[name] for name in sorted(kv_caches)]
    recorded: set[str] = set()

    def block_bytes(runner: Any, block: int) -> str:
        """A digest of ``block`` in every layer."""
        sha = hashlib.sha1()
        for layer in layers:
            axis = tuple(layer.shape).index(runner.kv_cache_config.num_blocks)
            sha.update(layer.select(axis, block).contiguous().numpy().tobytes())
        return sha.hexdigest()[:16]

    def record(runner: Any, req_id: str, state: Any) -> None:
        # The blocks without the prompt's last token (the decoder computes that one).
        full = (state.num_prompt_tokens - 1) // runner.cache_config.block_size
        blocks = list(state.block_ids[0][:full])
        emit("prompt_kv", req=req_id, prompt=prompt_digest(state.prompt_token_ids),
             blocks=blocks,
             full=[block_bytes(runner, block) for block in blocks])

    def make_execute_model(original: Any) -> Any:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, scheduler_output, *args, **kwargs)
            # Tokens computed before this step, as the scheduler sent them.
            cached = scheduler_output.scheduled_cached_reqs
            before = dict(zip(cached.req_ids, cached.num_computed_tokens))
            before.update((new.req_id, new.num_computed_tokens)
                          for new in scheduler_output.scheduled_new_reqs)
            for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self.requests.get(req_id)
                if req_id in recorded or state is None or state.prompt_token_ids is None:
                    continue
                # The CPU runner has written the step's KV when it returns.
                if before.get(req_id, 0) + scheduled >= state.num_prompt_tokens:
                    recorded.add(req_id)
                    record(self, req_id, state)
            return result
        return execute_model

    wrap(GPUModelRunner, "execute_model", make_execute_model)


def _poll_nixl_progress_every(agent_class: type, microseconds: int) -> None:
    """Make every NIXL agent built from now on poll with ``microseconds`` of delay."""
    bindings = sys.modules[agent_class.__module__].nixlBind
    make_agent = bindings.nixlAgent

    def agent(name: str, config: Any) -> Any:
        config.pthrDelay = microseconds
        return make_agent(name, config)

    bindings.nixlAgent = agent


def _reserve_kv_core(core: int) -> None:
    """Make the CPU NIXL worker keep its main thread on ``core``.

    The worker moves its main thread, which also runs the model, to the last core of
    each NUMA node (the platform's ``discover_numa_topology``, used for nothing else):
    on a 1-node machine two engines then compute on the same core, and a producer
    step waits seconds behind the decoder's. Each engine keeps its own core instead.
    """
    from vllm.platforms import current_platform

    type(current_platform).discover_numa_topology = classmethod(lambda cls: [[core]])


def register() -> None:
    """The entry point: install the probes once per process (vLLM may call it again)."""
    if os.environ.get(PROBE_ENV) is None:
        raise RuntimeError(f"e2e probe loaded without {PROBE_ENV}")
    if getattr(register, "done", False):
        return
    register.done = True  # type: ignore[attr-defined]
    # The fixes first, whatever order vLLM loads plugins in: a call hook recompiles
    # upstream's method, which is refused once a wrapper hides it (CONTRIBUTING.md,
    # Overlays). Activation is once per process; vLLM's own call adds nothing.
    from vllm_patches._engine.runtime import register as activate_fixes

    activate_fixes()
    _probe_scheduler()
    if os.environ.get("VLLM_PATCHES_E2E_PROBE_NIXL") == "1":
        _probe_nixl()
    emit("probe")
