"""F4 on a real CUDA machine (torch only, no vLLM): does a background
cudaHostRegister break CUDA-graph capture, and what does it cost the main thread?

The main thread does what a vLLM worker does at startup and while serving: it
captures CUDA graphs with torch.cuda.graph (torch's default capture_error_mode
"global", as vLLM) and runs small timed kernels. A background thread pins N GiB of
host memory:

- ``before``  (F4 until this change, and upstream's reverted PR 45850): the pin
  thread starts before capture, one cudaHostRegister for the whole tensor;
- ``before-chunks``: the pin thread starts before capture, in chunks of --chunk-gib:
  cudaHostRegister calls that begin while a capture is open (a single call that
  enters the driver before the first capture begins cannot show the race);
- ``after``   (F4 now): capture first, then the pin thread, in row-aligned chunks of
  --chunk-gib (2 GiB, F4's AsyncCacheRegistration.CHUNK_BYTES);
- ``after-whole``: capture first, then one cudaHostRegister for the whole tensor
  (one big registration vs chunks, for the driver-lock stall).

Per scenario and size it reports: whether every capture succeeded (and replays),
the error codes cudaHostRegister returned (900 = cudaErrorStreamCaptureUnsupported,
2 = cudaErrorMemoryAllocation), the pin's total and longest single call, and the
main thread's kernel latency (launch + synchronize of a tiny kernel) p50/p99 while
the pin runs, next to the same without a pin. Each scenario runs in its own child
process, so a broken capture or a sticky CUDA error cannot spoil the next one.

Usage:
  python benchmarks/gpu_f4_pin_during_capture.py [--sizes-gib 16,64] [--chunk-gib 2]
      [--graphs 40] [--scenarios before,after,after-whole]
  python benchmarks/gpu_f4_pin_during_capture.py --dry-run   # no GPU: plan only
Sizes above 80 % of the host's available memory are skipped (said so in the table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

SCENARIOS = ("before", "before-chunks", "after", "after-whole")
GIB = 1 << 30


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _chunks(nbytes: int, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) ranges: whole rows, at most ``chunk_bytes`` (one row at least)."""
    rows = nbytes // row_bytes
    per = max(1, chunk_bytes // row_bytes)
    return [(r * row_bytes, min(per, rows - r) * row_bytes) for r in range(0, rows, per)]


class Pinner(threading.Thread):
    """Zeroes and pins ``tensor`` in ``ranges``; records each call's code and time."""

    def __init__(self, tensor, ranges, device) -> None:
        super().__init__(daemon=True, name="pin")
        self.tensor, self.ranges, self.device = tensor, ranges, device
        self.codes: list[int] = []
        self.call_s: list[float] = []
        self.registered: list[int] = []
        self.started_at = self.ended_at = 0.0

    def run(self) -> None:
        import torch

        cudart = torch.cuda.cudart()
        torch.cuda.set_device(self.device)
        base = self.tensor.data_ptr()
        self.started_at = time.perf_counter()
        for offset, length in self.ranges:
            self.tensor[offset : offset + length].zero_()
            started = time.perf_counter()
            code = cudart.cudaHostRegister(base + offset, length, 0).value
            self.call_s.append(time.perf_counter() - started)
            self.codes.append(code)
            if code != 0:
                break
            self.registered.append(base + offset)
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


def _latencies(stop: threading.Event | None, seconds: float) -> list[float]:
    """Tiny-kernel latencies (launch + synchronize), until ``stop`` or ``seconds``."""
    import torch

    x = torch.zeros(1024, device="cuda")
    out: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
        started = time.perf_counter()
        x.add_(1)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - started)
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def child(scenario: str, gib: int, chunk_gib: int, graphs: int, row_mib: int) -> dict:
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    baseline = _latencies(None, 2.0)
    nbytes = gib * GIB
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    whole = scenario in ("before", "after-whole")
    ranges = [(0, nbytes)] if whole else _chunks(nbytes, row_mib << 20, chunk_gib * GIB)
    pinner = Pinner(tensor, ranges, device)
    done = threading.Event()
    result: dict = {"scenario": scenario, "gib": gib, "calls": len(ranges)}
    if scenario.startswith("before"):
        pinner.start()
        result |= _capture(graphs, pinner)
    else:
        result |= _capture(graphs)
        pinner.start()
    watcher = threading.Thread(target=lambda: (pinner.join(), done.set()), daemon=True)
    watcher.start()
    during = _latencies(done, 3600.0)
    pinner.join()
    pinner.unregister()
    result |= {
        "pin_codes": sorted(set(pinner.codes)),
        "pin_s": pinner.ended_at - pinner.started_at,
        "longest_call_s": max(pinner.call_s, default=0.0),
        "base_p50_us": _pct(baseline, 0.5) * 1e6,
        "base_p99_us": _pct(baseline, 0.99) * 1e6,
        "pin_p50_us": _pct(during, 0.5) * 1e6,
        "pin_p99_us": _pct(during, 0.99) * 1e6,
        "pin_max_ms": max(during, default=float("nan")) * 1e3,
        "samples": len(during),
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", default="16,64")
    parser.add_argument("--chunk-gib", type=int, default=2)
    parser.add_argument("--row-mib", type=int, default=2, help="bytes per block row")
    parser.add_argument("--graphs", type=int, default=40)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--dry-run", "--cpu", action="store_true",
                        help="no GPU: print the plan (sizes, scenarios, chunks) only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_gib.split(",")]
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")

    if args.child:
        scenario, gib = args.child.split(":")
        print(json.dumps(child(scenario, int(gib), args.chunk_gib, args.graphs,
                               args.row_mib)))
        return 0

    available = _available_bytes()
    if args.dry_run:
        for gib in sizes:
            calls = len(_chunks(gib * GIB, args.row_mib << 20, args.chunk_gib * GIB))
            fits = gib * GIB <= 0.8 * available
            print(f"{gib} GiB: scenarios {scenarios}; chunked = {calls} calls of <= "
                  f"{args.chunk_gib} GiB; {'fits' if fits else 'skipped'} here "
                  f"({available / GIB:.0f} GiB available)")
        return 0

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)")
        return 2
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"host memory available: {available / GIB:.0f} GiB")
    print("\n| size | scenario | calls | graphs ok | capture errors | pin codes | pin s "
          "| longest call s | p50/p99 us idle | p50/p99 us during pin | max ms |")
    print("|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for gib in sizes:
        if gib * GIB > 0.8 * available:
            print(f"| {gib} GiB | skipped: more than 80 % of available host memory |")
            continue
        for scenario in scenarios:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", f"{scenario}:{gib}",
                 "--chunk-gib", str(args.chunk_gib), "--graphs", str(args.graphs),
                 "--row-mib", str(args.row_mib)],
                capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                print(f"| {gib} GiB | {scenario} | child failed (rc {proc.returncode}): "
                      f"{tail} |", flush=True)
                continue
            r = json.loads(lines[-1])
            errors = "; ".join(r["capture_errors"]) or "none"
            print(f"| {gib} GiB | {scenario} | {r['calls']} | {r['captured']}/{r['graphs']} "
                  f"| {errors} | {r['pin_codes']} | {r['pin_s']:.2f} | "
                  f"{r['longest_call_s']:.2f} | {r['base_p50_us']:.0f}/{r['base_p99_us']:.0f} "
                  f"| {r['pin_p50_us']:.0f}/{r['pin_p99_us']:.0f} | {r['pin_max_ms']:.1f} |",
                  flush=True)
    print("\nmedian is not averaged across runs; rerun for spread. 900 = "
          "cudaErrorStreamCaptureUnsupported, 2 = cudaErrorMemoryAllocation.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
