# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests for SimpleCPUOffloadConnector's ``async_register_cache`` option.

Reproduces vllm#42632: ``SimpleCPUOffloadWorker.register_kv_caches()`` pins the
whole CPU KV tier with cudaHostRegister before it returns, which blocks engine
startup for minutes at hundreds of GB. With
``kv_connector_extra_config["async_register_cache"] = True`` the worker pins in
a background thread and reports its rank once its copy backend exists; the
scheduler side builds no CPU load or store until every worker has reported.

The background pin must not overlap CUDA-graph capture (vllm#46933, why upstream
reverted its background pin), must register in row-aligned chunks below 512 GiB
(vllm#51080), must unregister what it pinned when it fails and keep offload off
on every rank (vllm#51762): the scheduler then has every rank unregister its tier
and return its pages. It must show its progress.

CPU only: cudaHostRegister, CUDA streams, the DMA copy backend and the GPU
worker's capture are fakes; tiers above 512 GiB are meta tensors.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import queue
import random
import threading
import time
from types import SimpleNamespace
from typing import Any, cast
from unittest.mock import MagicMock

import pytest
import torch

import vllm.v1.simple_kv_offload.manager as manager_module
import vllm.v1.simple_kv_offload.worker as worker_module
import vllm.v1.worker.gpu_worker as gpu_worker_module
from tests.v1.kv_connector.unit.utils import create_scheduler
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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)
from vllm.platforms import current_platform
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)

try:  # the option's reader; stock has none (its tests then fail at the call)
    from vllm.v1.simple_kv_offload.metadata import get_async_register_cache
except ImportError:
    get_async_register_cache = None
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


class _FakeCuda:
    """Records async_register_cache's CUDA work: cudaHostRegister ranges (fake,
    no memory is locked), cudaHostUnregister, the copy backend's init; each with
    its thread. Also the host ranges whose pages were returned to the OS.

    ``capture_open`` is the fake capture window: any of these calls while it is
    set is a violation (vllm#46933: a pin from another thread during a global-mode
    CUDA-graph capture fails with error 900 or invalidates the capture).
    """

    def __init__(
        self, fail_at: int | None = None, block: threading.Event | None = None
    ):
        self.fail_at, self.block = fail_at, block
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.pages_returned: list[tuple[int, int]] = []
        self.whole_tensor_pins: list[torch.Tensor] = []
        self.threads: list[threading.Thread] = []
        self.capture_open = False
        self.in_capture: list[str] = []
        self.pinned = threading.Event()

    def _call(self, what: str) -> None:
        self.threads.append(threading.current_thread())
        if self.capture_open:
            self.in_capture.append(what)
        self.pinned.set()
        if self.block is not None:
            self.block.wait(timeout=PIN_SECONDS)

    def register(self, address: int, nbytes: int) -> None:
        self._call("cudaHostRegister")
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            raise RuntimeError("cudaHostRegister failed: cudaErrorMemoryAllocation")
        self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)

    def return_pages(self, address: int, nbytes: int) -> None:
        self.pages_returned.append((address, nbytes))

    def pin_tensor(self, tensor: torch.Tensor) -> None:
        """Stock's pin (and a background pin started at once): one cudaHostRegister per
        tensor."""
        self._call("pin_tensor")
        if self.fail_at is not None:
            raise RuntimeError("cudaHostRegister failed: cudaErrorMemoryAllocation")
        self.whole_tensor_pins.append(tensor)

    def backend_init(self, *args: Any) -> None:
        self._call("DmaCopyBackend.init")

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self.registered) + sum(
            t.nbytes for t in self.whole_tensor_pins
        )


def _use_cuda(monkeypatch: pytest.MonkeyPatch, cuda: _FakeCuda) -> None:
    """Send the workers' pin, unpin and page release calls to ``cuda``."""
    monkeypatch.setattr(worker_module, "pin_tensor", cuda.pin_tensor)
    monkeypatch.setattr(worker_module, "host_register", cuda.register, raising=False)
    monkeypatch.setattr(
        worker_module, "host_unregister", cuda.unregister, raising=False
    )
    monkeypatch.setattr(
        worker_module, "release_host_pages", cuda.return_pages, raising=False
    )


def _make_worker(
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, Any] | None,
    cuda: _FakeCuda,
    rank: int = 0,
) -> tuple[SimpleCPUOffloadWorker, dict[str, torch.Tensor]]:
    """A worker whose CUDA calls go to ``cuda``."""
    _use_cuda(monkeypatch, cuda)
    # Take the pinning path although the machine has no CUDA (the flag is
    # PIN_MEMORY from v0.24, is_pin_memory_available() before).
    monkeypatch.setattr(worker_module, "PIN_MEMORY", True, raising=False)
    monkeypatch.setattr(
        worker_module, "is_pin_memory_available", lambda: True, raising=False
    )
    backend_cls = MagicMock(name="DmaCopyBackend")
    backend_cls.return_value.init.side_effect = cuda.backend_init
    monkeypatch.setattr(worker_module, "DmaCopyBackend", backend_cls)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(current_platform, "set_device", lambda d: None)

    worker = SimpleCPUOffloadWorker(
        _vllm_config(extra, rank=rank),
        _make_kv_cache_config(NUM_GPU_BLOCKS),
        _BYTES_PER_BLOCK * NUM_CPU_BLOCKS,
    )
    # v0.19 .. v0.27 build the backend in __init__, before the patch above can
    # reach the class: give the worker the mock either way.
    worker._backend = backend_cls.return_value
    # One layer, blocks outermost; a CPU tensor stands in for the GPU cache.
    kv_caches = {
        "layer_0": torch.ones(
            NUM_GPU_BLOCKS, _BYTES_PER_BLOCK // DTYPE.itemsize, dtype=DTYPE
        )
    }
    return worker, kv_caches


class _StubGpuWorker(gpu_worker_module.Worker):
    """vLLM's GPU worker with just enough state for compile_or_warm_up_model():
    no dummy-run sizes, CUDA graphs captured (enforce_eager off) by ``runner``."""

    def __init__(self, vllm_config: VllmConfig, runner: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = SimpleNamespace(enforce_eager=False, seed=0)
        self.cache_config = SimpleNamespace(kv_cache_memory_bytes=1)
        self.compilation_config = vllm_config.compilation_config
        self.scheduler_config = vllm_config.scheduler_config
        self.parallel_config = vllm_config.parallel_config
        self.device = torch.device("cpu")
        self.model_runner = runner
        self.use_v2_model_runner = False

    def __getattr__(self, name: str) -> Any:
        # Release-specific helpers (capture contexts, JIT monitors) do nothing
        # here; memory figures stay absent so no report is computed.
        if name.startswith("_") and not name.startswith("__"):
            return MagicMock(name=name)
        if name.endswith("_config"):  # the configs newer releases read (v0.33)
            return getattr(self.vllm_config, name)
        raise AttributeError(name)


def _warm_up_and_capture(monkeypatch: pytest.MonkeyPatch, worker, cuda: _FakeCuda):
    """Run the GPU worker's compile_or_warm_up_model() with the SimpleCPUOffload
    worker as its KV connector. Its capture_model() ends the fake capture window
    after giving a pin thread that is already running time to call into CUDA
    (up to 1 s)."""
    connector = object.__new__(SimpleCPUOffloadConnector)
    connector.worker_handler = worker
    monkeypatch.setattr(gpu_worker_module, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(gpu_worker_module, "get_kv_transfer_group", lambda: connector)
    for name in (
        "kernel_warmup",
        "warmup_kernels",
        "set_random_seed",
        "freeze_gc_heap",
        "maybe_attach_gc_debug_callback",
        "enable_gpu_sync_check",
        "trigger_inductor_lazy_init",
        "maybe_save_startup_plan",
    ):
        if hasattr(gpu_worker_module, name):
            monkeypatch.setattr(gpu_worker_module, name, lambda *a, **k: None)
    try:  # v0.33 imports it inside compile_or_warm_up_model()
        from vllm.compilation import compiler_interface
    except ImportError:
        pass
    else:
        monkeypatch.setattr(
            compiler_interface,
            "trigger_inductor_lazy_init",
            lambda *a, **k: None,
            raising=False,
        )
    monkeypatch.setattr(
        gpu_worker_module, "get_pp_group", lambda: SimpleNamespace(is_last_rank=False)
    )
    try:  # v0.20 .. v0.32 activate it inside compile_or_warm_up_model()
        jit_monitor = importlib.import_module("vllm.triton_utils.jit_monitor")
    except ImportError:
        pass
    else:
        monkeypatch.setattr(jit_monitor, "activate", lambda *a, **k: None)

    def capture_model() -> int:
        cuda.pinned.wait(timeout=1.0)
        cuda.capture_open = False  # capture ended; the last step of the window
        return 0

    runner = MagicMock(name="GPUModelRunner")
    runner.capture_model.side_effect = capture_model
    runner.is_pooling_model = False
    stub = _StubGpuWorker(worker.vllm_config, runner)
    gpu_worker_module.Worker.compile_or_warm_up_model(stub)
    runner.capture_model.assert_called_once()


def _register(monkeypatch, worker, kv_caches, cuda: _FakeCuda) -> None:
    """initialize_from_config's register_kv_caches(), then compile_or_warm_up_model():
    the whole span is capture-risky, so it is one capture window, open from the
    start of register_kv_caches() until capture_model() returns."""
    cuda.capture_open = True
    try:
        worker.register_kv_caches(kv_caches)
        _warm_up_and_capture(monkeypatch, worker, cuda)
    finally:
        cuda.capture_open = False


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


def _new_request_step(
    connector: SimpleCPUOffloadConnector, fix: SchedulerFixture
) -> tuple[Request, Any]:
    """A new request of 2 blocks, allocated and scheduled: it, and its step's
    connector metadata (whose computed blocks are stored when the gate is open)."""
    req = make_request(num_blocks=2)
    kv_blocks = _alloc_and_register(fix, req, 2)
    connector.update_state_after_alloc(req, kv_blocks, 0)
    meta = connector.build_connector_meta(
        make_scheduler_output(
            {req.request_id: 2 * BLOCK_SIZE},
            new_reqs={req.request_id: kv_blocks.get_block_ids()},
        )
    )
    return req, meta


def _gated_hit(
    world_size: int = 1,
) -> tuple[SimpleCPUOffloadConnector, SchedulerFixture, Request]:
    """An async-registering connector of ``world_size`` ranks, none reported yet,
    with a request's blocks in its CPU cache."""
    connector, fix = _make_connector(ASYNC, world_size=world_size)
    return connector, fix, _put_in_cpu_cache(fix)


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
    """With the option, startup (register_kv_caches, then warm-up and capture)
    finishes before the pin ends; the pin runs on a daemon thread.

    The fake cudaHostRegister blocks until the test releases it (or PIN_SECONDS
    pass): code that pins on the calling thread cannot return while it blocks.
    """
    release = threading.Event()
    cuda = _FakeCuda(block=release)
    worker, kv_caches = _make_worker(monkeypatch, ASYNC, cuda)
    start = time.perf_counter()
    try:
        _register(monkeypatch, worker, kv_caches, cuda)
        elapsed = time.perf_counter() - start
        assert elapsed < PIN_SECONDS, f"startup waited {elapsed:.2f} s for the pin"
        registration = worker._cache_registration
        assert registration is not None
        assert not registration.ready.is_set()
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
    assert cuda.threads and threading.current_thread() not in cuda.threads
    assert cuda.threads.count(registration._thread) == len(cuda.threads)
    assert cuda.pinned_bytes == cpu_cache.nbytes
    # Stock allocates with torch.zeros; the background thread zeroes too.
    assert not cpu_cache.any()


def test_no_cuda_work_during_warm_up_and_capture(monkeypatch):
    """vllm#46933: no cudaHostRegister and no copy-backend init of the option's between
    register_kv_caches() and the end of compile_or_warm_up_model() (warm-up and
    CUDA-graph capture); the pin starts when that returns and then completes."""
    cuda = _FakeCuda()
    worker, kv_caches = _make_worker(monkeypatch, ASYNC, cuda)
    _register(monkeypatch, worker, kv_caches, cuda)
    assert cuda.in_capture == [], (
        f"CUDA work inside the capture window: {cuda.in_capture}"
    )

    registration = worker._cache_registration
    assert registration is not None and registration.join(timeout=10)
    assert registration.ready.is_set()
    assert worker.cpu_kv_caches is not None
    assert cuda.pinned_bytes == sum(t.nbytes for t in worker.cpu_kv_caches.values())
    # The backend is initialised last, once the whole tier is pinned.
    assert cuda.threads and "DmaCopyBackend.init" not in cuda.in_capture
    cast(MagicMock, worker._backend).init.assert_called_once()


@pytest.mark.parametrize("extra", [None, {"async_register_cache": False}])
def test_sync_register_pins_on_calling_thread(monkeypatch, extra):
    """Without the option, register_kv_caches() pins before it returns (stock):
    one pin_tensor per tensor, on the calling thread."""
    cuda = _FakeCuda()
    worker, kv_caches = _make_worker(monkeypatch, extra, cuda)
    worker.register_kv_caches(kv_caches)
    # Done by the time it returns, on the calling thread.
    assert cuda.threads == [threading.current_thread()] * 2
    assert len(cuda.whole_tensor_pins) == 1 and not cuda.registered
    cast(MagicMock, worker._backend).init.assert_called_once()
    assert worker.build_connector_worker_meta() is None


def test_async_register_reports_rank_once(monkeypatch):
    cuda = _FakeCuda()
    worker, kv_caches = _make_worker(monkeypatch, ASYNC, cuda, rank=3)
    _register(monkeypatch, worker, kv_caches, cuda)
    registration = worker._cache_registration
    assert registration is not None and registration.join(timeout=10)

    # The report rides along with whatever the step reports anyway.
    worker._completed_store_events = {7: 1}
    meta = worker.build_connector_worker_meta()
    assert meta is not None
    assert meta.ready_ranks == {3} and not meta.failed_ranks
    assert meta.completed_store_events == {7: 1}
    # Once only.
    assert worker.build_connector_worker_meta() is None
    worker._completed_store_events = {8: 1}
    meta = worker.build_connector_worker_meta()
    assert meta is not None and not meta.ready_ranks


def test_async_register_failure_unregisters_and_reports(monkeypatch):
    """A pin failing part-way unregisters every chunk this worker registered,
    logs once, initialises no backend and reports the rank as failed, once."""
    cuda = _FakeCuda(fail_at=2)
    worker, kv_caches = _make_worker(monkeypatch, ASYNC, cuda, rank=1)
    # Two block rows per chunk: the 8-block tier pins in 4 calls; the third fails.
    monkeypatch.setattr(
        worker_module.AsyncCacheRegistration, "CHUNK_BYTES", 2 * _BYTES_PER_BLOCK
    )
    logger = MagicMock()
    monkeypatch.setattr(worker_module, "logger", logger)
    _register(monkeypatch, worker, kv_caches, cuda)
    registration = worker._cache_registration
    assert registration is not None and registration.join(timeout=10)

    logger.exception.assert_called_once()
    assert len(cuda.registered) == 2
    assert sorted(cuda.unregistered) == sorted(a for a, _ in cuda.registered)
    _assert_tier_returned(worker, cuda)
    assert not registration.ready.is_set()
    cast(MagicMock, worker._backend).init.assert_not_called()
    meta = worker.build_connector_worker_meta()
    assert meta is not None and meta.failed_ranks == {1} and not meta.ready_ranks
    assert worker.build_connector_worker_meta() is None


def _assert_tier_returned(worker: SimpleCPUOffloadWorker, cuda: _FakeCuda) -> None:
    """Nothing of ``worker``'s stays registered and every CPU tensor's pages went
    back to the OS, once."""
    assert sorted(cuda.unregistered) == sorted(a for a, _ in cuda.registered)
    assert worker.cpu_kv_caches is not None
    assert sorted(cuda.pages_returned) == sorted(
        (t.data_ptr(), t.nbytes) for t in worker.cpu_kv_caches.values()
    )


def _bind(worker: SimpleCPUOffloadWorker, meta: SimpleCPUOffloadMetadata) -> None:
    worker.bind_connector_metadata(meta)
    worker.clear_connector_metadata()


def _release_order() -> SimpleCPUOffloadMetadata:
    meta = SimpleCPUOffloadMetadata()
    meta.release_cpu_cache = True  # stock has no such field: nothing reads it
    return meta


def test_release_order_frees_a_pinned_rank(monkeypatch):
    """vllm#51762: a rank whose pin succeeded, told that another failed, unregisters
    every chunk and returns its pages (in the background), once; it never reports
    anything afterwards and ordinary metadata changes nothing."""
    cuda = _FakeCuda()
    worker, kv_caches = _make_worker(monkeypatch, ASYNC, cuda)
    monkeypatch.setattr(
        worker_module.AsyncCacheRegistration, "CHUNK_BYTES", 2 * _BYTES_PER_BLOCK
    )
    _register(monkeypatch, worker, kv_caches, cuda)
    registration = worker._cache_registration
    assert registration is not None and registration.join(timeout=10)
    assert len(cuda.registered) == 4 and not cuda.unregistered

    _bind(worker, SimpleCPUOffloadMetadata())
    assert not cuda.unregistered
    _bind(worker, _release_order())
    assert registration.join(timeout=10)
    _assert_tier_returned(worker, cuda)
    _bind(worker, _release_order())
    assert registration.join(timeout=10)
    assert len(cuda.unregistered) == 4 and len(cuda.pages_returned) == 1


def test_release_order_stops_a_pin_in_progress(monkeypatch):
    """The order can reach a rank still pinning (another rank failed at once): it
    stops at its next chunk, initialises no backend, reports nothing and leaves
    nothing registered."""
    unblock = threading.Event()
    cuda = _FakeCuda(block=unblock)
    worker, kv_caches = _make_worker(monkeypatch, ASYNC, cuda)
    monkeypatch.setattr(
        worker_module.AsyncCacheRegistration, "CHUNK_BYTES", 2 * _BYTES_PER_BLOCK
    )
    try:
        _register(monkeypatch, worker, kv_caches, cuda)
        assert cuda.pinned.wait(timeout=10)  # inside the first cudaHostRegister
        _bind(worker, _release_order())
    finally:
        unblock.set()
    registration = worker._cache_registration
    assert registration is not None and registration.join(timeout=10)
    assert len(cuda.registered) == 1
    _assert_tier_returned(worker, cuda)
    cast(MagicMock, worker._backend).init.assert_not_called()
    assert not registration.ready.is_set()
    assert worker.build_connector_worker_meta() is None


def test_failed_rank_leaves_no_rank_pinned(monkeypatch):
    """vllm#51762 across ranks: rank 1's pin fails after rank 0's succeeded. The
    report reaches the scheduler, which keeps offload off and puts the release
    order in the next step's metadata only; bound on every worker, it leaves
    nothing registered and every tier's pages returned."""
    connector, _ = _make_connector(ASYNC, world_size=2)
    cudas = [_FakeCuda(), _FakeCuda(fail_at=1)]
    workers = []
    for rank, cuda in enumerate(cudas):
        worker, kv_caches = _make_worker(monkeypatch, ASYNC, cuda, rank=rank)
        monkeypatch.setattr(
            worker_module.AsyncCacheRegistration, "CHUNK_BYTES", 2 * _BYTES_PER_BLOCK
        )
        _register(monkeypatch, worker, kv_caches, cuda)
        registration = worker._cache_registration
        assert registration is not None and registration.join(timeout=10)
        workers.append(worker)
    assert len(cudas[0].registered) == 4 and not cudas[0].unregistered

    reports = [w.build_connector_worker_meta() for w in workers]
    assert reports[0] is not None and reports[1] is not None
    connector.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=reports[0].aggregate(reports[1]))
    )
    assert connector.scheduler_manager is not None
    assert not connector.scheduler_manager.is_ready()
    metas = [connector.build_connector_meta(make_scheduler_output({})) for _ in "ab"]
    assert [getattr(m, "release_cpu_cache", False) for m in metas] == [True, False]

    for worker, cuda in zip(workers, cudas):
        _use_cuda(monkeypatch, cuda)
        _bind(worker, metas[0])
        registration = worker._cache_registration
        assert registration is not None and registration.join(timeout=10)
        _assert_tier_returned(worker, cuda)


def _row_aligned_ranges(cuda: _FakeCuda, tensor: torch.Tensor) -> None:
    row = tensor.stride(0) * tensor.element_size()
    base = tensor.data_ptr()
    position = base
    for address, nbytes in cuda.registered:
        assert address == position, "the chunks must tile the tensor in order"
        assert (address - base) % row == 0 and nbytes % row == 0
        assert (
            0
            < nbytes
            <= max(row, worker_module.AsyncCacheRegistration.CHUNK_BYTES)
            < 512 << 30
        )
        position += nbytes
    assert position == base + tensor.nbytes


@pytest.mark.parametrize(
    "blocks, row_bytes",
    [
        (2 << 20, 1 << 20),  # 2 TiB of 1 MiB blocks (the seed's multi-TB tier)
        (640, 1 << 30),  # 640 GiB of 1 GiB blocks: above the 512 GiB limit
        (3, 20 << 30),  # a block row above the chunk bound is pinned alone
    ],
)
def test_tier_above_512_gib_pins_in_row_aligned_chunks(monkeypatch, blocks, row_bytes):
    """vllm#51080: one cudaHostRegister of 512 GiB or more fails. Every call stays
    below the chunk bound (one row at least), on block-row boundaries, and the
    calls tile the tensor. Meta tensors: no memory is allocated."""
    cuda = _FakeCuda()
    worker, _ = _make_worker(monkeypatch, ASYNC, cuda)
    tier = torch.empty((blocks, row_bytes), dtype=torch.int8, device="meta")
    registration = worker._cache_registration
    assert registration is not None
    worker._pin_cpu_tensor(tier)
    worker._init_copy_backend({}, {}, torch.device("cpu"), None, None)
    worker.start_async_register_cache()
    assert registration.join(timeout=60) and registration.ready.is_set()
    assert len(cuda.registered) > 1
    _row_aligned_ranges(cuda, tier)


def test_pin_progress_lines_are_bounded(monkeypatch):
    """Progress: GB done, rate and time left, at most one line per tenth and none
    within 10 s of the previous; a fast pin logs none before its final line."""
    logger = MagicMock()
    monkeypatch.setattr(worker_module, "logger", logger)
    now = [0.0]
    total = 1000 << 30
    progress = worker_module.PinProgress(total, clock=lambda: now[0])
    for _ in range(1000):  # 1000 steps of 1 GiB, 1 s each
        now[0] += 1.0
        progress.advance(1 << 30)
    lines = logger.info.call_args_list
    assert 9 <= len(lines) <= 10
    assert all("GB" in call.args[0] and "s left" in call.args[0] for call in lines)

    logger.reset_mock()
    fast = worker_module.PinProgress(total, clock=lambda: now[0])
    for _ in range(1000):  # the whole tier within 5 s
        now[0] += 0.005
        fast.advance(1 << 30)
    logger.info.assert_not_called()


def test_worker_meta_aggregate_merges_ready_ranks():
    a = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={1: 1}, ready_ranks=frozenset({0})
    )
    b = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={1: 1, 2: 1}, ready_ranks=frozenset({1, 0})
    )
    c = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={2: 1}, failed_ranks=frozenset({2})
    )
    merged = a.aggregate(b).aggregate(c)
    assert isinstance(merged, SimpleCPUOffloadWorkerMetadata)
    assert merged.ready_ranks == {0, 1} and merged.failed_ranks == {2}
    assert merged.completed_store_events == {1: 2, 2: 2}


# ---------------------------------------------------------------------------
# Scheduler side
# ---------------------------------------------------------------------------


def test_gate_closed_until_workers_ready():
    """No CPU hit, load or store before the workers report."""
    connector, fix, hit = _gated_hit()
    free_before = fix.scheduler.cpu_block_pool.get_num_free_blocks()

    _assert_gpu_only(connector, hit)

    req, meta = _new_request_step(connector, fix)
    _assert_empty(meta)
    assert connector.request_finished(req, []) == (False, None)
    assert fix.scheduler.cpu_block_pool.get_num_free_blocks() == free_before


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_gate_opens_after_every_rank_reported(world_size):
    """Opens on exactly the last distinct rank, in any order; duplicates once."""
    connector, fix, hit = _gated_hit(world_size)
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
    connector, fix, hit = _gated_hit(4)
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
    connector, fix, hit = _gated_hit(4)
    _assert_gpu_only(connector, hit)
    for _ in range(3):
        for rank in (0, 1, 3):
            _report_ready(connector, rank)
    assert not fix.scheduler.is_ready()
    _assert_gpu_only(connector, hit)

    req, meta = _new_request_step(connector, fix)
    _assert_empty(meta)


def test_failed_rank_keeps_every_rank_off(monkeypatch):
    """vllm#51762: a rank that reports failure keeps CPU offload off everywhere,
    whatever the others report; the scheduler logs it once."""
    connector, fix, hit = _gated_hit(4)
    logger = MagicMock()  # after setup: upstream logs its CPU block count there
    monkeypatch.setattr(manager_module, "logger", logger)
    failed = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={}, failed_ranks=frozenset({2})
    )
    for _ in range(3):
        connector.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=failed)
        )
        _report_ready(connector, 0, 1, 3)
    assert not fix.scheduler.is_ready()
    _assert_gpu_only(connector, hit)
    logger.error.assert_called_once()
    logger.info.assert_not_called()


def test_gate_open_is_logged_with_its_time(monkeypatch):
    connector, fix = _make_connector(ASYNC, world_size=2)
    logger = MagicMock()  # after setup: upstream logs its CPU block count there
    monkeypatch.setattr(manager_module, "logger", logger)
    _report_ready(connector, 0, 1)
    assert fix.scheduler.is_ready()
    (call,) = logger.info.call_args_list
    assert "s after the scheduler started" in call.args[0]


def test_upstream_option_name_async_init():
    """PR 54792's name for the option means the same: the scheduler waits."""
    _, fix = _make_connector({"async_init": True})
    assert not fix.scheduler.is_ready()


def test_option_names_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        _make_connector({"async_register_cache": True, "async_init": False})


def test_request_admitted_while_pinning_stays_gpu_only():
    """A request scheduled before the gate opens is never offloaded or leaked."""
    connector, fix = _make_connector(ASYNC)
    sched = fix.scheduler
    free_before = sched.cpu_block_pool.get_num_free_blocks()

    req, meta = _new_request_step(connector, fix)
    _assert_empty(meta)

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
        _make_worker(monkeypatch, extra, _FakeCuda())


def test_option_with_disk_backend(tmp_path):
    """The disk backend (v0.28+) pins no CPU tier: the option is rejected with it
    (on every release: older ones have no disk backend to ask for)."""
    extra = {
        **ASYNC,
        "kv_offload_backend": "disk",
        "disk_path": str(tmp_path / "kv"),
        "disk_capacity_bytes": _BYTES_PER_BLOCK * NUM_CPU_BLOCKS,
    }
    with pytest.raises(ValueError, match="async_register_cache"):
        _make_connector(extra)


def test_option_with_elastic_ep_rejected():
    """Elastic EP captures CUDA graphs again while serving: a pin could overlap."""
    config = _vllm_config(ASYNC)
    config.parallel_config.enable_elastic_ep = True
    with pytest.raises(ValueError, match="elastic EP"):
        get_async_register_cache(config)


# ---------------------------------------------------------------------------
# Without traffic: reports and the release order need no request
# ---------------------------------------------------------------------------


def _idle_scheduler(monkeypatch, world_size: int, idle_step_s: float):
    """A real Scheduler with the connector (the option on) and no requests."""
    monkeypatch.setattr(
        manager_module.SimpleCPUOffloadScheduler,
        "IDLE_STEP_S",
        idle_step_s,
        raising=False,
    )
    return create_scheduler(
        _vllm_config(ASYNC, world_size=world_size),
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_config=_make_kv_cache_config(NUM_GPU_BLOCKS),
    )


def _step_output(meta: SimpleCPUOffloadWorkerMetadata):
    """What kv_connector_no_forward returns for a step without tokens."""
    output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
    output.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=meta)
    return output


def test_idle_engine_steps_until_the_release_order_is_sent(monkeypatch):
    """A pin that fails while no request comes: the failure report and the
    release order travel in empty steps, not with the first request, and the
    steps stop once the order went out."""
    scheduler = _idle_scheduler(monkeypatch, world_size=2, idle_step_s=0.0)
    assert scheduler.has_requests()  # the idle step is due: the engine steps
    first = scheduler.schedule()
    assert first.total_num_scheduled_tokens == 0
    assert isinstance(first.kv_connector_metadata, SimpleCPUOffloadMetadata)
    assert not first.kv_connector_metadata.release_cpu_cache
    failed = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={},
        ready_ranks=frozenset({0}),
        failed_ranks=frozenset({1}),
    )
    scheduler.update_from_output(first, _step_output(failed))
    assert scheduler.has_requests()  # the order is outstanding
    second = scheduler.schedule()
    assert isinstance(second.kv_connector_metadata, SimpleCPUOffloadMetadata)
    assert second.kv_connector_metadata.release_cpu_cache
    scheduler.update_from_output(second, copy.copy(EMPTY_MODEL_RUNNER_OUTPUT))
    assert not scheduler.has_requests()  # nothing outstanding: idle again


def test_idle_engine_steps_until_every_rank_reported_ready(monkeypatch):
    """The gate opens in an empty step; then the engine stops stepping."""
    scheduler = _idle_scheduler(monkeypatch, world_size=2, idle_step_s=0.0)
    connector = scheduler.get_kv_connector()
    assert isinstance(connector, SimpleCPUOffloadConnector)
    assert scheduler.has_requests()
    output = scheduler.schedule()
    ready = SimpleCPUOffloadWorkerMetadata(
        completed_store_events={}, ready_ranks=frozenset({0, 1})
    )
    scheduler.update_from_output(output, _step_output(ready))
    assert connector.scheduler_manager is not None
    assert connector.scheduler_manager.is_ready()
    assert not scheduler.has_requests()


def test_no_idle_steps_without_the_option(monkeypatch):
    """Default: an engine without requests never steps, as upstream."""
    monkeypatch.setattr(
        manager_module.SimpleCPUOffloadScheduler, "IDLE_STEP_S", 0.0, raising=False
    )
    scheduler = create_scheduler(
        _vllm_config(),
        num_blocks=NUM_GPU_BLOCKS,
        kv_cache_config=_make_kv_cache_config(NUM_GPU_BLOCKS),
    )
    assert not scheduler.has_requests()


class _InputQueue:
    """EngineCoreProc's input queue, empty: a get that would block forever fails
    the test instead; a bounded one times out at once."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def empty(self) -> bool:
        return True

    def get(self, block: bool = True, timeout: float | None = None):
        if block and timeout is None:
            raise AssertionError("blocked on the input queue without a bound")
        self.timeouts.append(timeout if timeout is not None else 0.0)
        raise queue.Empty

    def get_nowait(self):
        raise AssertionError("the queue is empty")


def test_idle_engine_core_wakes_for_the_idle_step(monkeypatch):
    """EngineCoreProc waits for input without a bound when it has no requests;
    while the connector's idle step is outstanding it waits at most until the
    step is due, then leaves its input loop so that the busy loop steps."""
    scheduler = _idle_scheduler(monkeypatch, world_size=1, idle_step_s=3600.0)
    core = cast(Any, object.__new__(EngineCoreProc))
    core.scheduler = scheduler
    core.input_queue = _InputQueue()
    core.aborts_queue = queue.Queue()
    core.process_input_queue_block = True
    core.engines_running = False
    core.batch_queue = None
    core._idle_state_callbacks = []
    monkeypatch.setattr(EngineCoreProc, "is_running", lambda self: True)
    core._process_input_queue()
    (timeout,) = core.input_queue.timeouts
    assert 0 < timeout <= 3600.0
