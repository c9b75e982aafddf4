# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NIXL producer (prefill) release path, driven through its real methods.

Holds the harness shared by the tests of vllm PR 43509 (best_of sibling
fan-out, early notifications) and the behaviour those fixes must keep: a
request is released once all its consumers notified, at its expiry or lease
end otherwise, and never when it was aborted.

The same file runs against every NIXL layout: ``nixl_connector.py``
(<= v0.19), ``nixl/worker.py`` (v0.20 - v0.23) and ``nixl/pull_worker.py``
(>= v0.24). The worker is built by ``NixlConnector`` in a gloo world of size
1 (upstream's ``dist_init`` needs nccl up to v0.30), with a fake NIXL agent
whose only behaviour is a notification queue, and a fake clock so expiry and
lease reaping are deterministic. The producer is then only driven through
``start_load_kv`` (registration), the agent's notifications and
``get_finished``/``get_transfer_results`` (release), so the tests hold for the
stock and the patched worker alike.
"""

import contextlib
import importlib
import logging
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from vllm.config import set_current_vllm_config
from vllm.distributed import (
    cleanup_dist_env_and_memory,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from .utils import create_vllm_config, make_kv_cache_config

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

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

# Lifetime of a registered request: nothing expires unless a test advances
# the clock by more.
TTL = 1000.0


def connector_module() -> ModuleType:
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


def _topology_class() -> type:
    from vllm.distributed.kv_transfer.kv_connector import utils

    for name in ("TransferTopology", "TpKVTopology"):
        if hasattr(utils, name):
            return getattr(utils, name)
    raise ImportError("no TP topology class in kv_connector.utils")


class FakeNixlAgent:
    """A NIXL agent that queues notifications; every other call is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.pending: defaultdict[str, list[bytes]] = defaultdict(list)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs, self.pending = dict(self.pending), defaultdict(list)
        return notifs

    def get_agent_metadata(self) -> bytes:
        return b"fake_agent_metadata"

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class FakeClock:
    """``time`` as the worker modules see it, with a settable perf_counter."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class _Topology:
    """The producer's TP topology; only ``tp_ratio`` is on the release path."""

    def __init__(self, topology_cls: type[Any], tp_size: int) -> None:
        self.tp_size = tp_size
        self._topology_cls = topology_cls

    def tp_ratio(self, remote_tp_size: int) -> int:
        return self._topology_cls.tp_ratio(self, remote_tp_size)


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
        if hasattr(self.worker, "get_transfer_results"):
            return set(self.worker.get_transfer_results().finished_sending or ())
        done_sending, _ = self.worker.get_finished()
        return set(done_sending)

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


@contextlib.contextmanager
def gloo_world():
    """A torch.distributed world of size 1 on CPU."""
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


def producer_factory(monkeypatch) -> Iterator[Callable[..., Producer]]:
    """Yield ``make(**kv_connector_extra_config) -> Producer``; shut down after.

    Needs a ``gloo_world()``; patches the NIXL agent and the clock through
    ``monkeypatch``.
    """
    clock = FakeClock()
    for module in _worker_modules():
        if hasattr(module, "NixlWrapper"):
            monkeypatch.setattr(module, "NixlWrapper", FakeNixlAgent)
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


@pytest.fixture(scope="module")
def nixl_world():
    with gloo_world():
        yield


@pytest.fixture
def make_producer(nixl_world, monkeypatch):
    yield from producer_factory(monkeypatch)


# ---------------------------------------------------------------------------
# Behaviour the fixes keep.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_released_once_every_consumer_notified(make_producer, consumers):
    """Heterogeneous TP: P waits for all of its decode readers (1, 2 or 4)."""
    producer = make_producer()
    producer.register("req-a", "req-b")
    producer.notify("req-a", consumers, times=consumers - 1)
    assert producer.finished_sending() == set()
    producer.notify("req-a", consumers)
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == {"req-b"}


def test_notification_before_finish_releases_a_scheduled_request(make_producer):
    """Async scheduling: the pull can complete before ``reqs_to_send`` arrives."""
    producer = make_producer()
    producer.step(in_batch=["req-a"])
    producer.notify("req-a")
    assert producer.finished_sending() == {"req-a"}
    producer.step(to_send=["req-a"])
    assert producer.finished_sending() == set()
    assert producer.held() == set()


def test_unpulled_request_is_released_when_it_expires(make_producer):
    producer = make_producer()
    producer.register("req-a")
    producer.advance(TTL / 2)
    assert producer.finished_sending() == set()
    producer.advance(TTL)
    assert producer.finished_sending() == {"req-a"}
    assert producer.held() == set()


def test_aborted_request_is_never_reported(make_producer):
    producer = make_producer()
    producer.step(in_batch=["req-a", "req-b"])
    producer.step(not_processed=["req-a"], to_send=["req-b"])
    producer.advance(2 * TTL)
    assert producer.finished_sending() == {"req-b"}
    assert producer.held() == set()


def test_late_notification_is_dropped(make_producer):
    """A notification for an expired request releases nothing (again); it is
    logged as possibly invalid KV and, from v0.32, counted after expiry."""
    producer = make_producer()
    producer.register("req-a")
    producer.advance(2 * TTL)
    assert producer.finished_sending() == {"req-a"}
    with vllm_log() as records:
        producer.notify("req-a")
        producer.register("req-b")
        producer.notify("req-b")
        assert producer.finished_sending() == {"req-b"}
    assert producer.held() == set()
    assert messages(records, "Potentially invalid KV blocks")
    assert producer.notifications_after_expiry() in (None, 1)


def test_heartbeat_extends_the_lease(make_producer):
    producer = make_producer()
    if not producer.has_heartbeats:
        pytest.skip("lease heartbeats exist from v0.22")
    ttl = producer.lease_extension + 10
    # Up to v0.30 reaping stops at the first live lease in registration order.
    producer.register("req-b", ttl=ttl)
    producer.register("req-a", ttl=ttl)
    producer.advance(ttl - 5)
    producer.heartbeat("req-a")
    producer.advance(10)
    assert producer.finished_sending() == {"req-b"}
    assert producer.held() == {"req-a"}
    producer.advance(producer.lease_extension)
    assert producer.finished_sending() == {"req-a"}
