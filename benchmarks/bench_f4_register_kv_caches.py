"""F4: SimpleCPUOffloadWorker.register_kv_caches() wall time vs CPU tier size, stock
(async_register_cache off) vs async (on), measured in one run on one patched tree.

Flag off is the stock code path byte for byte, so both columns come from the same
patched tree given with --tree (a vLLM source tree with F4 applied whose `vllm` is
importable with the current interpreter, e.g. the venv of tools/lanes.py).

What is modelled, and why:
- cudaHostRegister is replaced by a wait of nbytes / --pin-gbps (default 20 GB/s),
  per tensor, as pin_tensor() is called once per CPU tensor. So that the run ends
  in well under a minute, one register_kv_caches() call waits at most
  --max-pin-seconds in total; rows where that cap bites are marked '*' and their
  uncapped model time is printed next to them.
- A TiB cannot be allocated here: every CPU tensor of 64 MiB or more is created on
  the meta device (shape and dtype, no memory). Stock's torch.zeros also touches
  every page on the calling thread (real cost: roughly size / memset bandwidth),
  which the async path moves into the background thread too; this model leaves
  that cost out of both columns, so it understates stock, not async.
- CUDA streams, the DMA copy backend and the device switch are stubbed (no GPU).
- With the flag the pin starts only when warm-up and CUDA-graph capture are done
  (start_async_register_cache(), which the GPU worker calls); that time is not
  register_kv_caches()'s and is not in the table.
The layout: 32 layers, one tensor per layer, 64 KiB per layer per block (16 tokens
x 8 KV heads x 128 x fp16 x K,V), i.e. 2 MiB of CPU cache per block.

Usage: python benchmarks/bench_f4_register_kv_caches.py --tree PATH
           [--sizes-gib 4,16,64,256,1024] [--pin-gbps 20] [--max-pin-seconds 8]
Goal: <= 50 ms at every size with the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import MagicMock

GOAL_MS = 50.0
NUM_LAYERS = 32
BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE = 16, 8, 128
LAYER_BLOCK_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2  # K+V, fp16
NUM_GPU_BLOCKS = 4  # the GPU stand-in only fixes the layout
META_THRESHOLD_BYTES = 64 << 20


class _FakeStream:
    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, -1


class PinModel:
    """pin_tensor() stand-in: waits nbytes / bandwidth, capped per register call."""

    def __init__(self, gbps: float, max_seconds: float, num_tensors: int) -> None:
        self.bytes_per_s = gbps * 1e9
        self.max_per_tensor = max_seconds / num_tensors
        self.release = threading.Event()

    def __call__(self, tensor) -> None:
        self.release.wait(min(tensor.nbytes / self.bytes_per_s, self.max_per_tensor))

    def register(self, address: int, nbytes: int) -> None:
        """F4's chunked cudaHostRegister (host_register) stand-in."""
        self.release.wait(min(nbytes / self.bytes_per_s, self.max_per_tensor))


def _install_stubs(torch, worker_module) -> None:
    worker_module.DmaCopyBackend = MagicMock(name="DmaCopyBackend")
    worker_module.current_platform = SimpleNamespace(set_device=lambda device: None)
    worker_module.PIN_MEMORY = True  # v0.24+
    worker_module.is_pin_memory_available = lambda: True  # before v0.24
    torch.cuda.Stream = _FakeStream

    def on_meta_if_large(factory):
        def make(*size, dtype=None, device=None, **kwargs):
            shape = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
            numel = 1
            for dim in shape:
                numel *= dim
            itemsize = (dtype or torch.get_default_dtype()).itemsize
            if str(device) == "cpu" and numel * itemsize >= META_THRESHOLD_BYTES:
                device = "meta"
            return factory(*size, dtype=dtype, device=device, **kwargs)

        return make

    torch.zeros = on_meta_if_large(torch.zeros)
    torch.empty = on_meta_if_large(torch.empty)


def _kv_cache_config(torch):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    size = NUM_GPU_BLOCKS * LAYER_BLOCK_BYTES
    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    tensors = []
    for name in names:
        if "shared_by" in fields:  # before v0.30: one tensor per layer
            tensors.append(KVCacheTensor(size=size, shared_by=[name]))
        else:  # placement-based layout
            tensors.append(
                KVCacheTensor(size=size, layers=[name], layer_stride=size,
                              block_stride=LAYER_BLOCK_BYTES))
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_SIZE, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=NUM_GPU_BLOCKS, kv_cache_tensors=tensors,
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    gpu_caches = {
        name: torch.zeros(NUM_GPU_BLOCKS, LAYER_BLOCK_BYTES // 2, dtype=torch.float16)
        for name in names
    }
    return config, gpu_caches


def _register(worker_module, config, gpu_caches, size_bytes: int, async_on: bool,
              pin: PinModel) -> tuple[float, object]:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"async_register_cache": async_on}),
        parallel_config=SimpleNamespace(rank=0),
    )
    worker = worker_module.SimpleCPUOffloadWorker(vllm_config, config, size_bytes)
    pin.release.clear()
    started = time.perf_counter()
    worker.register_kv_caches(gpu_caches)
    elapsed = time.perf_counter() - started
    return elapsed, worker


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", required=True, type=Path,
                        help="vLLM source tree with F4 applied")
    parser.add_argument("--sizes-gib", default="4,16,64,256,1024")
    parser.add_argument("--pin-gbps", type=float, default=20.0)
    parser.add_argument("--max-pin-seconds", type=float, default=8.0)
    parser.add_argument("--async-repeats", type=int, default=5)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.path.insert(0, str(args.tree.resolve()))
    import torch

    import vllm.v1.simple_kv_offload.worker as worker_module

    if not hasattr(worker_module, "AsyncCacheRegistration"):
        print(f"{args.tree}: F4 is not applied (no AsyncCacheRegistration)")
        return 2
    print(f"vLLM tree: {args.tree} ({Path(worker_module.__file__)})")
    config, gpu_caches = _kv_cache_config(torch)
    _install_stubs(torch, worker_module)
    pin = PinModel(args.pin_gbps, args.max_pin_seconds, NUM_LAYERS)
    worker_module.pin_tensor = pin
    worker_module.host_register = pin.register
    worker_module.host_unregister = lambda address: None

    block_bytes = NUM_LAYERS * LAYER_BLOCK_BYTES
    rows = []
    for gib in (int(s) for s in args.sizes_gib.split(",")):
        size = gib << 30
        model_s = size / (args.pin_gbps * 1e9)
        stock_s, worker = _register(worker_module, config, gpu_caches, size, False, pin)
        assert worker.num_cpu_blocks == size // block_bytes
        async_runs = []
        for _ in range(args.async_repeats):
            elapsed, worker = _register(worker_module, config, gpu_caches, size, True, pin)
            registration = worker._cache_registration
            assert not registration.ready.is_set() or model_s == 0
            async_runs.append(elapsed)
            # Warm-up and capture done: the GPU worker starts the deferred pin.
            worker.start_async_register_cache()
            pin.release.set()  # end the modelled pin; only the return time counts
            assert registration.join(timeout=60) and registration.ready.is_set()
        async_s = statistics.median(async_runs)
        rows.append((gib, size // block_bytes, model_s, stock_s, async_s,
                     model_s > args.max_pin_seconds))

    print(f"\nregister_kv_caches() wall time; pin modelled at {args.pin_gbps:g} GB/s, "
          f"stock capped at {args.max_pin_seconds:g} s per call ('*'); "
          f"async = median of {args.async_repeats}\n")
    print("| CPU tier | CPU blocks | modelled pin | stock (flag off) | async (flag on) "
          "| async/stock | <= 50 ms |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    met = True
    for gib, blocks, model_s, stock_s, async_s, capped in rows:
        ok = async_s * 1e3 <= GOAL_MS
        met &= ok
        stock = f"{stock_s * 1e3:,.0f} ms" + (" *" if capped else "")
        print(f"| {gib:,} GiB | {blocks:,} | {model_s:,.1f} s | {stock} | "
              f"{async_s * 1e3:.2f} ms | {async_s / stock_s:.5f} | "
              f"{'yes' if ok else 'NO'} |")
    print(f"\ngoal: async <= {GOAL_MS:g} ms at every size: {'met' if met else 'NOT met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
