# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Set-up shared by the NIXL connector tests of the producer's release, the KV
leases and push mode: a gloo world, fake NIXL agents and clocks, and harnesses
that drive the connector through its real methods.

- ``make_producer``: a pull producer worker (``Producer``), registered and
  released through ``start_load_kv`` and ``get_finished`` /
  ``get_transfer_results``, with a fake agent and clock;
- ``PullDecoder`` and ``Pulls``: a decode scheduler's steps with the children
  of one remote prompt (``queued_children``), and the READs its workers would start;
- ``make_engine``: push engines (scheduler and push worker with its writer
  thread) whose agents deliver notifications on an in-process fabric.

It runs against every NIXL layout: ``nixl_connector.py`` (<= v0.19),
``nixl/worker.py`` (v0.20 - v0.23) and ``nixl/pull_worker.py`` with
``nixl/base_worker.py`` (>= v0.24, where push mode starts: the push harness
imports it when used). Pytest finds a fixture by the name a test module binds
it to: ``dist_world = nixl_harness.dist_world``.
"""

import contextlib
import copy
import importlib
import logging
import os
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm.config import set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_kv_cache_config,
)

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
# Newest layout first.
_CONNECTOR_MODULES = (f"{_V1}.nixl", f"{_V1}.nixl_connector")
# Modules that construct the NIXL agent or read the clock on the release path.
_WORKER_MODULES = (
    f"{_V1}.nixl.pull_worker",
    f"{_V1}.nixl.base_worker",
    f"{_V1}.nixl.worker",
    f"{_V1}.nixl_connector",
)


# ---------------------------------------------------------------------------
# The world, agents and clocks.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def gloo_world() -> Iterator[None]:
    """A torch.distributed world of size 1 on CPU (upstream's ``dist_init``
    needs nccl up to v0.30)."""
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


@pytest.fixture(scope="module")
def dist_world() -> Iterator[None]:
    """The gloo world, once for the module: its tests are marked
    ``skip_global_cleanup``, which would end it after each test."""
    with gloo_world():
        yield


def connector_module() -> ModuleType:
    """The module with ``NixlConnector`` and ``NixlConnectorMetadata``."""
    for name in _CONNECTOR_MODULES:
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise ImportError(f"none of {_CONNECTOR_MODULES} is importable")


def _worker_modules() -> list[ModuleType]:
    modules = []
    for name in _WORKER_MODULES:
        with contextlib.suppress(ImportError):
            modules.append(importlib.import_module(name))
    return modules


class StubNixlAgent:
    """A NIXL agent with no peer: no notification arrives, every other call is a
    no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def get_agent_metadata(self) -> bytes:
        return b"fake_agent_metadata"

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class QueueNixlAgent(StubNixlAgent):
    """A NIXL agent whose notifications the test queues in ``pending``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.pending: defaultdict[str, list[bytes]] = defaultdict(list)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs, self.pending = dict(self.pending), defaultdict(list)
        return notifs


class FakeClock:
    """``time`` as the worker modules see it, with a settable perf_counter."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class Clock:
    """``time.perf_counter`` as every engine sees it, moved forward at will; with
    ``wall``, ``time.time`` too (what requests' arrival stamps are read against)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, wall: bool = False) -> None:
        self.offset = 0.0
        for name in ("perf_counter", "time") if wall else ("perf_counter",):
            real = getattr(time, name)
            monkeypatch.setattr(time, name, self._moved(real))

    def _moved(self, real: Callable[[], float]) -> Callable[[], float]:
        return lambda: real() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def vllm_log() -> Iterator[list[logging.LogRecord]]:
    """The records vLLM's loggers emit inside the block (vLLM's own handlers do
    not propagate them to pytest's)."""
    handler = _Records()
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def messages(records: list[logging.LogRecord], text: str) -> list[str]:
    return [r.getMessage() for r in records if text in r.getMessage()]


# ---------------------------------------------------------------------------
# A pull producer worker.
# ---------------------------------------------------------------------------


def transfer_results(worker: Any) -> tuple[set[str], set[str]]:
    """What a worker reports done sending and done receiving in one poll
    (``get_transfer_results`` from v0.30, ``get_finished`` before)."""
    if hasattr(worker, "get_transfer_results"):
        results = worker.get_transfer_results()
        return set(results.finished_sending or ()), set(results.finished_recving or ())
    done_sending, done_recving = worker.get_finished()
    return set(done_sending), set(done_recving)


# Lifetime of a registered request: nothing expires unless a test advances
# the clock by more.
TTL = 1000.0


def _topology_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector import utils

    for name in ("TransferTopology", "TpKVTopology"):
        if hasattr(utils, name):
            return getattr(utils, name)
    raise ImportError("no TP topology class in kv_connector.utils")


class _Topology:
    """The worker's TP topology: ``tp_ratio`` on the release path; a remote's info and
    block size ratio where a decoder post-processes a finished READ (up to v0.21 also
    a failed one), its remote blocks the size of the local ones."""

    def __init__(self, topology_cls: type[Any], tp_size: int) -> None:
        self.tp_size = tp_size
        self._topology_cls = topology_cls

    def tp_ratio(self, remote_tp_size: int) -> int:
        return self._topology_cls.tp_ratio(self, remote_tp_size)

    def get_engine_info(self, remote_engine_id: str) -> SimpleNamespace:
        return SimpleNamespace(remote_block_size=None)

    def block_size_ratio(self, remote_block_size: int | None) -> int:
        return 1

    def block_size_ratio_from_engine_id(self, remote_engine_id: str) -> int:
        return 1


class Producer:
    """A producer worker, with the scheduler's and the decoders' view of it."""

    def __init__(self, connector: Any, clock: FakeClock) -> None:
        self.connector = connector
        self.worker = connector.connector_worker
        self.clock = clock
        self._metadata_cls = connector_module().NixlConnectorMetadata

    # -- decoders ------------------------------------------------------------
    def notify(
        self, req_id: str, consumers: int = 1, times: int = 1, agent: str = "decode"
    ) -> None:
        """Queue ``times`` pull-complete notifications for ``req_id`` from the
        decode worker whose NIXL agent is ``agent``.

        The worker reads them at its next ``finished_sending()``, agent by agent.

        ``consumers`` is what the decoder puts in the message: its TP size up
        to v0.28, the expected number of notifications from v0.29. With a
        producer TP of 1 both are the number of decode workers reading it.
        """
        message = f"{req_id}:{consumers}".encode()
        self.worker.nixl_wrapper.pending[agent].extend([message] * times)

    def heartbeat(self, *req_ids: str, agent: str = "decode") -> None:
        message = ("HB:" + ",".join(req_ids)).encode()
        self.worker.nixl_wrapper.pending[agent].append(message)

    # -- scheduler -----------------------------------------------------------
    def step(
        self,
        in_batch: tuple[str, ...] | list[str] = (),
        to_send: tuple[str, ...] | list[str] = (),
        not_processed: tuple[str, ...] | list[str] = (),
        ttl: float = TTL,
    ) -> None:
        """One ``start_load_kv`` carrying the scheduler's producer bookkeeping."""
        metadata = self._metadata_cls()
        metadata.reqs_in_batch = set(in_batch)
        metadata.reqs_not_processed = set(not_processed)
        metadata.reqs_to_send = {req_id: self.clock.now + ttl for req_id in to_send}
        if hasattr(metadata, "scheduler_clock"):
            metadata.scheduler_clock = self.clock.now
        self.worker.start_load_kv(metadata)

    def register(self, *req_ids: str, ttl: float = TTL) -> None:
        """Requests scheduled and finished in one step: held for a decoder."""
        self.step(in_batch=req_ids, to_send=req_ids, ttl=ttl)

    def finished_sending(self) -> set[str]:
        """What the worker reports done sending: the KV it releases now."""
        return transfer_results(self.worker)[0]

    # -- state ---------------------------------------------------------------
    @property
    def has_heartbeats(self) -> bool:
        """Lease renewal by "HB:" notifications exists from v0.22."""
        return hasattr(self.worker, "_handle_heartbeat")

    @property
    def lease_extension(self) -> float:
        return self.worker._lease_extension

    def held(self) -> set[str]:
        """Requests whose KV the producer still holds for a decoder."""
        return set(self.worker._reqs_to_send) | set(self.worker._reqs_to_process)

    def notifications_after_expiry(self) -> int | None:
        """What the NIXL stats count as notifications after expiry (from v0.32;
        None before)."""
        stats = getattr(self.worker, "xfer_stats", None)
        counted = getattr(stats, "data", {}).get("num_notifications_after_expiry")
        return None if counted is None else len(counted)

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds


def producer_factory(monkeypatch) -> Iterator[Callable[..., Producer]]:
    """Yield ``make(**kv_connector_extra_config) -> Producer``; shut down after.

    Needs a ``gloo_world()``; patches the NIXL agent and the clock through
    ``monkeypatch``.
    """
    clock = FakeClock()
    for module in _worker_modules():
        if hasattr(module, "NixlWrapper"):
            monkeypatch.setattr(module, "NixlWrapper", QueueNixlAgent)
        if getattr(module, "time", None) is time:
            monkeypatch.setattr(module, "time", clock)
    connectors: list[Any] = []
    # One config per extra config: building one costs more than the worker, and
    # model-based tests build a producer per example.
    configs: dict[str, Any] = {}

    def make(**extra_config: Any) -> Producer:
        key = repr(sorted(extra_config.items()))
        if key not in configs:
            configs[key] = create_vllm_config(kv_connector_extra_config=extra_config)
        vllm_config = configs[key]
        with set_current_vllm_config(vllm_config):
            connector = connector_module().NixlConnector(
                vllm_config,
                KVConnectorRole.WORKER,
                make_kv_cache_config(block_size=vllm_config.cache_config.block_size),
            )
        worker = connector.connector_worker
        # Set by register_kv_caches in a real engine.
        topology = _Topology(_topology_class(), worker.world_size)
        if hasattr(worker, "kv_topo"):
            worker.kv_topo = topology
        else:
            worker.transfer_topo = topology
        connectors.append(connector)
        return Producer(connector, clock)

    yield make
    for connector in connectors:
        with contextlib.suppress(Exception):
            connector.shutdown()


@pytest.fixture
def make_producer(dist_world, monkeypatch) -> Iterator[Callable[..., Producer]]:
    # On CPU every worker pins the process to a core per NUMA node for its KV
    # transfers (0.3 s a call on a loaded machine): not for tests that build a
    # producer per example.
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: None)
    yield from producer_factory(monkeypatch)


# ---------------------------------------------------------------------------
# A pull decoder's scheduler.
# ---------------------------------------------------------------------------

REMOTE_REQUEST_ID = "0_cmpl-parent-fb4bc0e0"
# Two full blocks and a half one: each child needs 3 blocks for its prompt.
PROMPT_BLOCKS = 3


def remote_children(
    n: int,
    block_size: int,
    num_tokens: int,
    first_id: int = 1,
    remote_request_id: str = REMOTE_REQUEST_ID,
    **create: Any,
) -> list[Request]:
    """``n`` decode requests as a decode engine makes them from one ``n > 1``
    request: the same prompt, each with its own copy of one prefill's params."""
    children = []
    for i in range(n):
        child = create_request(
            request_id=first_id + i,
            block_size=block_size,
            num_tokens=num_tokens,
            common_prefix_len=num_tokens,
            do_remote_prefill=True,
            **create,
        )
        params = copy.deepcopy(child.kv_transfer_params)
        params["remote_request_id"] = remote_request_id
        child.kv_transfer_params = params
        children.append(child)
    return children


def renewed(metadata) -> bool:
    """Whether a step's connector metadata renews the prompt's lease (never before
    v0.22: no heartbeats)."""
    info = getattr(metadata, "heartbeat_by_engine", {}).get("my-engine-id")
    return info is not None and REMOTE_REQUEST_ID in info.req_ids


class PullDecoder:
    """What the decode workers do with each step's connector metadata: READs
    complete in the step after they start; an entry without blocks (a full local
    prefix hit) only notifies the producer. ``needing``: the children that have
    neither read the prompt nor notified the producer yet; ``notified``: those that
    notified it."""

    def __init__(self, scheduler, children) -> None:
        self.scheduler = scheduler
        self.children = children
        self.needing = {child.request_id for child in children}
        self.loading: set[str] = set()
        self.read: set[str] = set()
        self.notified: set[str] = set()

    def step(self) -> bool:
        """One scheduler step; returns whether its connector metadata renews the
        prompt's lease, as the workers get it (before the step's output)."""
        output = self.scheduler.schedule()
        metadata = nixl_metadata(output)
        renewing = renewed(metadata)
        started = set()
        for req_id, meta in metadata.reqs_to_recv.items():
            if any(meta.local_block_ids):
                started.add(req_id)
            else:
                self.needing.discard(req_id)
                self.notified.add(req_id)
        scheduled = [
            c for c in self.children if c.request_id in output.num_scheduled_tokens
        ]
        runner_output = create_model_runner_output(
            reqs=scheduled, finished_recving=self.loading or None
        )
        self.scheduler.update_from_output(output, runner_output)
        self.needing -= self.loading
        self.read |= self.loading
        self.loading = started
        return renewing


def make_children(n: int, block_size: int, first_id: int = 1, **overrides) -> list:
    """``remote_children`` of a PROMPT_BLOCKS prompt; ``overrides`` replaces some of
    each child's kv_transfer_params."""
    num_tokens = int(block_size * (PROMPT_BLOCKS - 0.5))
    children = remote_children(n, block_size, num_tokens, first_id)
    for child in children:
        child.kv_transfer_params = {**child.kv_transfer_params, **overrides}
    return children


def queued_children(vllm_config, n: int, **overrides) -> tuple:
    """A scheduler on ``vllm_config`` with ``n`` children of one remote prompt
    waiting in it."""
    scheduler = create_scheduler(vllm_config)
    children = make_children(n, vllm_config.cache_config.block_size, **overrides)
    for child in children:
        scheduler.add_request(child)
    return scheduler, children


def block_count(block_ids) -> int:
    """How many blocks a connector metadata entry names (flat list or per group)."""
    return sum(len(g) if isinstance(g, (list, tuple)) else 1 for g in block_ids)


def nixl_metadata(scheduler_output):
    """The NIXL connector's metadata of a step (itself or MultiConnector's child)."""
    meta = scheduler_output.kv_connector_metadata
    return meta.metadata[0] if hasattr(meta, "metadata") else meta


class Pulls:
    """What the decode workers would do, read off each step's connector metadata:
    READs (request id -> blocks read) and notification-only entries."""

    def __init__(self) -> None:
        self.reads: dict[str, int] = {}
        self.notified: list[str] = []

    def load(self, metadata) -> None:
        """What a decode worker is given each step (nothing here)."""

    def step(
        self,
        scheduler,
        children,
        failed: frozenset[str] | set[str] = frozenset(),
        loaded: frozenset[str] | set[str] | None = None,
    ) -> set[str]:
        """One scheduler step; the READs started in the step before (``loaded``)
        complete in it, those in ``failed`` with every block invalid. Returns the
        READs started in this step."""
        output = scheduler.schedule()
        self.load(nixl_metadata(output))
        started = set()
        for req_id, meta in nixl_metadata(output).reqs_to_recv.items():
            blocks = block_count(meta.local_block_ids)
            if blocks:
                self.reads[req_id] = blocks
                started.add(req_id)
            else:
                self.notified.append(req_id)
        scheduled = [c for c in children if c.request_id in output.num_scheduled_tokens]
        invalid = set()
        for req_id in failed & (loaded or set()):
            invalid |= set(scheduler.kv_cache_manager.get_block_ids(req_id)[0])
        runner_output = create_model_runner_output(
            reqs=scheduled,
            finished_recving=loaded or None,
            invalid_block_ids=invalid or None,
        )
        scheduler.update_from_output(output, runner_output)
        return started

    def run(
        self,
        scheduler,
        children,
        steps: int = 8,
        failed: frozenset[str] | set[str] = frozenset(),
        loading: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """``steps`` steps; the READs in ``loading`` (started before) complete first."""
        for _ in range(steps):
            loading = self.step(scheduler, children, failed, loading)


# ---------------------------------------------------------------------------
# Push engines (v0.24+).
# ---------------------------------------------------------------------------

NUM_BLOCKS = 64
NUM_TOKENS = 40
# The push pair's kv_lease_duration: long enough that no lease runs out during a
# test, so a release is never the lease.
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


class FabricNixlAgent(StubNixlAgent):
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


class FakeTopology:
    """Set by the first handshake in a real engine; none happens here. The peer
    is this engine's twin: same TP size and block size."""

    def __init__(self, block_size: int, physical_per_logical: int = 1) -> None:
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


def push_connector(
    monkeypatch: pytest.MonkeyPatch, vllm_config: Any, agent: type = StubNixlAgent
) -> Any:
    """A push worker's connector on ``vllm_config`` whose NIXL agent is ``agent``,
    its topology the peer's twin."""
    base_worker = importlib.import_module(f"{_V1}.nixl.base_worker")
    push_module = importlib.import_module(f"{_V1}.nixl.connector")
    monkeypatch.setattr(base_worker, "NixlWrapper", agent)
    block_size = vllm_config.cache_config.block_size
    with set_current_vllm_config(vllm_config):
        connector = push_module.NixlPushConnector(
            vllm_config,
            KVConnectorRole.WORKER,
            make_kv_cache_config(block_size=block_size),
        )
    worker = connector.connector_worker
    assert worker is not None
    worker.transfer_topo = FakeTopology(
        block_size, getattr(worker, "_physical_blocks_per_logical_kv_block", 1)
    )
    return connector


@contextlib.contextmanager
def push_producer_handshaken(
    monkeypatch: pytest.MonkeyPatch, agent: type, decoder_tp_size: int = 1
) -> Iterator[Any]:
    """A push producer's worker (TP 1) on ``agent``, a subclass of upstream's fake
    NIXL agent, after upstream's fake handshake with a decoder of
    ``decoder_tp_size`` ranks (same block size and layout): one region, so a
    block's descriptor is its id."""
    base_worker = importlib.import_module(f"{_V1}.nixl.base_worker")
    push_module = importlib.import_module(f"{_V1}.nixl.connector")
    fakes = importlib.import_module(f"{__package__}.test_nixl_connector")
    decoder = fakes.FakeNixlConnectorWorker.REMOTE_ENGINE_ID
    monkeypatch.setattr(base_worker, "NixlWrapper", agent)
    vllm_config = create_vllm_config(kv_connector="NixlPushConnector")
    kv_cache_config = make_kv_cache_config(
        block_size=vllm_config.cache_config.block_size
    )
    with set_current_vllm_config(vllm_config):
        connector = push_module.NixlPushConnector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        worker: Any = connector.connector_worker
        # What upstream's fake worker sets in place of register_kv_caches.
        fake = fakes.FakeNixlConnectorWorker(
            vllm_config,
            worker.engine_id,
            hand_shake_latency=0,
            kv_cache_config=kv_cache_config,
        )
    for name in ("transfer_topo", "src_xfer_handles_by_block_size", "kv_cache_layout"):
        setattr(worker, name, getattr(fake, name))
    if hasattr(fake, "src_blocks_data"):
        worker.src_blocks_data = fake.src_blocks_data
    worker.num_regions = 1
    if decoder_tp_size > 1:
        # As upstream's test of a decoder of a higher TP size sets them: the
        # handshake splits this one region per decoder rank (4096-byte slots).
        # Up to v0.32 a row is a block (address, length, device); from v0.33 a
        # strided one is the region (and stride, block count).
        block_len = 4096 * worker.block_size
        row = (0, block_len, worker.tp_rank, block_len, kv_cache_config.num_blocks)
        columns = getattr(fake, "src_blocks_data", np.empty((0, 3))).shape[1]
        worker.src_blocks_data = np.array([row[:columns]], dtype=np.uint64)
        worker.num_descs = 1 if columns == 3 else kv_cache_config.num_blocks
    worker.REMOTE_ENGINE_ID = decoder
    worker._hand_shake_latency = 0
    agents = fakes.FakeNixlConnectorWorker._nixl_handshake(
        worker, "", 0, decoder_tp_size, decoder
    )
    worker._remote_agents[decoder] = agents if isinstance(agents, dict) else agents[0]
    worker._engine_last_active[decoder] = time.perf_counter()
    try:
        yield worker
    finally:
        with contextlib.suppress(Exception):
            fake.shutdown()
            connector.shutdown()


def push_registration(
    worker: Any, decoder_blocks: list[int], decoder_tp_size: int = 1
) -> dict[str, Any]:
    """The registration (PUSH_REG payload) of one decode request of the decoder
    ``push_producer_handshaken`` shook hands with, for ``decoder_blocks``."""
    return {
        "request_id": "cmpl-decode-0",
        "decode_engine_id": worker.REMOTE_ENGINE_ID,
        "decode_host": "localhost",
        "decode_port": 0,
        "decode_tp_size": decoder_tp_size,
        "local_block_ids": (decoder_blocks,),
        "remote_engine_id": worker.engine_id,
        "remote_host": "localhost",
        "remote_port": 0,
        "remote_tp_size": 1,
    }


def connector_output(connector: Any) -> KVConnectorOutput:
    """What the worker-side connector reports of its transfers in a step."""
    kv_output = KVConnectorOutput()
    if hasattr(connector, "get_transfer_results"):
        results = connector.get_transfer_results(set())
        kv_output.finished_sending = results.finished_sending
        kv_output.finished_recving = results.finished_recving
        kv_output.failed_recving = results.failed_recving
    else:
        kv_output.finished_sending, kv_output.finished_recving = connector.get_finished(
            set()
        )
    return kv_output


def engine_step(scheduler: Any, connector: Any, load_errors: bool = False) -> tuple:
    """One engine step: schedule, the worker's start_load_kv and transfers (with
    ``load_errors``, its failed loads' blocks too), the scheduler's update.
    Returns (scheduler output, engine outputs)."""
    scheduler_output = scheduler.schedule()
    metadata = scheduler_output.kv_connector_metadata
    assert metadata is not None
    connector.bind_connector_metadata(metadata)
    connector.connector_worker.start_load_kv(metadata)
    kv_output = connector_output(connector)
    if load_errors:
        kv_output.invalid_block_ids = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    model_output = create_model_runner_output(
        [scheduler.requests[r] for r in scheduler_output.num_scheduled_tokens]
    )
    model_output.kv_connector_output = kv_output
    return scheduler_output, scheduler.update_from_output(
        scheduler_output, model_output
    )


def push_decode_leg(
    block_size: int,
    num_tokens: int,
    name: str | None = None,
    remote: dict[str, Any] | None = None,
    **create: Any,
) -> Request:
    """A decode leg as a push proxy sends it: no remote block ids (the producer
    learns the decoder's blocks from its registration); ``name`` its request id,
    ``remote`` updates its other kv_transfer_params."""
    request = create_request(
        block_size=block_size, num_tokens=num_tokens, do_remote_prefill=True, **create
    )
    if name is not None:
        request.request_id = name
    params = request.kv_transfer_params
    assert params is not None
    params.pop("remote_block_ids")
    params.update(remote or {}, remote_host="127.0.0.1")
    return request


class Engine:
    """A push engine: its scheduler, one push worker with its writer thread, and
    the steps between them."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, extra_config: dict[str, Any]
    ) -> None:
        vllm_config = create_vllm_config(
            kv_connector="NixlPushConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"kv_lease_duration": LEASE, **extra_config},
        )
        self.block_size = vllm_config.cache_config.block_size
        self.scheduler = create_scheduler(vllm_config, num_blocks=NUM_BLOCKS)
        self.connector = push_connector(monkeypatch, vllm_config, FabricNixlAgent)
        # The push worker, whose writer state and NIXL agent the tests reach.
        worker: Any = self.connector.connector_worker
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
        """A decode leg of ``producer``'s prompt. With ``same_prompt``, the prompt
        every such request has (the children of one parallel-sampling request)."""
        request = push_decode_leg(
            self.block_size,
            NUM_TOKENS,
            request_id,
            common_prefix_len=NUM_TOKENS if same_prompt else 0,
            remote={
                "remote_engine_id": producer.engine_id,
                "remote_request_id": "cmpl-pair-0",
            },
        )
        self.scheduler.add_request(request)
        return request

    def abort(self, request: Request) -> None:
        self.scheduler.finish_requests(
            request.request_id, RequestStatus.FINISHED_ABORTED
        )

    def step(self) -> None:
        engine_step(self.scheduler, self.connector)

    def holds(self, request: Request) -> bool:
        """The producer still holds the request's blocks for a decoder."""
        return request.request_id in self.scheduler.requests

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.fixture
def make_engine(dist_world, monkeypatch) -> Iterator[Callable[..., Engine]]:
    """Yield ``make(**extra_config) -> Engine``; engines shut down after the test."""
    monkeypatch.setattr(FabricNixlAgent, "fabric", Fabric())
    engines: list[Engine] = []

    def make(**extra_config: Any) -> Engine:
        engines.append(Engine(monkeypatch, extra_config))
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
