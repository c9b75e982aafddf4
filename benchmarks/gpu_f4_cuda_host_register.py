"""F4 on a real CUDA machine: what cudaHostRegister of the CPU KV tier costs the
calling thread, stock (allocate + zero + pin inline) vs async_register_cache
(allocate inline; zero + pin in a daemon thread, as AsyncCacheRegistration does).

Per size it reports:
- stock: wall time of torch.zeros + pin_tensor on the calling thread (what
  register_kv_caches() spends on the tier today), split into zero and pin;
- async: wall time until the calling thread is free again (torch.empty + thread
  start), and until the background thread has finished (time to ready);
- the calling thread's progress while the background thread pins, as a fraction
  of its progress when idle (1.0 = the pin holds no GIL);
- whether the background-pinned tensor is pinned for this device (is_pinned(),
  and the H2D copy rate from it vs from pageable memory).

pin_tensor is vLLM's (vllm.v1.simple_kv_offload.cuda_mem_ops) when `vllm` is
importable (--tree adds a tree to sys.path), else the identical cudart call.
Needs a CUDA GPU and host RAM for the largest size (sizes run one at a time).

Usage: python benchmarks/gpu_f4_cuda_host_register.py [--sizes-gib 8,16,32,64]
           [--tree PATH]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch


def _pin_tensor_fn(tree: Path | None):
    if tree is not None:
        sys.path.insert(0, str(tree.resolve()))
    try:
        from vllm.v1.simple_kv_offload.cuda_mem_ops import pin_tensor

        return pin_tensor, "vllm.v1.simple_kv_offload.cuda_mem_ops.pin_tensor"
    except Exception as exc:  # noqa: BLE001 - vLLM or one of its dependencies is missing
        def pin_tensor(tensor: torch.Tensor) -> None:
            err = torch.cuda.cudart().cudaHostRegister(
                tensor.data_ptr(), tensor.nbytes, 0)
            if err.value != 0:
                raise RuntimeError(f"cudaHostRegister failed: {err}")

        return pin_tensor, f"local copy of vLLM's pin_tensor ({type(exc).__name__})"


def _unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def _spin(stop: threading.Event) -> int:
    """Pure-Python work on the calling thread: iterations until ``stop``."""
    count = 0
    while not stop.is_set():
        for _ in range(1000):
            count += 1
    return count


def _python_rate(seconds: float = 0.5) -> float:
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    started = time.perf_counter()
    timer.start()
    count = _spin(stop)
    return count / (time.perf_counter() - started)


def _h2d_gbps(src: torch.Tensor, nbytes: int = 1 << 30) -> float:
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    view = src[:nbytes]
    dst.copy_(view, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(view, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - started) / 1e9


def stock(nbytes: int, pin_tensor) -> dict:
    started = time.perf_counter()
    tensor = torch.zeros(nbytes, dtype=torch.uint8, device="cpu")
    zeroed = time.perf_counter()
    pin_tensor(tensor)
    pinned = time.perf_counter()
    result = {"zero_s": zeroed - started, "pin_s": pinned - zeroed,
              "return_s": pinned - started}
    _unpin(tensor)
    return result


def background(nbytes: int, pin_tensor, device: torch.device, idle_rate: float) -> dict:
    done = threading.Event()
    failure: list[BaseException] = []

    def run(tensor: torch.Tensor) -> None:
        try:
            torch.cuda.set_device(device)  # as current_platform.set_device does
            tensor.zero_()
            pin_tensor(tensor)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            failure.append(exc)
        finally:
            done.set()

    started = time.perf_counter()
    tensor = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    thread = threading.Thread(target=run, args=(tensor,), daemon=True)
    thread.start()
    returned = time.perf_counter()
    # Meanwhile the calling thread does Python work, as the engine would.
    spin_started = time.perf_counter()
    count = _spin(done)
    spin_s = time.perf_counter() - spin_started
    thread.join()
    ready = time.perf_counter()
    if failure:
        raise failure[0]
    result = {
        "return_s": returned - started,
        "ready_s": ready - started,
        "progress": (count / spin_s) / idle_rate if spin_s > 0 else float("nan"),
        "is_pinned": tensor.is_pinned(),
        "h2d_gbps": _h2d_gbps(tensor),
    }
    _unpin(tensor)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", default="8,16,32,64")
    parser.add_argument("--tree", type=Path, help="vLLM tree for vLLM's pin_tensor")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    pin_tensor, source = _pin_tensor_fn(args.tree)
    print(f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; "
          f"pin_tensor: {source}")
    pageable = torch.ones(1 << 30, dtype=torch.uint8)
    print(f"H2D from pageable memory: {_h2d_gbps(pageable):.1f} GB/s")
    del pageable
    idle_rate = _python_rate()

    print("\n| size | stock: zero | stock: pin | stock: return | async: return "
          "| async: ready | calling-thread progress | pinned | H2D from it |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|---:|")
    for gib in (int(s) for s in args.sizes_gib.split(",")):
        nbytes = gib << 30
        s = stock(nbytes, pin_tensor)
        a = background(nbytes, pin_tensor, device, idle_rate)
        print(f"| {gib} GiB | {s['zero_s']:.2f} s | {s['pin_s']:.2f} s | "
              f"{s['return_s']:.2f} s | {a['return_s'] * 1e3:.2f} ms | "
              f"{a['ready_s']:.2f} s | {a['progress']:.2f} | {a['is_pinned']} | "
              f"{a['h2d_gbps']:.1f} GB/s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
