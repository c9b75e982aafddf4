"""The CPU parts of benchmarks/gpu_f4_pin_during_capture.py (benchmarks/_pin_window.py):
chunk plan, statistics, stall share, pacing, the threaded zero-fill split and the
huge-page allocation with its fallbacks. The GPU parts run on a lent GPU machine."""

import itertools
import json
import subprocess
import sys

import pytest

from vllm_patches._catalog import series as _series

sys.path.insert(0, str(_series.REPO_DIR / "benchmarks"))  # benchmarks/ is not a package
import _pin_window as pw

HARNESS = _series.REPO_DIR / "benchmarks" / "gpu_f4_pin_during_capture.py"


def test_chunk_plan_covers_whole_rows_within_the_bound():
    row = 3 << 20
    plan = pw.chunk_plan(10 * row + 5, row, 4 * row + 1)
    assert plan == [(0, 4 * row), (4 * row, 4 * row), (8 * row, 2 * row)]
    assert pw.chunk_plan(2 * row, row, 1) == [(0, row), (row, row)]  # a row at least


@pytest.mark.parametrize("parts", [1, 3, 8, 100])
def test_split_range_is_exact_and_page_aligned(parts):
    offset, length, align = 4096 * 7, 4096 * 50 + 123, 4096
    ranges = pw.split_range(offset, length, parts, align)
    assert len(ranges) <= parts
    assert ranges[0][0] == offset and sum(n for _, n in ranges) == length
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
    assert all((a - offset) % align == 0 for a, _ in ranges)


def test_run_parallel_runs_every_range_and_reraises():
    buffer = bytearray(b"\xff" * 1000)

    def zero(offset, length):
        buffer[offset : offset + length] = bytes(length)

    pw.run_parallel(pw.split_range(0, 1000, 4, 100), zero)
    assert buffer == bytes(1000)

    def fail(offset, length):
        raise RuntimeError(f"range {offset}")

    with pytest.raises(RuntimeError, match="range"):
        pw.run_parallel([(0, 1), (1, 1)], fail)


def test_percentiles_nearest_rank():
    stats = pw.percentiles([float(v) for v in range(1, 101)])
    assert stats == {"n": 100, "p50": 51.0, "p90": 91.0, "p99": 100.0, "max": 100.0}
    assert pw.percentiles([])["n"] == 0


def test_stall_share_counts_long_samples_inside_the_window_only():
    samples = [(0.0, 0.001), (1.0, 0.5), (2.0, 0.001), (9.5, 1.0)]
    # 1.0-1.5 stalled; 9.5-10.5 stalled but the window ends at 10.0.
    assert pw.stall_share(samples, (0.0, 10.0), 0.01) == pytest.approx(0.1)
    assert pw.stall_share(samples, (0.0, 10.0), 1.0) == 0.0  # nothing above threshold
    assert pw.stall_share(samples, (5.0, 5.0), 0.01) == 0.0  # empty window


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


@pytest.mark.parametrize("bound", [0.1, 0.25, 0.5])
def test_pacer_keeps_the_calls_share_under_its_bound(bound):
    clock = FakeClock()
    pacer = pw.Pacer(bound, clock=clock, sleep=clock.sleep)
    pacer.start()
    for call_s in (0.15, 0.12, 0.5, 0.01, 0.2):
        clock.now += 0.05  # the zero-fill before the call stalls nobody
        clock.now += call_s
        pacer.after_call(call_s)
        assert pacer.busy_s / clock.now <= bound + 1e-9
    # And no more sleep than the bound needs: the share ends exactly at the bound.
    assert pacer.busy_s / clock.now == pytest.approx(bound)


def test_pacer_never_sleeps_when_the_fill_already_dilutes_the_calls():
    clock = FakeClock()
    pacer = pw.Pacer(0.5, clock=clock, sleep=clock.sleep)
    pacer.start()
    clock.now += 10.0 + 0.1
    assert pacer.after_call(0.1) == 0.0 and pacer.slept_s == 0.0
    with pytest.raises(ValueError):
        pw.Pacer(0)


def _sys_root(tmp_path, enabled, hugetlb_free_pages):
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal: 1000 kB\nAnonHugePages: 4096 kB\nHugePages_Free: "
        f"{hugetlb_free_pages}\nHugepagesize: 2048 kB\n")
    thp = tmp_path / "sys" / "kernel" / "mm" / "transparent_hugepage"
    thp.mkdir(parents=True, exist_ok=True)
    (thp / "enabled").write_text(enabled)
    return tmp_path


def test_meminfo_and_thp_readers(tmp_path):
    allocator = pw.HostAllocator(_sys_root(tmp_path, "always [madvise] never\n", 3))
    assert allocator.hugetlb_free_bytes() == 3 * (2 << 20)
    assert allocator.thp_enabled() == "madvise"
    assert allocator.anon_huge_bytes() == 4096 * 1024


@pytest.mark.parametrize(
    ("mode", "enabled", "expected", "why"),
    [
        ("none", "always [madvise] never", "none", ""),
        ("thp", "always [madvise] never", "thp", ""),
        ("thp", "always madvise [never]", "none", "transparent_hugepage/enabled is never"),
        # No reserved pool: hugetlb falls back to THP, then to small pages, saying why.
        ("hugetlb", "[always] madvise never", "thp", "reserved huge pages"),
        ("auto", "always madvise [never]", "none", "reserved huge pages"),
    ],
)
def test_allocation_falls_back_and_says_why(tmp_path, mode, expected, why, enabled):
    allocator = pw.HostAllocator(_sys_root(tmp_path, enabled, 0))
    host = allocator.allocate(8 << 20, mode)
    assert host.used == expected and why in host.why
    host.buffer[:4] = b"abcd"  # writable anonymous memory of the size asked for
    assert len(host.buffer) == 8 << 20
    host.buffer.close()


def test_allocation_rejects_an_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="unknown huge-page mode"):
        pw.HostAllocator(tmp_path).allocate(4096, "giant")


def test_dry_run_plans_one_record_per_scenario_and_chunk_without_torch():
    out = subprocess.run(
        [sys.executable, str(HARNESS), "--dry-run", "--sizes-gib", "16,64",
         "--chunk-gib", "1,2", "--scenarios", "after,after-whole",
         "--hugepages", "auto", "--zero-threads", "4", "--pace-share", "0.25"],
        capture_output=True, text=True, check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["size_gib"], r["scenario"], r["chunk_gib"], r["calls"]) for r in records] == [
        (16, "after", 1.0, 16), (16, "after", 2.0, 8), (16, "after-whole", None, 1),
        (64, "after", 1.0, 64), (64, "after", 2.0, 32), (64, "after-whole", None, 1)]
    assert {(r["hugepages"], r["zero_threads"], r["pace_share"]) for r in records} == {
        ("auto", 4, 0.25)}
