# SPDX-License-Identifier: Apache-2.0
"""F4 overlay of vllm/v1/simple_kv_offload/worker.py: pin the CPU KV cache in a
background thread (async_register_cache), after the worker captured its CUDA graphs,
in bounded chunks, so register_kv_caches() returns at once.

Three calls (``torch.zeros``, ``pin_tensor``, ``self._backend.init``) are redirected
in register_kv_caches() (v0.19 .. v0.27) or _init_cpu_mode() (v0.28+).
"""

import ctypes
import mmap
import threading
import time
from collections.abc import Callable
from functools import partial

import torch

from vllm.platforms import current_platform
from vllm.v1.simple_kv_offload.cuda_mem_ops import pin_tensor
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
    get_async_register_cache,
)

from vllm_patches._overlay import (
    add,
    amend,
    call_at_end_of,
    filter_result_of,
    redirect_call_in,
)


@add("F4", ">=0.19.0")
def host_register(address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``address`` (cudaHostRegister)."""
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if err.value != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")


@add("F4", ">=0.19.0")
def host_unregister(address: int) -> None:
    """Undo host_register() of the range starting at ``address``."""
    err = torch.cuda.cudart().cudaHostUnregister(address)
    if err.value != 0:
        raise RuntimeError(f"cudaHostUnregister failed: {err}")


@add("F4", ">=0.19.0")
def release_host_pages(address: int, nbytes: int) -> None:
    """Return the whole pages of ``[address, address + nbytes)`` to the OS (madvise
    MADV_DONTNEED): the mapping stays valid and reads zeros, so no tensor is freed."""
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if end <= start:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(start, end - start, mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


@add("F4", ">=0.19.0")
def pin_chunks(tensor: torch.Tensor, max_bytes: int) -> list[tuple[int, int]]:
    """The (address, nbytes) ranges to pin ``tensor`` in, each at most ``max_bytes`` and
    on block-row bounds (the copy backend's DMA copies one row, never across two)."""
    assert tensor.is_contiguous()
    row_bytes = tensor.stride(0) * tensor.element_size()
    rows_per_chunk = max(1, max_bytes // row_bytes)
    base = tensor.data_ptr()
    return [
        (base + row * row_bytes, min(rows_per_chunk, tensor.shape[0] - row) * row_bytes)
        for row in range(0, tensor.shape[0], rows_per_chunk)
    ]


@add("F4", ">=0.19.0")
class PinProgress:
    """Logs how far a background pin got: GB done, rate, estimated time left.

    Bounded: one line each time another tenth of the tier is done, but none within
    INTERVAL_S of the previous one, plus the final line from the caller.
    """

    INTERVAL_S = 10.0

    def __init__(
        self, total_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total_bytes = max(total_bytes, 1)
        self.done_bytes = 0
        self._clock = clock
        self.started = clock()
        self._last_line = self.started
        self._last_tenth = 0

    def advance(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        tenth = 10 * self.done_bytes // self.total_bytes
        now = self._clock()
        if tenth <= self._last_tenth or now - self._last_line < self.INTERVAL_S:
            return
        self._last_tenth, self._last_line = tenth, now
        rate = self.done_bytes / max(now - self.started, 1e-9)
        logger.info(
            "SimpleCPUOffloadWorker: pinned %.1f of %.1f GB of the CPU KV cache "
            "(%.2f GB/s, about %.0f s left)",
            self.done_bytes / 1e9,
            self.total_bytes / 1e9,
            rate / 1e9,
            (self.total_bytes - self.done_bytes) / rate,
        )


@add("F4", ">=0.19.0")
class AsyncCacheRegistration:
    """Pins a worker's CPU KV cache in a daemon thread (``async_register_cache``).

    No CUDA call before start(), which runs after CUDA-graph capture (a pin during
    capture fails or invalidates it, vllm-project/vllm#46933); ``ready`` only once every
    tensor is pinned and the copy backend initialised; a failure or release() leaves
    nothing registered (vllm-project/vllm#51762)."""

    # The most one cudaHostRegister call pins. One call of 512 GiB or more fails
    # with cudaErrorMemoryAllocation however much memory is free (vllm#51080), and
    # the call holds driver-global locks for its whole length (TensorRT-LLM#17429):
    # every CUDA call of the serving thread waits for it. Measured on an H100
    # (benchmarks/gpu_f4_pin_during_capture.py, 64 GiB after capture): the longest
    # stall of a tiny kernel was 0.93-1.52 s with 16 GiB calls, 0.12-0.17 s with
    # 2 GiB calls, for the same total pin time (7.5-9.3 s against 7.8-8.3 s);
    # 1 GiB calls stalled a little less (0.08-0.13 s) but took longer in all
    # (8.9-11.5 s). 4 TB is 2048 calls.
    CHUNK_BYTES = 2 << 30

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.ready = threading.Event()
        self.failed = False
        self._reported = False
        # Guards the hand-over between the pin thread finishing and release().
        self._lock = threading.Lock()
        self._finished = False
        self._release_requested = False
        self._registered: list[int] = []
        self._tensors: list[torch.Tensor] = []
        self._init_backend: Callable[[], None] | None = None
        self._device: torch.device | None = None
        self._thread: threading.Thread | None = None

    def defer_pin(self, tensor: torch.Tensor) -> None:
        """Zero and pin ``tensor`` in the background instead of now."""
        self._tensors.append(tensor)

    def defer_backend_init(
        self, init_backend: Callable[[], None], device: torch.device
    ) -> None:
        """Initialise the copy backend (``device``'s) in the background, last."""
        self._init_backend, self._device = init_backend, device

    def start(self) -> None:
        """Start the background work, once; later calls (a recapture) do nothing."""
        if (
            self._thread is not None
            or self._init_backend is None
            or self._release_requested
        ):
            return
        self._thread = threading.Thread(
            target=self._run, name="simple-cpu-offload-pin", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the background work (the pin, or a release after it); True
        once it has finished."""
        if self._thread is None:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def release(self) -> None:
        """Unregister this worker's CPU KV cache and return its pages, once; the
        scheduler asks after another rank's pin failed. Never blocks the caller:
        a running pin stops at its next chunk and releases; a finished one is
        released by a new daemon thread (unregistering runs for seconds at
        hundreds of GB)."""
        with self._lock:
            if self._release_requested:
                return
            self._release_requested = True
            if not self._finished:
                return
            unpin = threading.Thread(
                target=self._free, name="simple-cpu-offload-unpin", daemon=True
            )
            self._thread = unpin
        unpin.start()

    def take_report(self) -> tuple[frozenset[int], frozenset[int]]:
        """(ready ranks, failed ranks) to report: this rank once, when known."""
        if self._reported or not (self.ready.is_set() or self.failed):
            return frozenset(), frozenset()
        self._reported = True
        mine = frozenset((self.rank,))
        return (frozenset(), mine) if self.failed else (mine, frozenset())

    def _run(self) -> None:
        assert self._init_backend is not None and self._device is not None
        progress = PinProgress(sum(t.nbytes for t in self._tensors))
        try:
            # Without cudaHostRegisterPortable, memory is pinned for the current
            # device's context only, and a new thread starts on device 0.
            current_platform.set_device(self._device)
            for tensor in self._tensors:
                for address, nbytes in pin_chunks(tensor, self.CHUNK_BYTES):
                    if self._release_requested:
                        break
                    # Stock allocates with torch.zeros; zeroing chunk by chunk keeps
                    # page faults off the calling thread. Both release the GIL.
                    offset = address - tensor.data_ptr()
                    tensor.view(-1).view(torch.uint8)[offset : offset + nbytes].zero_()
                    host_register(address, nbytes)
                    self._registered.append(address)
                    progress.advance(nbytes)
            if not self._release_requested:
                self._init_backend()
        except Exception:
            self.failed = True
            logger.exception(
                "SimpleCPUOffloadWorker (rank %d): registering the CPU KV cache in "
                "the background failed after %.1f of %.1f GB. CPU offload stays off "
                "on every rank; requests are served from the GPU KV cache only.",
                self.rank,
                progress.done_bytes / 1e9,
                progress.total_bytes / 1e9,
            )
        with self._lock:
            self._finished = True
            stop = self.failed or self._release_requested
            # Counted here: once _finished is set, release() may empty the list.
            chunks = len(self._registered)
        if stop:
            self._free()
            return
        self.ready.set()
        logger.info(
            "SimpleCPUOffloadWorker (rank %d): CPU KV cache (%.1f GB) pinned in %d "
            "chunks in %.1f s; CPU offload starts once all workers are ready.",
            self.rank,
            progress.total_bytes / 1e9,
            chunks,
            time.monotonic() - progress.started,
        )

    def _free(self) -> None:
        """Unregister what this worker registered and return the tier's pages;
        keep going past errors. Idempotent: a second call finds nothing."""
        with self._lock:
            registered, self._registered = self._registered, []
            tensors, self._tensors = self._tensors, []
        for address in registered:
            try:
                host_unregister(address)
            except RuntimeError as exc:
                logger.warning("SimpleCPUOffloadWorker: %s", exc)
        for tensor in tensors:
            try:
                release_host_pages(tensor.data_ptr(), tensor.nbytes)
            except OSError as exc:
                logger.warning("SimpleCPUOffloadWorker: %s", exc)
        if tensors:
            logger.info(
                "SimpleCPUOffloadWorker (rank %d): CPU KV cache unregistered "
                "(%d chunks) and %.1f GB returned to the OS; CPU offload is off.",
                self.rank,
                len(registered),
                sum(t.nbytes for t in tensors) / 1e9,
            )


@amend("F4", ">=0.19.0")
class SimpleCPUOffloadWorker:
    """Members shared by every release; the redirect markers, which name the
    upstream method that allocates and pins, sit in the partial classes below."""

    @call_at_end_of("__init__")
    def _init_async_register(self) -> None:
        """Set up background registration if ``async_register_cache`` is on."""
        self._cache_registration: AsyncCacheRegistration | None = None
        if get_async_register_cache(self.vllm_config):
            self._cache_registration = AsyncCacheRegistration(
                rank=self.vllm_config.parallel_config.rank
            )

    def start_async_register_cache(self) -> None:
        """Start pinning the CPU KV cache, if it was deferred; the GPU worker calls
        this once it finished warm-up and CUDA-graph capture."""
        if self._cache_registration is not None:
            self._cache_registration.start()

    @call_at_end_of("bind_connector_metadata")
    def _release_cpu_cache_if_asked(self, metadata: SimpleCPUOffloadMetadata) -> None:
        """The scheduler's order after a rank's pin failed: unregister and free."""
        if metadata.release_cpu_cache and self._cache_registration is not None:
            self._cache_registration.release()

    def _allocate_cpu_tensor(self, *args, **kwargs) -> torch.Tensor:
        """Upstream's ``torch.zeros`` of a CPU KV tensor; deferred, ``torch.empty``
        (virtual memory only: microseconds at any size; zeroed when pinned)."""
        if self._cache_registration is None:
            return torch.zeros(*args, **kwargs)
        return torch.empty(*args, **kwargs)

    def _pin_cpu_tensor(self, tensor: torch.Tensor) -> None:
        """Upstream's ``pin_tensor``; deferred, pinned in chunks after capture."""
        if self._cache_registration is None:
            pin_tensor(tensor)
        else:
            self._cache_registration.defer_pin(tensor)

    def _init_copy_backend(
        self,
        gpu_caches: dict[str, torch.Tensor],
        cpu_caches: dict[str, torch.Tensor],
        device: torch.device,
        load_stream: torch.cuda.Stream,
        store_stream: torch.cuda.Stream,
    ) -> None:
        """Upstream's ``self._backend.init``; deferred, it runs after the pin (it
        resolves cuMemcpyBatchAsync and starts a thread that sets the device)."""
        assert self._backend is not None
        init = partial(
            self._backend.init,
            gpu_caches,
            cpu_caches,
            device,
            load_stream,
            store_stream,
        )
        if self._cache_registration is None:
            init()
        else:
            self._cache_registration.defer_backend_init(init, device)

    @filter_result_of("build_connector_worker_meta")
    def _add_registration_report(
        self, meta: SimpleCPUOffloadWorkerMetadata | None
    ) -> SimpleCPUOffloadWorkerMetadata | None:
        """With ``async_register_cache``, the first step after the background pin
        ended also reports this rank as ready or failed."""
        if self._cache_registration is None:
            return meta
        ready, failed = self._cache_registration.take_report()
        if not ready and not failed:
            return meta
        if meta is None:
            meta = SimpleCPUOffloadWorkerMetadata(completed_store_events={})
        meta.ready_ranks, meta.failed_ranks = ready, failed
        return meta


@amend("F4", ">=0.19.0,<0.28.0")
class SimpleCPUOffloadWorker:
    @redirect_call_in("register_kv_caches", "torch.zeros")
    def _cpu_zeros(self, *args, **kwargs) -> torch.Tensor:
        return self._allocate_cpu_tensor(*args, **kwargs)

    @redirect_call_in("register_kv_caches", "pin_tensor")
    def _cpu_pin(self, tensor: torch.Tensor) -> None:
        self._pin_cpu_tensor(tensor)

    @redirect_call_in("register_kv_caches", "self._backend.init")
    def _cpu_backend_init(self, *args) -> None:
        self._init_copy_backend(*args)


@amend("F4", ">=0.28.0")
class SimpleCPUOffloadWorker:
    @redirect_call_in("_init_cpu_mode", "torch.zeros")
    def _cpu_zeros(self, *args, **kwargs) -> torch.Tensor:
        return self._allocate_cpu_tensor(*args, **kwargs)

    @redirect_call_in("_init_cpu_mode", "pin_tensor")
    def _cpu_pin(self, tensor: torch.Tensor) -> None:
        self._pin_cpu_tensor(tensor)

    @redirect_call_in("_init_cpu_mode", "self._backend.init")
    def _cpu_backend_init(self, *args) -> None:
        self._init_copy_backend(*args)


@amend("F22", ">=0.19.0")
class SimpleCPUOffloadWorker:
    @redirect_call_in("get_finished", "self._backend.launch_copy")
    def _launch_copy_after_compute(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        is_store: bool,
        event_idx: int,
        events_list: list[tuple[int, torch.Event]],
    ) -> None:
        """Upstream's launch; a store (GPU->CPU) is queued only after the store
        stream waits for the work issued so far to the compute stream, whose forward
        writes the blocks it reads (vllm#45704). Loads read host memory: no wait."""
        if is_store:
            assert self.store_stream is not None
            self.store_stream.wait_stream(torch.cuda.current_stream())
        self._backend.launch_copy(
            src_blocks,
            dst_blocks,
            is_store=is_store,
            event_idx=event_idx,
            events_list=events_list,
        )
