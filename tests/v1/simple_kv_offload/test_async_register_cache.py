# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for SimpleCPUOffloadConnector's ``async_register_cache`` option.

Reproduces vllm#42632: ``SimpleCPUOffloadWorker.register_kv_caches()`` pins the
whole CPU KV tier with cudaHostRegister before it returns, which blocks engine
startup for minutes at hundreds of GB. With
``kv_connector_extra_config["async_register_cache"] = True`` the worker pins in
a background thread and reports its rank once its copy backend exists; the
scheduler side builds no CPU load or store until every worker has reported.

CPU only: pinning, CUDA streams and the DMA copy backend are mocked.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch

import vllm.v1.simple_kv_offload.worker as worker_module
from tests.v1.simple_kv_offload.test_scheduler import (
    _BYTES_PER_BLOCK,
    BLOCK_SIZE,
    DTYPE,
    SchedulerFixture,
    _alloc_and_register,
    _make_kv_cache_config,
    _make_vllm_config,
    make_request,
    make_scheduler_output,
    simulate_store_completion,
)
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import (
    simple_cpu_offload_connector as connector_module,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_GPU_BLOCKS = 16
NUM_CPU_BLOCKS = 8
# How long the mocked cudaHostRegister blocks unless the test releases it. Code
# that pins on the calling thread (stock behaviour) waits this long.
PIN_SECONDS = 3.0
ASYNC = {"async_register_cache": True}
_probe_ids = itertools.count()


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _vllm_config(
    extra: dict[str, Any] | None = None, world_size: int = 1, rank: int = 0
) -> VllmConfig:
    """A SimpleCPUOffloadConnector config with NUM_CPU_BLOCKS CPU blocks per rank."""
    config = _make_vllm_config()
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config = {
        "cpu_bytes_to_use": _BYTES_PER_BLOCK * NUM_CPU_BLOCKS * world_size,
        **(extra or {}),
    }
    config.parallel_config.tensor_parallel_size = world_size
    config.parallel_config.world_size = world_size
    config.parallel_config.rank = rank
    return config


class _FakeStream:
    """Stands in for torch.cuda.Stream on a CPU-only machine."""

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -1


def _make_worker(
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, Any] | None,
    pin,
    rank: int = 0,
) -> tuple[SimpleCPUOffloadWorker, dict[str, torch.Tensor], MagicMock]:
    """A worker whose pinning is ``pin`` and whose copy backend is a mock."""
    monkeypatch.setattr(worker_module, "pin_tensor", pin)
    # Take the pinning path although the machine has no CUDA (the flag is
    # PIN_MEMORY from v0.24, is_pin_memory_available() before).
    monkeypatch.setattr(worker_module, "PIN_MEMORY", True, raising=False)
    monkeypatch.setattr(
        worker_module, "is_pin_memory_available", lambda: True, raising=False
    )
    backend_cls = MagicMock(name="DmaCopyBackend")
    monkeypatch.setattr(worker_module, "DmaCopyBackend", backend_cls)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)

    worker = SimpleCPUOffloadWorker(
        _vllm_config(extra, rank=rank),
        _make_kv_cache_config(NUM_GPU_BLOCKS),
        _BYTES_PER_BLOCK * NUM_CPU_BLOCKS,
    )
    # One layer, blocks outermost; a CPU tensor stands in for the GPU cache.
    kv_caches = {
        "layer_0": torch.ones(
            NUM_GPU_BLOCKS, _BYTES_PER_BLOCK // DTYPE.itemsize, dtype=DTYPE
        )
    }
    return worker, kv_caches, backend_cls.return_value


def _make_connector(
    extra: dict[str, Any] | None, world_size: int = 1
) -> tuple[SimpleCPUOffloadConnector, SchedulerFixture]:
    """A scheduler-side connector with a bound GPU block pool."""
    vllm_config = _vllm_config(extra, world_size=world_size)
    kv_cache_config = _make_kv_cache_config(NUM_GPU_BLOCKS)
    connector = SimpleCPUOffloadConnector(
        vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    assert connector.scheduler_manager is not None
    gpu_block_pool = BlockPool(
        num_gpu_blocks=NUM_GPU_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE
    )
    connector.bind_gpu_block_pool(gpu_block_pool)
    fix = SchedulerFixture(
        scheduler=connector.scheduler_manager,
        gpu_block_pool=gpu_block_pool,
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
    )
    return connector, fix


def _put_in_cpu_cache(fix: SchedulerFixture, num_blocks: int = 2) -> Request:
    """Offload a request's blocks through the manager itself.

    This bypasses the connector, so the CPU cache holds a hit even while the
    connector's gate is closed: the gate, not an empty cache, must hide it.
    """
    sched = fix.scheduler
    req = make_request(num_blocks=num_blocks)
    kv_blocks = _alloc_and_register(fix, req, num_blocks)
    sched.update_state_after_alloc(req, kv_blocks, num_external_tokens=0)
    meta = sched.build_connector_meta(
        make_scheduler_output(
            {req.request_id: num_blocks * BLOCK_SIZE},
            new_reqs={req.request_id: kv_blocks.get_block_ids()},
        )
    )
    assert meta.store_event >= 0
    simulate_store_completion(sched, meta.store_event)
    return req


def _same_prompt(req: Request, request_id: str) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=req.sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=req._block_hasher,
    )


def _report_ready(connector: SimpleCPUOffloadConnector, *ranks: int) -> None:
    """Deliver one step's aggregated worker output carrying ``ranks``."""
    connector.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
                completed_store_events={}, ready_ranks=frozenset(ranks)
            )
        )
    )


def _assert_empty(meta) -> None:
    assert meta.load_event < 0 and meta.store_event < 0
    assert not meta.load_gpu_blocks and not meta.load_cpu_blocks
    assert not meta.store_gpu_blocks and not meta.store_cpu_blocks
    assert not meta.need_flush


def _assert_gpu_only(connector: SimpleCPUOffloadConnector, hit: Request) -> None:
    """The connector hides ``hit``, which the CPU cache holds."""
    probe = _same_prompt(hit, f"probe-{next(_probe_ids)}")
    assert connector.get_num_new_matched_tokens(probe, 0) == (0, False)


def _assert_cpu_hit(connector: SimpleCPUOffloadConnector, hit: Request) -> None:
    """The connector serves ``hit`` from the CPU cache (asynchronous load)."""
    probe = _same_prompt(hit, f"probe-{next(_probe_ids)}")
    num_tokens, is_async = connector.get_num_new_matched_tokens(probe, 0)
    assert num_tokens and num_tokens > 0 and is_async


# ---------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------


def test_async_register_returns_while_pinning(monkeypatch):
    """With the option, register_kv_caches() returns before the pin ends.

    The mocked pin blocks until the test releases it (or PIN_SECONDS pass): code
    that pins on the calling thread cannot return while it is blocked.
    """
    release = threading.Event()
    pin_threads: list[threading.Thread] = []
    pins_done: list[threading.Thread] = []

    def blocking_pin(tensor: torch.Tensor) -> None:
        pin_threads.append(threading.current_thread())
        release.wait(timeout=PIN_SECONDS)
        pins_done.append(threading.current_thread())

    worker, kv_caches, backend = _make_worker(monkeypatch, ASYNC, blocking_pin)
    start = time.perf_counter()
    try:
        worker.register_kv_caches(kv_caches)
        elapsed = time.perf_counter() - start
        assert not pins_done and elapsed < PIN_SECONDS, (
            f"register_kv_caches() waited {elapsed:.2f} s for the pin"
        )
        registration = worker._cache_registration
        assert registration is not None
        assert not registration.ready.is_set()
        backend.init.assert_not_called()
        # Not ready: nothing to report.
        assert worker.build_connector_worker_meta() is None
        # The CPU tensors exist right away, with the final shape.
        assert worker.cpu_kv_caches is not None
        (cpu_cache,) = worker.cpu_kv_caches.values()
        assert cpu_cache.shape[0] == worker.num_cpu_blocks == NUM_CPU_BLOCKS
    finally:
        release.set()

    assert registration.join(timeout=10)
    assert registration.ready.is_set()
    assert registration._thread is not None and registration._thread.daemon
    assert pin_threads and threading.current_thread() not in pin_threads
    backend.init.assert_called_once()
    # Stock allocates with torch.zeros; the background thread zeroes too.
    assert not cpu_cache.any()


@pytest.mark.parametrize("extra", [None, {"async_register_cache": False}])
def test_sync_register_pins_on_calling_thread(monkeypatch, extra):
    """Without the option, register_kv_caches() pins before it returns (stock)."""
    pin_threads: list[threading.Thread] = []

    def pin(tensor: torch.Tensor) -> None:
        pin_threads.append(threading.current_thread())

    worker, kv_caches, backend = _make_worker(monkeypatch, extra, pin)
    worker.register_kv_caches(kv_caches)
    # Done by the time it returns, on the calling thread.
    assert pin_threads == [threading.current_thread()]
    backend.init.assert_called_once()
    assert worker.build_connector_worker_meta() is None


def test_async_register_reports_rank_once(monkeypatch):
    worker, kv_caches, _ = _make_worker(monkeypatch, ASYNC, lambda t: None, rank=3)
    worker.register_kv_caches(kv_caches)
    registration = worker._cache_registration
    assert registration is not None and registration.join(timeout=10)

    # The report rides along with whatever the step reports anyway.
    worker._completed_store_events = {7: 1}
    meta = worker.build_connector_worker_meta()
    assert meta is not None
    assert meta.ready_ranks == {3}
    assert meta.completed_store_events == {7: 1}
    # Once only.
    assert worker.build_connector_worker_meta() is None
    worker._completed_store_events = {8: 1}
    meta = worker.build_connector_worker_meta()
    assert meta is not None and not meta.ready_ranks


def test_async_register_failure_keeps_offload_off(monkeypatch):
    """A failed pin is logged with its traceback; the worker never reports."""

    def failing_pin(tensor: torch.Tensor) -> None:
        raise RuntimeError("cudaHostRegister failed: out of memory")

    worker, kv_caches, backend = _make_worker(monkeypatch, ASYNC, failing_pin)
    logger = MagicMock()
    monkeypatch.setattr(worker_module, "logger", logger)
    worker.register_kv_caches(kv_caches)
    registration = worker._cache_registration
    assert registration is not None and registration.join(timeout=10)

    logger.exception.assert_called_once()
    assert not registration.ready.is_set()
    backend.init.assert_not_called()
    assert worker.build_connector_worker_meta() is None


def test_worker_meta_aggregate_merges_ready_ranks():
    a = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={1: 1}, ready_ranks=frozenset({0})
    )
    b = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={1: 1, 2: 1}, ready_ranks=frozenset({1, 0})
    )
    c = SimpleCPUOffloadWorkerMetadata(completed_store_events={2: 1})
    merged = a.aggregate(b).aggregate(c)
    assert isinstance(merged, SimpleCPUOffloadWorkerMetadata)
    assert merged.ready_ranks == {0, 1}
    assert merged.completed_store_events == {1: 2, 2: 2}


# ---------------------------------------------------------------------------
# Scheduler side
# ---------------------------------------------------------------------------


def test_gate_closed_until_workers_ready():
    """No CPU hit, load or store before the workers report."""
    connector, fix = _make_connector(ASYNC)
    hit = _put_in_cpu_cache(fix)
    free_before = fix.scheduler.cpu_block_pool.get_num_free_blocks()

    _assert_gpu_only(connector, hit)

    # A new request whose computed blocks would be stored when open.
    req = make_request(num_blocks=2)
    kv_blocks = _alloc_and_register(fix, req, 2)
    connector.update_state_after_alloc(req, kv_blocks, 0)
    meta = connector.build_connector_meta(
        make_scheduler_output(
            {req.request_id: 2 * BLOCK_SIZE},
            new_reqs={req.request_id: kv_blocks.get_block_ids()},
        )
    )
    _assert_empty(meta)
    assert connector.request_finished(req, []) == (False, None)
    assert fix.scheduler.cpu_block_pool.get_num_free_blocks() == free_before


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_gate_opens_after_every_rank_reported(world_size):
    """Opens on exactly the last distinct rank, in any order; duplicates once."""
    connector, fix = _make_connector(ASYNC, world_size=world_size)
    hit = _put_in_cpu_cache(fix)
    ranks = list(range(world_size))
    random.Random(world_size).shuffle(ranks)
    _assert_gpu_only(connector, hit)

    # Every rank but one reports, each of them twice, in separate steps.
    for rank in ranks[:-1] + ranks[:-1]:
        _report_ready(connector, rank)
        assert not fix.scheduler.is_ready()
        _assert_gpu_only(connector, hit)

    _report_ready(connector, ranks[-1])
    assert fix.scheduler.is_ready()
    _assert_cpu_hit(connector, hit)


def test_gate_opens_on_one_aggregated_report():
    """Ranks that become ready in the same step arrive merged."""
    connector, fix = _make_connector(ASYNC, world_size=4)
    hit = _put_in_cpu_cache(fix)
    _assert_gpu_only(connector, hit)
    meta = SimpleCPUOffloadWorkerMetadata(completed_store_events={})
    for rank in (2, 0, 3, 1):
        meta = meta.aggregate(
            SimpleCPUOffloadWorkerMetadata(
                completed_store_events={}, ready_ranks=frozenset({rank})
            )
        )
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
    assert fix.scheduler.is_ready()
    _assert_cpu_hit(connector, hit)


def test_gate_stays_closed_if_a_rank_fails():
    """A rank whose pin failed never reports: serving stays GPU-only."""
    connector, fix = _make_connector(ASYNC, world_size=4)
    hit = _put_in_cpu_cache(fix)
    _assert_gpu_only(connector, hit)
    for _ in range(3):
        for rank in (0, 1, 3):
            _report_ready(connector, rank)
    assert not fix.scheduler.is_ready()
    _assert_gpu_only(connector, hit)

    req = make_request(num_blocks=2)
    kv_blocks = _alloc_and_register(fix, req, 2)
    connector.update_state_after_alloc(req, kv_blocks, 0)
    _assert_empty(
        connector.build_connector_meta(
            make_scheduler_output(
                {req.request_id: 2 * BLOCK_SIZE},
                new_reqs={req.request_id: kv_blocks.get_block_ids()},
            )
        )
    )


def test_request_admitted_while_pinning_stays_gpu_only():
    """A request scheduled before the gate opens is never offloaded or leaked."""
    connector, fix = _make_connector(ASYNC)
    sched = fix.scheduler
    free_before = sched.cpu_block_pool.get_num_free_blocks()

    req = make_request(num_blocks=2)
    kv_blocks = _alloc_and_register(fix, req, 2)
    connector.update_state_after_alloc(req, kv_blocks, 0)
    _assert_empty(
        connector.build_connector_meta(
            make_scheduler_output(
                {req.request_id: 2 * BLOCK_SIZE},
                new_reqs={req.request_id: kv_blocks.get_block_ids()},
            )
        )
    )

    _report_ready(connector, 0)
    assert sched.is_ready()
    # The request keeps running after the gate opened: still no store for it.
    meta = connector.build_connector_meta(
        make_scheduler_output(
            {req.request_id: 1}, cached_req_new_blocks={req.request_id: None}
        )
    )
    assert isinstance(meta, SimpleCPUOffloadMetadata)
    assert meta.store_event < 0 and not meta.store_gpu_blocks
    assert connector.request_finished(req, []) == (False, None)
    assert sched.cpu_block_pool.get_num_free_blocks() == free_before
    assert not sched._reqs_to_store and not sched._reqs_to_load


@pytest.mark.parametrize("extra", [None, {"async_register_cache": False}])
def test_gate_open_without_option(extra):
    """Default and explicit false: stock behaviour, no report needed."""
    connector, fix = _make_connector(extra)
    hit = _put_in_cpu_cache(fix)
    _assert_cpu_hit(connector, hit)


@pytest.mark.parametrize("value", ["true", "false", 1, 0, None])
def test_invalid_option_value_rejected(monkeypatch, value):
    """Anything but a JSON boolean is an error naming the key and the value."""
    extra = {"async_register_cache": value}
    with pytest.raises(ValueError, match=r"async_register_cache.*" + repr(value)):
        _make_connector(extra)
    with pytest.raises(ValueError, match=r"async_register_cache.*" + repr(value)):
        _make_worker(monkeypatch, extra, lambda t: None)


def test_option_with_disk_backend(tmp_path):
    """The disk backend (v0.28+) pins no CPU tier: the option is rejected there.

    Releases without a disk backend ignore kv_offload_backend; the option then
    applies as usual.
    """
    extra = {
        **ASYNC,
        "kv_offload_backend": "disk",
        "disk_path": str(tmp_path / "kv"),
        "disk_capacity_bytes": _BYTES_PER_BLOCK * NUM_CPU_BLOCKS,
    }
    if hasattr(connector_module, "VALID_KV_OFFLOAD_BACKENDS"):
        with pytest.raises(ValueError, match="async_register_cache"):
            _make_connector(extra)
    else:
        connector, fix = _make_connector(extra)
        _assert_gpu_only(connector, _put_in_cpu_cache(fix))
