# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""SimpleCPUOffloadConnector: a store reads the KV cache only after the step wrote it.

Reproduces vllm#45704: the worker queued each step's GPU->CPU store to the copy
thread at once, and the thread's batch copy ran on the store stream with no wait
for the compute stream, and with ``srcAccessOrder=ANY`` (the driver may read the
source out of stream order). Under overlapped execution the forward that writes
the stored blocks may still be running, so the CPU tier kept stale or half-written
KV and later hits decoded from it. Upstream orders stores after a compute-done event
from v0.24.0 (PR 46278).

CPU only: the streams and events are fakes that keep, per stream, the order of the
work issued to it, and the batch copy records what it was asked to copy. The real
worker and copy backend (its thread included) run a seeded series of steps as the
model runner drives them: bind the metadata, start the loads, the forward's KV
writes, wait for the save, get_finished.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import vllm.v1.simple_kv_offload.copy_backend as copy_backend_module
import vllm.v1.simple_kv_offload.cuda_mem_ops as cuda_mem_ops
from vllm.v1.simple_kv_offload.copy_backend import DmaCopyBackend
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

NUM_BLOCKS = 64
# CUmemcpySrcAccessOrder: the source is read in stream order, after the work issued
# to the stream before the copy (cuda.h); ANY (3) lets the driver read it earlier.
SRC_ACCESS_ORDER_STREAM = 1
SEEDS = range(8)


@dataclass
class Op:
    """One piece of work issued to a fake stream."""

    kind: str  # "write", "wait", "copy" or "record"
    blocks: tuple[int, ...] = ()
    # wait: the stream waited on, and how many of its ops the wait covers.
    on: FakeStream | None = None
    upto: int = 0
    src_access_order: int = 0


@dataclass(eq=False)
class FakeStream:
    """Stands in for a CUDA stream: the work issued to it, in issue order."""

    name: str
    ops: list[Op] = field(default_factory=list)
    _handles = itertools.count(1)

    def __post_init__(self) -> None:
        self.cuda_stream = next(self._handles)
        self.priority = 0

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -1

    def wait_event(self, event: FakeEvent) -> None:
        assert event.stream is not None, "a wait on an event never recorded"
        self.ops.append(Op("wait", on=event.stream, upto=event.upto))

    def wait_stream(self, stream: FakeStream) -> None:
        self.ops.append(Op("wait", on=stream, upto=len(stream.ops)))

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event


class FakeEvent:
    """Stands in for torch.Event: where in which stream it was last recorded.
    Work is never pending on CPU, so every event is complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stream: FakeStream | None = None
        self.upto = 0

    def record(self, stream: FakeStream | None = None) -> None:
        assert stream is not None
        self.stream, self.upto = stream, len(stream.ops)
        stream.ops.append(Op("record"))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Device:
    """The compute, load and store streams, with the fakes installed in torch, the
    batch copy and the copy thread's device setup."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.compute = FakeStream("compute")
        self.load = FakeStream("load")
        self.store = FakeStream("store")
        by_handle = {s.cuda_stream: s for s in (self.compute, self.load, self.store)}

        def copy_blocks(src: list[int], dst: list[int], params: Any) -> None:
            by_handle[params.stream_handle].ops.append(
                Op("copy", tuple(src), src_access_order=params.attrs.srcAccessOrder)
            )

        monkeypatch.setattr(torch, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: self.compute)
        monkeypatch.setattr(copy_backend_module, "copy_blocks", copy_blocks)
        # The resolved batch copy (never called: copy_blocks is the fake above),
        # so that build_params does not look for the CUDA driver.
        if hasattr(cuda_mem_ops, "_batch_memcpy"):  # v0.29+: (function, attrs)
            monkeypatch.setattr(cuda_mem_ops, "_batch_memcpy", (object(), 1))
        else:
            monkeypatch.setattr(cuda_mem_ops, "_batch_memcpy_fn", object())
        monkeypatch.setattr(
            copy_backend_module.current_platform, "set_device", lambda d: None
        )


def make_worker(device: Device) -> tuple[SimpleCPUOffloadWorker, DmaCopyBackend]:
    """A worker whose copy backend runs its real thread over CPU tensors."""
    worker = SimpleCPUOffloadWorker(None, None, 0)  # type: ignore[arg-type]
    worker.load_stream, worker.store_stream = device.load, device.store  # type: ignore[assignment]
    gpu = {"layer.0": torch.zeros(NUM_BLOCKS, 16, dtype=torch.int8)}
    cpu = {"layer.0": torch.zeros(NUM_BLOCKS, 16, dtype=torch.int8)}
    backend = DmaCopyBackend()
    backend.init(gpu, cpu, torch.device("cpu"), device.load, device.store)  # type: ignore[arg-type]
    worker._backend = backend
    return worker, backend


@dataclass
class Step:
    """One step's connector work: its loads and its stores (disjoint blocks)."""

    loads: list[int]
    stores: list[int]


def draw_steps(seed: int) -> list[Step]:
    """1-6 steps, each with loads, stores, both or neither; every block stored once."""
    rng = random.Random(seed)
    blocks = iter(rng.sample(range(NUM_BLOCKS), NUM_BLOCKS))
    steps = []
    for _ in range(rng.randint(1, 6)):
        loads = [next(blocks) for _ in range(rng.choice([0, 0, 1, 3]))]
        stores = [next(blocks) for _ in range(rng.choice([0, 1, 2, 4]))]
        steps.append(Step(loads, stores))
    return steps


def run_steps(device: Device, steps: list[Step]) -> dict[tuple[int, ...], int]:
    """Drive the worker as the model runner does, one step after another; the
    compute stream's ops once each step's forward wrote its stored blocks."""
    worker, backend = make_worker(device)
    written: dict[tuple[int, ...], int] = {}
    events = itertools.count()
    try:
        for step in steps:
            meta = SimpleCPUOffloadMetadata()
            if step.loads:
                meta.load_event = next(events)
                meta.load_cpu_blocks = meta.load_gpu_blocks = step.loads
            if step.stores:
                meta.store_event = next(events)
                meta.store_gpu_blocks = meta.store_cpu_blocks = step.stores
            worker.bind_connector_metadata(meta)
            worker.start_load_kv()
            device.compute.ops.append(Op("write", tuple(step.stores)))
            written[tuple(step.stores)] = len(device.compute.ops)
            worker.wait_for_save()
            worker.get_finished(set())
            worker.clear_connector_metadata()
    finally:
        backend.shutdown()  # the copy thread has issued everything queued
    return written


def copies(stream: FakeStream) -> list[tuple[int, Op]]:
    return [(i, op) for i, op in enumerate(stream.ops) if op.kind == "copy"]


def compute_covered_before(stream: FakeStream, index: int, compute: FakeStream) -> int:
    """How many of the compute stream's ops the work at ``index`` of ``stream`` is
    ordered after (through the waits issued to ``stream`` before it)."""
    waits = [
        op.upto for op in stream.ops[:index] if op.kind == "wait" and op.on is compute
    ]
    return max(waits, default=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_each_store_is_ordered_after_its_step_wrote_the_blocks(monkeypatch, seed):
    """Every store's copy runs on the store stream after a wait that covers the
    forward which wrote its blocks. Stock before v0.24.0 issues it with no wait."""
    device = Device(monkeypatch)
    written = run_steps(device, draw_steps(seed))
    stored = copies(device.store)
    assert sorted(op.blocks for _, op in stored) == sorted(b for b in written if b)
    for index, op in stored:
        covered = compute_covered_before(device.store, index, device.compute)
        assert covered >= written[op.blocks], (
            f"the store of blocks {list(op.blocks)} may read them before the forward "
            "that writes them ran (vllm#45704)"
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_each_store_reads_its_source_in_stream_order(monkeypatch, seed):
    """A wait orders a store's source reads only if the copy reads in stream order;
    stock before v0.24.0 copies with srcAccessOrder ANY."""
    device = Device(monkeypatch)
    run_steps(device, draw_steps(seed) + [Step([], [NUM_BLOCKS - 1])])
    orders = {op.src_access_order for _, op in copies(device.store)}
    assert orders == {SRC_ACCESS_ORDER_STREAM}, (
        f"stores copy with srcAccessOrder {sorted(orders)}: the driver may read the "
        "KV cache before the wait"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_loads_are_not_held_behind_the_forward(monkeypatch, seed):
    """Loads read pinned host memory that no forward writes: they wait for nothing,
    as in stock."""
    device = Device(monkeypatch)
    steps = draw_steps(seed) + [Step([NUM_BLOCKS - 1], [])]
    run_steps(device, steps)
    assert [op.blocks for _, op in copies(device.load)] == [
        tuple(s.loads) for s in steps if s.loads
    ]
    assert not [op for op in device.load.ops if op.kind == "wait"]
