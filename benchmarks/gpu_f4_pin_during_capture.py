"""F4 on a real CUDA machine (torch only, no vLLM): does a background
cudaHostRegister break CUDA-graph capture, and what does it cost the serving thread?

The main thread does what a vLLM worker does at startup and while serving: it
captures CUDA graphs with torch.cuda.graph (torch's default capture_error_mode
"global", as vLLM) and runs small timed kernels (the serving thread). A background
thread zeroes and pins N GiB of host memory:

- ``before``  (F4 until this change, and upstream's reverted PR 45850): the pin
  thread starts before capture, one cudaHostRegister for the whole tensor;
- ``before-chunks``: the pin thread starts before capture, in chunks: calls that
  begin while a capture is open (a single call that enters the driver before the
  first capture begins cannot show the race);
- ``after``   (F4 now): capture first, then the pin thread, in row-aligned chunks
  (2 GiB is F4's AsyncCacheRegistration.CHUNK_BYTES);
- ``after-whole``: capture first, then one cudaHostRegister for the whole tensor.

Variants, each a flag, applying to every scenario of the run:
- ``--hugepages none|thp|hugetlb|auto``: back the tier with huge pages, asked for
  before the zero-fill touches it (madvise(MADV_HUGEPAGE), or MAP_HUGETLB from the
  reserved pool); the record says which was used and why not the one asked for;
- ``--zero-threads N``: zero each chunk on N threads instead of one;
- ``--pace-share B``: sleep between register calls so that the calls fill at most B
  of the pin window (benchmarks/_pin_window.Pacer; 0 = unpaced).

One JSON record per scenario, chunk size and tier size on stdout (and appended to
``--out``): capture outcome, cudaHostRegister return codes (900 =
cudaErrorStreamCaptureUnsupported, 2 = cudaErrorMemoryAllocation), the pin's total,
zero-fill, register and sleep times and longest call, the serving thread's latency
p50/p90/p99/max idle and during the pin window, and the stall share (defined in
benchmarks/_pin_window.py: samples longer than --stall-k x idle p50, as a fraction of
the pin window; ``idle_stall_share`` is the same rule on the idle samples; in the
``before*`` scenarios the serving thread samples only once capture ended, so read
the stall share of ``after*``). Each
record runs in its own child process, so a broken capture or a sticky CUDA error
cannot spoil the next one.

Usage:
  python benchmarks/gpu_f4_pin_during_capture.py [--sizes-gib 16,64]
      [--chunk-gib 1,2,4] [--graphs 40] [--scenarios after,after-whole]
      [--hugepages auto] [--zero-threads 8] [--pace-share 0.25] [--out F.jsonl]
  python benchmarks/gpu_f4_pin_during_capture.py --dry-run   # no GPU: plan only
Sizes above 80 % of the host's available memory are skipped (a record says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package
from _pin_window import (
    GIB,
    HUGE_PAGE,
    PACE_SHARE,
    STALL_K,
    HostAllocator,
    Pacer,
    chunk_plan,
    percentiles,
    run_parallel,
    split_range,
    stall_share,
)

SCENARIOS = ("before", "before-chunks", "after", "after-whole")
WHOLE = ("before", "after-whole")


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class Pinner(threading.Thread):
    """Zeroes and pins ``tensor`` in ``ranges``; records each call's code and time."""

    def __init__(self, tensor, ranges, device, zero_threads: int,
                 pacer: Pacer | None) -> None:
        super().__init__(daemon=True, name="pin")
        self.tensor, self.ranges, self.device = tensor, ranges, device
        self.zero_threads, self.pacer = zero_threads, pacer
        self.codes: list[int] = []
        self.call_s: list[float] = []
        self.zero_s = 0.0
        self.registered: list[int] = []
        self.started_at = self.ended_at = 0.0

    def _zero(self, offset: int, length: int) -> None:
        self.tensor[offset : offset + length].zero_()

    def run(self) -> None:
        import torch

        cudart = torch.cuda.cudart()
        torch.cuda.set_device(self.device)
        base = self.tensor.data_ptr()
        self.started_at = time.perf_counter()
        if self.pacer is not None:
            self.pacer.start()
        for offset, length in self.ranges:
            started = time.perf_counter()
            run_parallel(split_range(offset, length, self.zero_threads, HUGE_PAGE),
                         self._zero)
            self.zero_s += time.perf_counter() - started
            started = time.perf_counter()
            code = cudart.cudaHostRegister(base + offset, length, 0).value
            self.call_s.append(time.perf_counter() - started)
            self.codes.append(code)
            if code != 0:
                break
            self.registered.append(base + offset)
            if self.pacer is not None:
                self.pacer.after_call(self.call_s[-1])
        self.ended_at = time.perf_counter()

    def unregister(self) -> None:
        import torch

        for address in self.registered:
            torch.cuda.cudart().cudaHostUnregister(address)


def _capture(num_graphs: int, pinning: Pinner | None = None) -> dict:
    """Capture small graphs (global mode), replay each, check results: ``num_graphs``,
    and with ``pinning`` on until that thread has finished (a vLLM warm-up compiles
    and captures for tens of seconds, so a pin started before it overlaps it)."""
    import torch

    x = torch.randn(1 << 20, device="cuda")
    errors: list[str] = []
    ok = i = 0
    started = time.perf_counter()
    while i < num_graphs or (pinning is not None and pinning.is_alive() and i < 100_000):
        i += 1
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2 + i  # warm-up outside capture, as vLLM's dummy runs
        torch.cuda.current_stream().wait_stream(side)
        try:
            with torch.cuda.graph(graph):
                y = x * 2 + i
            graph.replay()
            torch.cuda.synchronize()
            if torch.allclose(y, x * 2 + i):
                ok += 1
            else:
                errors.append(f"graph {i}: wrong result on replay")
        except Exception as exc:  # noqa: BLE001 (any failure is the outcome under test)
            errors.append(f"graph {i}: {type(exc).__name__}: {str(exc)[:160]}")
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:  # noqa: BLE001 (a sticky error ends the run)
                errors.append(f"sync after graph {i}: {str(sync_exc)[:160]}")
                break
    return {"captured": ok, "graphs": i, "capture_s": time.perf_counter() - started,
            "capture_errors": errors[:5]}


def _samples(stop: threading.Event | None, seconds: float) -> list[tuple[float, float]]:
    """The serving thread: (start, duration) of tiny-kernel launch + synchronize,
    back to back, until ``stop`` or ``seconds``."""
    import torch

    x = torch.zeros(1024, device="cuda")
    out: list[tuple[float, float]] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
        started = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        out.append((started, time.perf_counter() - started))
    return out


def _us(stats: dict) -> dict:
    return {k: (v if k == "n" else v * 1e6) for k, v in stats.items()}


def child(args: argparse.Namespace, scenario: str, gib: int, chunk_gib: float) -> dict:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    idle = _samples(None, 2.0)
    idle_stats = percentiles([d for _, d in idle])
    threshold = args.stall_k * idle_stats["p50"]
    nbytes = gib * GIB
    allocator = HostAllocator()
    thp_before = allocator.anon_huge_bytes()
    host = allocator.allocate(nbytes, args.hugepages)
    tensor = torch.frombuffer(host.buffer, dtype=torch.uint8, count=nbytes)
    ranges = ([(0, nbytes)] if scenario in WHOLE
              else chunk_plan(nbytes, args.row_mib << 20, int(chunk_gib * GIB)))
    pacer = Pacer(args.pace_share) if args.pace_share > 0 else None
    pinner = Pinner(tensor, ranges, device, args.zero_threads, pacer)
    done = threading.Event()
    record: dict = {
        "scenario": scenario, "size_gib": gib,
        "chunk_gib": None if scenario in WHOLE else chunk_gib, "calls": len(ranges),
        "hugepages": args.hugepages, "hugepages_used": host.used,
        "hugepages_why": host.why, "zero_threads": args.zero_threads,
        "torch_threads": torch.get_num_threads(),
        "pace_share": args.pace_share or None, "stall_k": args.stall_k,
    }
    if scenario.startswith("before"):
        pinner.start()
        record |= _capture(args.graphs, pinner)
    else:
        record |= _capture(args.graphs)
        pinner.start()
    watcher = threading.Thread(target=lambda: (pinner.join(), done.set()), daemon=True)
    watcher.start()
    during = _samples(done, 3600.0)
    pinner.join()
    window = (pinner.started_at, pinner.ended_at)
    in_window = [s for s in during if window[0] <= s[0] <= window[1]]
    record |= {
        "thp_bytes_after_fill": allocator.anon_huge_bytes() - thp_before,
        "pin_codes": sorted(set(pinner.codes)),
        "pin_s": pinner.ended_at - pinner.started_at,
        "zero_s": pinner.zero_s,
        "register_s": sum(pinner.call_s),
        "sleep_s": pacer.slept_s if pacer is not None else 0.0,
        "longest_call_s": max(pinner.call_s, default=0.0),
        "idle_us": _us(idle_stats),
        "serving_us": _us(percentiles([d for _, d in in_window])),
        "stall_threshold_us": threshold * 1e6,
        "stall_share": stall_share(during, window, threshold),
        "idle_stall_share": stall_share(idle, (idle[0][0], idle[-1][0] + idle[-1][1]),
                                        threshold) if idle else 0.0,
    }
    pinner.unregister()
    return record


def _context() -> dict:
    """When and on what the records were measured (a figure needs both)."""
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("VLLM_PATCHES_COMMIT", "unknown")
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": commit, "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", default="16,64")
    parser.add_argument("--chunk-gib", default="2",
                        help="chunk sizes to sweep, comma-separated (GiB, may be < 1)")
    parser.add_argument("--row-mib", type=int, default=2, help="bytes per block row")
    parser.add_argument("--graphs", type=int, default=40)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--hugepages", default="none", choices=HostAllocator.MODES)
    parser.add_argument("--zero-threads", type=int, default=1)
    parser.add_argument("--pace-share", type=float, default=0.0,
                        help=f"bound of the register calls' share of the pin window "
                             f"(0 = unpaced; {PACE_SHARE} is the justified default)")
    parser.add_argument("--stall-k", type=float, default=STALL_K)
    parser.add_argument("--out", type=Path, help="also append the records here (JSONL)")
    parser.add_argument("--dry-run", "--cpu", action="store_true",
                        help="no GPU: print the plan's records (sizes, chunks, calls)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_gib.split(",")]
    chunks = [float(c) for c in args.chunk_gib.split(",")]
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    if args.zero_threads < 1 or not 0 <= args.pace_share:
        parser.error("--zero-threads must be >= 1 and --pace-share >= 0")

    if args.child:
        scenario, gib, chunk_gib = args.child.split(":")
        print(json.dumps(child(args, scenario, int(gib), float(chunk_gib))))
        return 0

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(line + "\n")

    available = _available_bytes()
    plan = [(gib, scenario, chunk) for gib in sizes for scenario in scenarios
            for chunk in ([chunks[0]] if scenario in WHOLE else chunks)]
    if args.dry_run:
        for gib, scenario, chunk in plan:
            calls = 1 if scenario in WHOLE else len(
                chunk_plan(gib * GIB, args.row_mib << 20, int(chunk * GIB)))
            emit({"dry_run": True, "scenario": scenario, "size_gib": gib,
                  "chunk_gib": None if scenario in WHOLE else chunk, "calls": calls,
                  "hugepages": args.hugepages, "zero_threads": args.zero_threads,
                  "pace_share": args.pace_share or None,
                  "fits": gib * GIB <= 0.8 * available})
        return 0

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    context = _context()
    passed = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
              ("row_mib", "graphs", "hugepages", "zero_threads", "pace_share", "stall_k")]
    for gib, scenario, chunk in plan:
        base = context | {"scenario": scenario, "size_gib": gib}
        if gib * GIB > 0.8 * available:
            emit(base | {"skipped": "more than 80 % of available host memory"})
            continue
        proc = subprocess.run(
            [sys.executable, __file__, "--child", f"{scenario}:{gib}:{chunk}", *passed],
            capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            emit(base | {"child_failed": proc.returncode, "tail": tail})
            continue
        emit(context | json.loads(lines[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
