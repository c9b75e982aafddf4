# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a decode request that never registers releases the prompt.

A decode request aborted before it was scheduled (its client left while every
decode seat was busy, or the serving layer rejected it) never allocates blocks
and never registers them with the producer. request_finished on the decoder
stages an empty receive for it "so the worker emits a notif that lets P free
them", as the pull connector does since PR 41269, but the push worker (PR 35264)
sends nothing: it keeps the empty receive in _recving_metadata for good (the
leak PR 55677 describes), and the producer holds the prompt until its KV lease
runs out ("Releasing expired KV blocks ... retrieved by 0 remote worker(s)").
vllm#46283 is the same abort path's leak for a request that did register.

These tests drive a producer and a decoder in one process, each with its
scheduler and a push worker whose NIXL agent is a stub on an in-process fabric
(notifications are delivered, nothing is transferred), and the workers'
writer threads running.
"""

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm.config import set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPushConnector,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

# The distributed world is set up once for the module (dist_world).
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_BLOCKS = 64
NUM_TOKENS = 40
# Long enough that no lease runs out during a test: a release is never the lease.
LEASE = 600
# Bound on the engine steps a test waits for something (a hang guard, not a
# timing claim: with the fix it takes a step or two).
MAX_STEPS = 250


class Fabric:
    """Delivers NIXL notifications between the stub agents of one test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inboxes: dict[str, dict[str, list[bytes]]] = {}
        self.delivered: dict[str, int] = {}
        self.writes = 0


class FakeNixlAgent:
    """A NIXL agent that sends and receives notifications on the fabric."""

    fabric = Fabric()

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.name = name
        with self.fabric.lock:
            self.fabric.inboxes[name] = {}

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        with self.fabric.lock:
            inbox = self.fabric.inboxes[agent_name]
            inbox.setdefault(self.name, []).append(notif_msg)
            delivered = self.fabric.delivered
            delivered[agent_name] = delivered.get(agent_name, 0) + 1

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self.fabric.lock:
            notifs = self.fabric.inboxes[self.name]
            self.fabric.inboxes[self.name] = {}
        return notifs

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> None:
        with self.fabric.lock:
            self.fabric.writes += 1

    def get_agent_metadata(self) -> bytes:
        return b"fake_agent_metadata"

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class FakeTopology:
    """Set by the first handshake in a real engine; none happens here. The peer
    is this engine's twin: same TP size and block size."""

    def __init__(self, block_size: int, physical_per_logical: int) -> None:
        self.engine_info = SimpleNamespace(
            remote_tp_size=1,
            remote_block_size=block_size,
            remote_physical_blocks_per_logical=physical_per_logical,
        )

    def tp_ratio(self, remote_tp_size: int) -> int:
        return 1

    def block_size_ratio(self, remote_block_size: int) -> int:
        return 1

    def get_engine_info(self, engine_id: str) -> SimpleNamespace:
        return self.engine_info

    def unregister_remote_engine(self, engine_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def dist_world() -> Iterator[None]:
    """A torch.distributed world of size 1 on CPU, for the push workers."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    try:
        with set_current_vllm_config(create_vllm_config()):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{path}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
        yield
    finally:
        cleanup_dist_env_and_memory()
        with contextlib.suppress(OSError):
            os.unlink(path)


class Engine:
    """A push engine: its scheduler, one push worker with its writer thread, and
    the steps between them."""

    def __init__(self, extra_config: dict[str, Any]) -> None:
        vllm_config = create_vllm_config(
            kv_connector="NixlPushConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"kv_lease_duration": LEASE, **extra_config},
        )
        self.block_size = vllm_config.cache_config.block_size
        self.scheduler = create_scheduler(vllm_config, num_blocks=NUM_BLOCKS)
        with set_current_vllm_config(vllm_config):
            self.connector = NixlPushConnector(
                vllm_config,
                KVConnectorRole.WORKER,
                make_kv_cache_config(block_size=self.block_size),
            )
        # The push worker, whose writer state and NIXL agent the tests reach.
        worker: Any = self.connector.connector_worker
        assert worker is not None
        worker.transfer_topo = FakeTopology(
            self.block_size,
            getattr(worker, "_physical_blocks_per_logical_kv_block", 1),
        )
        # Heartbeats would start a handshake; the tests make peers known instead.
        worker._send_heartbeats = lambda metadata: None
        self.worker = worker
        self.engine_id = worker.engine_id
        self.agent_name = worker.nixl_wrapper.name
        # register_kv_caches starts the writer; no KV caches are registered here.
        self.writer = threading.Thread(
            target=worker._push_writer_loop,
            daemon=True,
            name="test-nixl-push-writer",
        )
        self.writer.start()

    def knows(self, peer: "Engine") -> None:
        """The handshake with ``peer`` is done (a real engine's heartbeats or
        registrations make it)."""
        worker = self.worker
        worker._remote_agents[peer.engine_id] = {(0, 0): peer.agent_name}
        worker._engine_last_active[peer.engine_id] = time.perf_counter()

    def shutdown(self) -> None:
        # The handshakes were made up (knows): upstream's shutdown would release
        # NIXL state they never created, and fail (up to v0.25) in the shutdown
        # that the worker's __del__ runs again at garbage collection.
        self.worker._remote_agents.clear()
        with contextlib.suppress(Exception):
            self.connector.shutdown()
        self.writer.join(timeout=5)

    def add_prefill(self, request_id: str) -> Request:
        """A prefill leg: do_remote_decode, one token."""
        request = create_request(
            block_size=self.block_size,
            num_tokens=NUM_TOKENS,
            do_remote_decode=True,
        )
        request.request_id = request_id
        self.scheduler.add_request(request)
        return request

    def add_decode(
        self, request_id: str, producer: "Engine", same_prompt: bool = False
    ) -> Request:
        """A decode leg as a push proxy sends it: no remote block ids. With
        ``same_prompt``, the prompt every such request has (the children of one
        parallel-sampling request)."""
        request = create_request(
            block_size=self.block_size,
            num_tokens=NUM_TOKENS,
            common_prefix_len=NUM_TOKENS if same_prompt else 0,
            do_remote_prefill=True,
        )
        request.request_id = request_id
        params = request.kv_transfer_params
        assert params is not None
        params.pop("remote_block_ids")
        params["remote_engine_id"] = producer.engine_id
        params["remote_request_id"] = "cmpl-pair-0"
        params["remote_host"] = "127.0.0.1"
        self.scheduler.add_request(request)
        return request

    def abort(self, request: Request) -> None:
        self.scheduler.finish_requests(
            request.request_id, RequestStatus.FINISHED_ABORTED
        )

    def step(self) -> None:
        scheduler_output = self.scheduler.schedule()
        metadata = scheduler_output.kv_connector_metadata
        assert metadata is not None
        self.connector.bind_connector_metadata(metadata)
        self.worker.start_load_kv(metadata)
        kv_output = KVConnectorOutput()
        if hasattr(self.connector, "get_transfer_results"):
            results = self.connector.get_transfer_results(set())
            kv_output.finished_sending = results.finished_sending
            kv_output.finished_recving = results.finished_recving
            kv_output.failed_recving = results.failed_recving
        else:
            kv_output.finished_sending, kv_output.finished_recving = (
                self.connector.get_finished(set())
            )
        self.connector.clear_connector_metadata()
        scheduled = scheduler_output.num_scheduled_tokens
        model_output = create_model_runner_output(
            [self.scheduler.requests[r] for r in scheduled]
        )
        model_output.kv_connector_output = kv_output
        self.scheduler.update_from_output(scheduler_output, model_output)

    def holds(self, request: Request) -> bool:
        """The producer still holds the request's blocks for a decoder."""
        return request.request_id in self.scheduler.requests

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.fixture
def make_engine(dist_world, monkeypatch) -> Iterator[Callable[..., Engine]]:
    """Yield ``make(**extra_config) -> Engine``; engines shut down after the test."""
    monkeypatch.setattr(base_worker, "NixlWrapper", FakeNixlAgent)
    monkeypatch.setattr(FakeNixlAgent, "fabric", Fabric())
    engines: list[Engine] = []

    def make(**extra_config: Any) -> Engine:
        engines.append(Engine(extra_config))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def step_until(condition: Callable[[], bool], *engines: Engine) -> bool:
    """Step the engines until ``condition`` holds, at most MAX_STEPS times."""
    for _ in range(MAX_STEPS):
        if condition():
            return True
        for engine in engines:
            engine.step()
        time.sleep(0.02)
    return condition()


def prefilled(producer: Engine, request_ids: list[str]) -> list[Request]:
    """The producer computed the prompts and holds their blocks for decoders."""
    requests = [producer.add_prefill(r) for r in request_ids]
    for _ in range(3):
        producer.step()
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert producer.holds(request)
    return requests


@pytest.mark.parametrize("order", ["after_prefill", "before_prefill"])
def test_child_aborted_before_scheduled_releases_its_prompt(make_engine, order):
    """Parallel sampling, n=2: the producer holds both children of the prompt;
    the decoder's child 1 is aborted before it is scheduled. The producer frees
    child 1's blocks at once (not when its lease runs out) and keeps child 0's
    for the decoder child that may still register. The release may also reach
    the producer before its prefill ends (a request the decoder rejects at
    once); it is applied when the prefill ends."""
    producer = make_engine()
    decoder = make_engine()
    decoder.knows(producer)
    free_before = producer.free_blocks()
    child_ids = ["0_cmpl-pair-0-aaaaaaaa", "1_cmpl-pair-0-aaaaaaaa"]

    if order == "after_prefill":
        held = prefilled(producer, child_ids)
    aborted = decoder.add_decode("1_cmpl-pair-0-bbbbbbbb", producer)
    decoder.abort(aborted)
    decoder.step()
    if order == "before_prefill":
        # The producer reads the release while it has nothing to release yet.
        fabric = FakeNixlAgent.fabric
        assert step_until(
            lambda: (
                fabric.delivered.get(producer.agent_name, 0) > 0
                and not fabric.inboxes[producer.agent_name]
            ),
            producer,
        ), "the decoder sent the producer nothing for the aborted request"
        held = prefilled(producer, child_ids)
    child0, child1 = held

    assert step_until(lambda: not producer.holds(child1), producer, decoder), (
        "the producer still holds the aborted child's prompt (until its lease)"
    )
    assert producer.holds(child0), "the other child's prompt was released too"
    assert producer.free_blocks() < free_before
    assert FakeNixlAgent.fabric.writes == 0


def test_aborted_request_leaves_no_receive_behind(make_engine):
    """The empty receive staged for a request aborted before it was scheduled is
    not kept by the decoder's worker (nothing will ever be pushed for it), and
    it is not reported as a finished receive (the scheduler no longer has the
    request)."""
    producer = make_engine()
    decoder = make_engine()
    decoder.knows(producer)
    aborted = decoder.add_decode("0_cmpl-gone-0-bbbbbbbb", producer)
    decoder.abort(aborted)
    for _ in range(3):
        decoder.step()
    recving = decoder.worker._recving_metadata
    assert aborted.request_id not in recving, "the empty receive is kept for good"
    assert aborted.request_id not in decoder.scheduler.requests


@pytest.mark.parametrize("off", ["producer", "decoder"])
def test_release_off_on_either_side_keeps_the_lease(make_engine, off):
    """With the release off on one side (as against an engine without it), the
    producer neither crashes nor WRITEs: it holds the prompt until its lease, as
    before. A producer that does not know the release reads it as a heartbeat
    entry for a request it does not hold."""
    switch = {"release_unregistered_push_requests": False}
    producer = make_engine(**(switch if off == "producer" else {}))
    decoder = make_engine(**(switch if off == "decoder" else {}))
    decoder.knows(producer)
    (held,) = prefilled(producer, ["0_cmpl-off-0-aaaaaaaa"])
    aborted = decoder.add_decode("0_cmpl-off-0-bbbbbbbb", producer)
    decoder.abort(aborted)
    for _ in range(10):
        decoder.step()
        producer.step()
        time.sleep(0.02)
    assert producer.holds(held)
    assert FakeNixlAgent.fabric.writes == 0


class Clock:
    """``time.perf_counter`` as the engines see it, moved forward at will."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = time.perf_counter
        self.offset = 0.0
        monkeypatch.setattr(time, "perf_counter", lambda: real() + self.offset)

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.mark.parametrize("case", ["unpaired", "stale"])
def test_a_release_that_pairs_with_nothing_frees_nothing(
    make_engine, monkeypatch, case
):
    """A release frees only what the aborted request's registration would have
    been served from. ``unpaired``: the prompt of a prefill leg with n=1 pairs
    with no child of a decode leg with n>1 (their registrations never match
    either), so it stays held. ``stale``: a release that found no finished
    request is kept no longer than the producer's lease; a prompt with the same
    id that finishes after that is not released by it."""
    clock = Clock(monkeypatch)
    producer = make_engine()
    decoder = make_engine()
    decoder.knows(producer)
    prefix = "cmpl-alone-0" if case == "unpaired" else "0_cmpl-again-0"
    if case == "unpaired":
        (held,) = prefilled(producer, [f"{prefix}-aaaaaaaa"])
        aborted_id = f"0_{prefix}-bbbbbbbb"
    else:
        aborted_id = f"{prefix}-bbbbbbbb"
    aborted = decoder.add_decode(aborted_id, producer)
    decoder.abort(aborted)
    decoder.step()
    fabric = FakeNixlAgent.fabric
    step_until(
        lambda: (
            fabric.delivered.get(producer.agent_name, 0) > 0
            and not fabric.inboxes[producer.agent_name]
        ),
        producer,
    )
    if case == "stale":
        clock.advance(LEASE + 1)
        (held,) = prefilled(producer, [f"{prefix}-cccccccc"])
    for _ in range(10):
        producer.step()
        time.sleep(0.02)
    assert producer.holds(held)
    assert fabric.writes == 0
