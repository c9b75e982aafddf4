"""The parts of benchmarks/gpu_f4_pin_during_capture.py that need no GPU: the chunk
plan, latency statistics, the stall share, the pacing schedule, the split of a
zero-fill over threads and the host allocation with huge pages. Standard library
only, so tests/tool/test_pin_window.py runs them on CPU.

Terms, used the same way in the harness and in its JSON records:

- A *sample* is one CUDA wait of the serving thread: ``(start_s, duration_s)`` of
  launching a tiny kernel and synchronizing on it.
- The *pin window* is ``[start, end]`` of the background thread's whole pin (zero
  fill, cudaHostRegister calls and, when paced, the sleeps between them).
- A sample is *stalled* when it lasts more than ``k`` times the median of the same
  samples taken before the pin (idle p50). The *stall share* is the stalled samples'
  time inside the window divided by the window's length: the fraction of the pin
  window the serving thread spent waiting on the driver instead of working.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
HUGE_PAGE = 2 << 20  # x86-64's huge page (Hugepagesize in /proc/meminfo)
# Python's mmap module exposes MAP_HUGETLB only on some builds; the Linux value.
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)

# k of the stall rule. An idle tiny kernel takes tens of microseconds and its tail
# stays within a few times its median; one cudaHostRegister call holds the driver's
# locks for tens of milliseconds per GiB (H100, 2026-11-24: 0.12-0.17 s per 2 GiB),
# thousands of times the idle median. Any k between those separates the two; 10
# sits well above the idle tail, and every record reports the share the same rule
# finds in the idle samples (``idle_stall_share``, which must stay near 0) to check it.
STALL_K = 10.0

# Default bound of the paced variant: the serving thread spends at most a quarter of
# the pin window stalled, so it keeps at least three quarters of its CUDA time while
# the tier pins, and the pin lasts at most 4 times as long as unpaced (64 GiB in 2 GiB
# calls: about 8 s -> at most about 32 s on the H100). Pacing cannot shorten a single
# stall (that is the chunk size's job); it bounds how much of the window they fill.
PACE_SHARE = 0.25


def chunk_plan(nbytes: int, row_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) ranges covering the whole rows of ``nbytes``: each at most
    ``chunk_bytes`` and a whole number of rows (one row at least), as F4's pin_chunks."""
    rows = nbytes // row_bytes
    per = max(1, chunk_bytes // row_bytes)
    return [(r * row_bytes, min(per, rows - r) * row_bytes) for r in range(0, rows, per)]


def split_range(offset: int, length: int, parts: int, align: int) -> list[tuple[int, int]]:
    """``[offset, offset + length)`` in at most ``parts`` contiguous ranges whose inner
    boundaries fall on multiples of ``align`` (a page, so no two threads fault the
    same page in); together exactly the input range."""
    if length <= 0:
        return []
    step = -(-length // max(1, parts))
    step = -(-step // align) * align
    return [(o, min(step, offset + length - o)) for o in range(offset, offset + length, step)]


def run_parallel(ranges: Sequence[tuple[int, int]], work: Callable[[int, int], None]) -> None:
    """Run ``work(offset, length)`` for every range, one thread each (the caller's
    thread takes the first); re-raise the first failure."""
    failures: list[BaseException] = []

    def guarded(offset: int, length: int) -> None:
        try:
            work(offset, length)
        except BaseException as exc:  # noqa: BLE001 (re-raised below, on the caller's thread)
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=r, daemon=True) for r in ranges[1:]]
    for thread in threads:
        thread.start()
    if ranges:
        guarded(*ranges[0])
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def percentiles(values: Sequence[float]) -> dict[str, float | int]:
    """p50, p90, p99 and max of ``values`` (nearest rank), and their count n."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan"), "max": float("nan")}

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99),
            "max": ordered[-1]}


def stall_share(samples: Sequence[tuple[float, float]], window: tuple[float, float],
                threshold_s: float) -> float:
    """The fraction of ``window`` covered by samples longer than ``threshold_s``
    (each clipped to the window). 0.0 for an empty window."""
    start, end = window
    if end <= start:
        return 0.0
    stalled = 0.0
    for begun, duration in samples:
        if duration > threshold_s:
            stalled += max(0.0, min(end, begun + duration) - max(start, begun))
    return stalled / (end - start)


class Pacer:
    """Keeps the pin's register calls to at most ``bound`` of the time since start().

    After each call of ``call_s`` seconds, sleeps until the calls' total is at most
    ``bound`` of the elapsed time (``busy / elapsed <= bound``): a running budget, so
    a short call earns no sleep it does not need and a long one is paid back in
    full. The serving thread is stalled only while a call holds the driver's locks,
    so its stall share over the window stays under ``bound`` too (up to the one call
    in progress). ``bound`` >= 1 never sleeps.
    """

    def __init__(self, bound: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if bound <= 0:
            raise ValueError(f"pace bound must be > 0, got {bound}")
        self.bound = bound
        self._clock, self._sleep = clock, sleep
        self.busy_s = self.slept_s = 0.0
        self.started = clock()

    def start(self) -> None:
        self.started = self._clock()
        self.busy_s = self.slept_s = 0.0

    def after_call(self, call_s: float) -> float:
        """Account one call; sleep as long as the bound needs; return that sleep."""
        self.busy_s += call_s
        owed = self.busy_s / self.bound - (self._clock() - self.started)
        if self.bound >= 1 or owed <= 0:
            return 0.0
        self._sleep(owed)
        self.slept_s += owed
        return owed


def meminfo_bytes(text: str, key: str) -> int:
    """A ``/proc/meminfo`` field in bytes (its kB unit, or a bare count times 1)."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == key:
            fields = rest.split()
            return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return 0


def thp_mode(text: str) -> str:
    """The selected value of a transparent_hugepage setting (``always [madvise]
    never`` -> ``madvise``); "" when none is marked."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return ""


@dataclass
class HostAllocation:
    """Anonymous host memory for the tier, and which huge pages it asked for.

    ``used``: "hugetlb" (MAP_HUGETLB from the reserved pool), "thp"
    (madvise(MADV_HUGEPAGE), before anything touched the pages) or "none" (4 KiB
    pages); ``why`` says why a requested kind was not used.
    """

    buffer: mmap.mmap
    nbytes: int
    used: str
    why: str


class HostAllocator:
    """Allocates the tier as requested, falling back loudly (``why``) when the
    machine cannot: "hugetlb" needs enough free reserved huge pages
    (HugePages_Free x Hugepagesize), "thp" needs transparent_hugepage/enabled other
    than "never". "auto" tries hugetlb, then thp, then none."""

    MODES = ("none", "thp", "hugetlb", "auto")

    def __init__(self, sys_root: Path = Path("/")) -> None:
        self.sys_root = sys_root

    def _read(self, relative: str) -> str:
        try:
            return (self.sys_root / relative).read_text()
        except OSError:
            return ""

    def hugetlb_free_bytes(self) -> int:
        text = self._read("proc/meminfo")
        return meminfo_bytes(text, "HugePages_Free") * meminfo_bytes(text, "Hugepagesize")

    def thp_enabled(self) -> str:
        return thp_mode(self._read("sys/kernel/mm/transparent_hugepage/enabled"))

    def anon_huge_bytes(self) -> int:
        """AnonHugePages: the transparent huge pages in use machine-wide."""
        return meminfo_bytes(self._read("proc/meminfo"), "AnonHugePages")

    def allocate(self, nbytes: int, mode: str) -> HostAllocation:
        if mode not in self.MODES:
            raise ValueError(f"unknown huge-page mode {mode!r}; choose from {self.MODES}")
        why: list[str] = []
        if mode in ("hugetlb", "auto"):
            free = self.hugetlb_free_bytes()
            size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
            if free >= size:
                try:
                    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE
                                       | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
                    return HostAllocation(buffer, nbytes, "hugetlb", "")
                except OSError as exc:
                    why.append(f"hugetlb: mmap failed ({exc})")
            else:
                why.append(f"hugetlb: {free} bytes of reserved huge pages free, "
                           f"{size} needed (vm.nr_hugepages)")
        buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if mode in ("thp", "auto") or (mode == "hugetlb" and why):
            enabled = self.thp_enabled()
            if enabled in ("always", "madvise"):
                try:
                    buffer.madvise(mmap.MADV_HUGEPAGE)
                    return HostAllocation(buffer, nbytes, "thp", "; ".join(why))
                except (OSError, AttributeError) as exc:
                    why.append(f"thp: madvise(MADV_HUGEPAGE) failed ({exc})")
            else:
                why.append(f"thp: transparent_hugepage/enabled is {enabled or 'absent'}")
        return HostAllocation(buffer, nbytes, "none", "; ".join(why))
