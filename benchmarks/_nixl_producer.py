"""Shared by the F2/F3/F17 benchmarks: run a measurement against stock and patched trees.

A measurement runs in a subprocess whose PYTHONPATH holds one vLLM release tree
(CPU, offline, like tools/lanes.py). Inside it, ``producer()`` builds a real NIXL
producer worker through the fix tests' harness
``tests/v1/kv_connector/unit/nixl_harness.py`` (gloo world of size 1, fake NIXL
agent, fake clock), loaded from this repository against the tree's own
``tests/v1/kv_connector/unit/utils.py``.

Trees: ``--stock PATH --patched PATH`` (two checkouts of one release, the second
with the series applied), or ``--release vX.Y.Z`` to build both like a lane
(needs the fixes in series.toml and the lane venv; see tools/lanes.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests/v1/kv_connector/unit/nixl_harness.py"
HARNESS_MODULE = "tests.v1.kv_connector.unit.nixl_harness"
_WORLD: list = []


def producer(**extra_config):
    """A producer worker (test harness ``Producer``) of the vLLM on sys.path."""
    import logging

    import pytest

    # The benchmarks drop and evict notifications by the thousand: keep quiet.
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    spec = importlib.util.spec_from_file_location(HARNESS_MODULE, HARNESS)
    harness = importlib.util.module_from_spec(spec)
    sys.modules[HARNESS_MODULE] = harness
    spec.loader.exec_module(harness)
    monkeypatch = pytest.MonkeyPatch()
    _allow_block_size_16_on_cpu(monkeypatch)
    # Left open (a module-level reference keeps it alive): the process ends
    # after measuring.
    _WORLD.append(harness.gloo_world())
    _WORLD[-1].__enter__()
    factory = harness.producer_factory(monkeypatch)
    return next(factory)(**extra_config)


def _allow_block_size_16_on_cpu(monkeypatch) -> None:
    """What tests/v1/kv_connector/unit/conftest.py does from v0.30: the CPU
    attention backend declares MultipleOf(32) kernel blocks, the harness uses 16."""
    try:
        from vllm.v1.attention.backend import MultipleOf
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return
    if hasattr(CPUAttentionBackend, "get_supported_kernel_block_sizes"):
        monkeypatch.setattr(
            CPUAttentionBackend,
            "get_supported_kernel_block_sizes",
            staticmethod(lambda kv_cache_spec=None: [MultipleOf(16)]),
        )


def release_of(tree: Path) -> str:
    sys.path.insert(0, str(REPO))
    from vllm_patches._catalog import releases as _releases

    return str(_releases.detect_release(tree))


def child_env(tree: Path, dist_root: Path, hash_seed: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONHASHSEED": str(hash_seed),
        "PYTHONPATH": f"{tree}{os.pathsep}{dist_root}",
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(REPO / "tools" / "hf_home"),
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_PATCHES_DISABLE": "1",
    }


def trees_from_args(args: argparse.Namespace) -> tuple[str, dict[str, Path], str]:
    """(python, {"stock": tree, "patched": tree}, release)."""
    if args.stock and args.patched:
        trees = {"stock": Path(args.stock).resolve(), "patched": Path(args.patched).resolve()}
        return sys.executable, trees, release_of(trees["stock"])
    from _trees import stock_and_patched

    bench = stock_and_patched(args.release)
    return str(bench.python), bench.trees, bench.release


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stock", help="a stock vLLM release tree")
    parser.add_argument("--patched", help="the same release with the series applied")
    parser.add_argument("--release", default="v0.21.0",
                        help="without --stock/--patched: build both trees like a lane")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: child process


def run_children(script: str, python: str, trees: dict[str, Path], release: str,
                 payload: dict, rounds: int) -> dict[str, list[dict]]:
    """Run ``script --measure payload`` in each tree, alternating, ``rounds`` times.

    The trees of one round share a string hash seed, so their dicts and sets of
    request ids lay out alike (collisions, probe lengths); rounds differ in it.
    """
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as dist_root:
        dist_info = Path(dist_root) / f"vllm-{release}+cpu.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {release}+cpu\n")
        for hash_seed in range(1, rounds + 1):
            for name, tree in trees.items():
                proc = subprocess.run(
                    [python, script, "--measure", json.dumps(payload)],
                    env=child_env(tree, Path(dist_root), hash_seed), cwd=tree,
                    capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
                    raise SystemExit(f"{name}: measurement failed")
                results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def child_main(measure: Callable[[dict], dict], payload: str) -> int:
    print(json.dumps(measure(json.loads(payload))))
    return 0


def compare(script: str, doc: str, measure: Callable[[dict], dict], setting: str,
            timed: str, column: str, cases: dict[int, dict], goal: str = "") -> int:
    """A benchmark's main: per case (``column``'s value: its payload), the median
    microseconds per step on stock and patched, their ratio, and each round's ratio
    (stock and patched ran back to back in it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_tree_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.measure:
        return child_main(measure, args.measure)
    python, trees, release = trees_from_args(args)
    print(f"vLLM v{release}: {setting} x {args.rounds} rounds; median us per step "
          f"({timed})")
    print(f"{column:>6} {'stock':>8} {'patched':>8} {'patched/stock':>13}")
    for value, payload in cases.items():
        results = run_children(script, python, trees, release, payload, args.rounds)
        medians = {name: statistics.median(r["median_ns"] for r in rows)
                   for name, rows in results.items()}
        ratio = medians["patched"] / medians["stock"]
        print(f"{value:>6} {medians['stock'] / 1000:>8.1f} "
              f"{medians['patched'] / 1000:>8.1f} {ratio:>13.3f}")
        rounds = [p["median_ns"] / s["median_ns"]
                  for s, p in zip(results["stock"], results["patched"], strict=True)]
        print(f"{'':>6} rounds: {' '.join(f'{r:.3f}' for r in rounds)}")
    if goal:
        print(goal)
    return 0
