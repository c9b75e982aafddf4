# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/simple_kv_offload/worker.py: pin the CPU KV cache in a
background thread (async_register_cache) so register_kv_caches() returns at once.

Two variants of register_kv_caches' layout:
- v0.19 .. v0.27: register_kv_caches() allocates, pins, creates the streams and
  initialises the copy backend inline (v0.24+ reads the pin check from PIN_MEMORY,
  the same value; the variant keeps is_pin_memory_available()).
- v0.28 .. v0.33: register_kv_caches() sizes the cache (v0.33: a cross-rank
  all_reduce), creates the streams and calls _init_cpu_mode(), which allocates,
  pins and initialises the copy backend; only _init_cpu_mode() changes.
The members every release shares sit in one partial class before the variants.
"""

import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from vllm.platforms import current_platform
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.utils.torch_utils import PIN_MEMORY
from vllm.v1.simple_kv_offload.copy_backend import DmaCopyBackend
from vllm.v1.simple_kv_offload.cuda_mem_ops import pin_tensor
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadWorkerMetadata,
    get_async_register_cache,
)

from vllm_patches._overlay import add, amend, call_at_end_of


@add("F4", ">=0.19.0,<0.34.0")
class AsyncCacheRegistration:
    """Pins a worker's CPU KV cache in a daemon thread (``async_register_cache``).

    cudaHostRegister over hundreds of GB runs for minutes. Done inline, it keeps
    register_kv_caches() and with it engine startup from finishing; here it runs
    in the background while the engine serves from the GPU KV cache only.

    Invariant: ``ready`` is set only after every CPU tensor is pinned and the copy
    backend is initialised. The worker reports its rank once after that, and the
    scheduler builds no CPU load or store until every worker has reported, so no
    transfer can reach a worker whose backend does not exist yet. If the
    background work fails, ``ready`` is never set and CPU offload stays off.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ready = threading.Event()
        self._reported = False
        self._thread: threading.Thread | None = None

    @staticmethod
    def allocate(
        gpu_caches: dict[str, torch.Tensor], num_cpu_blocks: int
    ) -> dict[str, torch.Tensor]:
        """Allocate unpinned, uninitialised CPU tensors mirroring ``gpu_caches``.

        torch.empty only reserves virtual memory, so this takes microseconds at
        any size; the background thread zeroes (touches) and pins the pages.
        """
        return {
            name: torch.empty(
                (num_cpu_blocks,) + gpu_tensor.shape[1:],
                dtype=gpu_tensor.dtype,
                device="cpu",
            )
            for name, gpu_tensor in gpu_caches.items()
        }

    def start(
        self,
        device: torch.device,
        cpu_caches: dict[str, torch.Tensor],
        pin_memory: bool,
        init_backend: Callable[[], None],
    ) -> None:
        """Zero and pin ``cpu_caches``, then run ``init_backend``, off-thread."""
        # Daemon: a shutdown during the pin must not wait for it. Nothing joins
        # this thread outside of tests.
        self._thread = threading.Thread(
            target=self._run,
            args=(device, cpu_caches, pin_memory, init_backend),
            name="SimpleCPUOffloadRegister",
            daemon=True,
        )
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread; True if it finished."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def take_report(self) -> frozenset[int]:
        """This worker's rank on the first call after ``ready``, else nothing."""
        if self._reported or not self.ready.is_set():
            return frozenset()
        self._reported = True
        return frozenset((self.rank,))

    def _run(
        self,
        device: torch.device,
        cpu_caches: dict[str, torch.Tensor],
        pin_memory: bool,
        init_backend: Callable[[], None],
    ) -> None:
        start = time.perf_counter()
        try:
            # Without cudaHostRegisterPortable, memory is pinned for the current
            # device's context only, and a new thread starts on device 0.
            current_platform.set_device(device)
            for tensor in cpu_caches.values():
                # Stock code allocates with torch.zeros; zeroing here keeps the
                # page faults off the calling thread too. Both zero_() and
                # cudaHostRegister release the GIL.
                tensor.zero_()
                if pin_memory:
                    pin_tensor(tensor)
            init_backend()
        except Exception:
            # The tensors stay referenced by the worker: freeing memory that is
            # still registered would leave stale CUDA host mappings behind.
            logger.exception(
                "SimpleCPUOffloadWorker: registering the CPU KV cache in the "
                "background failed; CPU offload stays disabled and requests are "
                "served from the GPU KV cache only."
            )
            return
        self.ready.set()
        logger.info(
            "SimpleCPUOffloadWorker: CPU KV cache (%.2f GB) registered in the "
            "background in %.1f s; CPU offload starts once all workers are ready.",
            sum(t.nbytes for t in cpu_caches.values()) / (1024**3),
            time.perf_counter() - start,
        )


@amend("F4", ">=0.19.0,<0.34.0")
class SimpleCPUOffloadWorker:
    """Members shared by every release; register_kv_caches / _init_cpu_mode
    differ per release and live in the partial classes below."""

    def build_connector_worker_meta(self) -> SimpleCPUOffloadWorkerMetadata | None:
        """Return completed store events since the last call.

        With ``async_register_cache``, the first call after the CPU KV cache is
        registered also reports this worker's rank to the scheduler.
        """
        ready_ranks = (
            self._cache_registration.take_report()
            if self._cache_registration is not None
            else frozenset()
        )
        if not self._completed_store_events and not ready_ranks:
            return None
        meta = SimpleCPUOffloadWorkerMetadata(
            completed_store_events=self._completed_store_events,
            ready_ranks=ready_ranks,
        )
        self._completed_store_events = {}
        return meta

    @call_at_end_of("__init__")
    def _init_async_register(self) -> None:
        """Set up background registration if ``async_register_cache`` is on."""
        self._cache_registration: AsyncCacheRegistration | None = None
        if get_async_register_cache(self.vllm_config):
            self._cache_registration = AsyncCacheRegistration(
                rank=self.vllm_config.parallel_config.rank
            )


# v0.24 .. v0.27 spell the pin check `PIN_MEMORY` (= is_pin_memory_available()
# at import); one variant serves them too, at the cost of that line in their patch.
@amend("F4", ">=0.19.0,<0.28.0")
class SimpleCPUOffloadWorker:
    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
    ) -> None:
        """Register GPU KV caches and allocate pinned CPU tensors.
        The worker will infer the underlying raw storage from the kv_caches.

        With ``async_register_cache``, the CPU tensors are only allocated here;
        a background thread pins them and initialises the copy backend (see
        AsyncCacheRegistration).

        Args:
            kv_caches: Per-layer GPU KV caches. Values are either a single
                tensor (attention layers) or a list of tensors (Mamba layers
                in hybrid models). All values are included for offloading
                by resolving to their underlying raw storage.
        """
        if not kv_caches:
            logger.warning("No KV caches to offload.")
            return

        # Resolve each entry to a representative tensor for storage
        # deduplication. For attention layers the value is already a tensor;
        # for Mamba layers it is a list of tensors that all share the same
        # underlying raw storage, so we take the first one.
        def _repr_tensor(v: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
            assert isinstance(v, torch.Tensor | list)
            return v if isinstance(v, torch.Tensor) else v[0]

        any_tensor = _repr_tensor(next(iter(kv_caches.values())))
        self.device = any_tensor.device

        assert self.kv_cache_config is not None
        num_blocks = self.kv_cache_config.num_blocks

        # Deduplicate: multiple layers may share the same backing storage.
        seen_ptrs: dict[int, tuple[str, torch.Tensor]] = {}
        for name, value in kv_caches.items():
            tensor = _repr_tensor(value)
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in seen_ptrs:
                seen_ptrs[ptr] = (name, tensor)

        # Build [num_blocks, block_bytes] int8 views from each unique
        # storage so that stride(0) gives block_bytes for the copy op.
        #
        # The physical layout varies across attention backends:
        #   FlashAttn/ROCm:  (2, num_blocks, ...) -> K/V outermost, 2 segments
        #   FlashInfer/MLA:  (num_blocks, ...)    -> blocks outermost, 1 segment
        # We derive page_size_bytes = storage.nbytes() // num_blocks, then
        # classify dims: any dim whose byte-stride exceeds page_size_bytes
        # must be an outer segment dim (e.g. the K/V dim of size 2). A less
        # hacky way is to update the interface with the layout.
        unique_gpu_caches: dict[str, torch.Tensor] = {}
        for name, tensor in seen_ptrs.values():
            storage = tensor.untyped_storage()
            raw = torch.empty(0, dtype=torch.int8, device=self.device).set_(
                storage, 0, (storage.nbytes(),)
            )
            el = tensor.element_size()
            page_size_bytes = storage.nbytes() // num_blocks
            outer_dims = [
                d for d in range(tensor.ndim) if tensor.stride(d) * el > page_size_bytes
            ]
            if not outer_dims:
                unique_gpu_caches[name] = raw.view(num_blocks, -1)
            else:
                seg_stride = tensor.stride(outer_dims[0]) * el
                for idx in range(tensor.shape[outer_dims[0]]):
                    offset = idx * seg_stride
                    chunk = raw[offset : offset + seg_stride]
                    unique_gpu_caches[f"{name}.{idx}"] = chunk.view(num_blocks, -1)

        # Compute per-tensor bytes_per_block. Tensors may have different
        # page_size_bytes (e.g., UniformTypeKVCacheSpecs with varying head_size).
        per_tensor_bpb = [
            t.stride(0) * t.element_size() for t in unique_gpu_caches.values()
        ]
        total_bytes_per_block = sum(per_tensor_bpb)

        self.num_cpu_blocks = max(1, self.cpu_capacity_bytes // total_bytes_per_block)

        logger.info(
            "SimpleCPUOffloadWorker: %d unique GPU KV tensors, "
            "allocating %d CPU blocks (%.2f GB)",
            len(unique_gpu_caches),
            self.num_cpu_blocks,
            (self.num_cpu_blocks * total_bytes_per_block) / (1024**3),
        )

        pin_memory = is_pin_memory_available()
        if not pin_memory:
            logger.warning(
                "Pinned memory not available. CPU offload performance may be degraded."
            )

        self.gpu_kv_caches = unique_gpu_caches
        if self._cache_registration is not None:
            self._register_cpu_caches_async(pin_memory)
            return

        self.cpu_kv_caches = {}
        for name, gpu_tensor in unique_gpu_caches.items():
            cpu_shape = (self.num_cpu_blocks,) + gpu_tensor.shape[1:]
            # Allocate non-pinned first, then pin via cudaHostRegister to
            # bypass PyTorch's CUDACachingHostAllocator which rounds up to
            # the next power of 2 (e.g. 100 GB -> 128 GB).
            tensor = torch.zeros(cpu_shape, dtype=gpu_tensor.dtype, device="cpu")
            if pin_memory:
                pin_tensor(tensor)
            self.cpu_kv_caches[name] = tensor

        # Use lowest priority so KV cache I/O yields to compute streams.
        low_pri, _ = torch.cuda.Stream.priority_range()
        self.load_stream = torch.cuda.Stream(priority=low_pri)
        self.store_stream = torch.cuda.Stream(priority=low_pri)

        # Initialize copy backend with caches and streams.
        self._backend.init(
            self.gpu_kv_caches,
            self.cpu_kv_caches,
            self.device,
            self.load_stream,
            self.store_stream,
        )

    def _register_cpu_caches_async(self, pin_memory: bool) -> None:
        """Allocate the CPU KV cache; pin it and init the backend off-thread."""
        assert self._cache_registration is not None
        assert self.gpu_kv_caches is not None and self.device is not None
        self.cpu_kv_caches = AsyncCacheRegistration.allocate(
            self.gpu_kv_caches, self.num_cpu_blocks
        )
        # Streams are created here, on the thread whose current device is the
        # worker's; only zeroing, pinning and the backend init move off-thread.
        low_pri, _ = torch.cuda.Stream.priority_range()
        self.load_stream = torch.cuda.Stream(priority=low_pri)
        self.store_stream = torch.cuda.Stream(priority=low_pri)
        self._cache_registration.start(
            self.device,
            self.cpu_kv_caches,
            pin_memory,
            partial(
                self._backend.init,
                self.gpu_kv_caches,
                self.cpu_kv_caches,
                self.device,
                self.load_stream,
                self.store_stream,
            ),
        )


@amend("F4", ">=0.28.0,<0.34.0")
class SimpleCPUOffloadWorker:
    def _init_cpu_mode(
        self,
        unique_gpu_caches: dict[str, torch.Tensor],
        total_bytes_per_block: int,
        device: torch.device,
    ) -> None:
        logger.info(
            "SimpleCPUOffloadWorker [CPU]: %d tensors, %d CPU blocks (%.2f GB)",
            len(unique_gpu_caches),
            self.num_cpu_blocks,
            (self.num_cpu_blocks * total_bytes_per_block) / (1024**3),
        )

        pin_memory = PIN_MEMORY
        if not pin_memory:
            logger.warning(
                "Pinned memory not available. CPU offload performance may be degraded."
            )

        if self._cache_registration is not None:
            self._register_cpu_caches_async(unique_gpu_caches, device, pin_memory)
            return

        self.cpu_kv_caches = {}
        for name, gpu_tensor in unique_gpu_caches.items():
            cpu_shape = (self.num_cpu_blocks,) + gpu_tensor.shape[1:]
            # Allocate non-pinned first, then pin via cudaHostRegister to
            # bypass PyTorch's CUDACachingHostAllocator which rounds up to
            # the next power of 2 (e.g. 100 GB -> 128 GB).
            tensor = torch.zeros(cpu_shape, dtype=gpu_tensor.dtype, device="cpu")
            if pin_memory:
                pin_tensor(tensor)
            self.cpu_kv_caches[name] = tensor

        self._backend = DmaCopyBackend()
        self._backend.init(
            unique_gpu_caches,
            self.cpu_kv_caches,
            device,
            self.load_stream,
            self.store_stream,
        )

    def _register_cpu_caches_async(
        self,
        unique_gpu_caches: dict[str, torch.Tensor],
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        """Allocate the CPU KV cache; pin it and init the backend off-thread.

        register_kv_caches() has already sized the cache and created the streams
        on the calling thread, which is where any cross-rank collective of the
        sizing must stay; only zeroing, pinning and the backend init move.
        """
        assert self._cache_registration is not None
        self.cpu_kv_caches = AsyncCacheRegistration.allocate(
            unique_gpu_caches, self.num_cpu_blocks
        )
        self._backend = DmaCopyBackend()
        self._cache_registration.start(
            device,
            self.cpu_kv_caches,
            pin_memory,
            partial(
                self._backend.init,
                unique_gpu_caches,
                self.cpu_kv_caches,
                device,
                self.load_stream,
                self.store_stream,
            ),
        )
