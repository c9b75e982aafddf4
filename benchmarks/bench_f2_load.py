"""F2 under sustained load in a real NIXL prefill/decode pair: stock and fixed in one run.

The real-engine lane's load scenario (``tests/e2e/scenarios.py``, ``nixl_load``,
``LOAD_ARGS``): closed-loop clients, each prefilling a prompt with n siblings on a
producer whose KV pool is bounded (``load_pool_blocks``, chosen so that stock runs out
of pool before the cores) and decoding it on the decoder, then the next prompt. Reports
per mode: prompts per minute, latency (prefill start to the last child decoded) p50/p90,
the producer's KV usage over the window (peak, mean) and after the drain, samples where
prefills waited on a full pool, "Releasing expired KV blocks" and "Potentially invalid KV
blocks" lines, and bytes the decoder READ. With ``--png`` it also plots KV usage over time,
stock against fixed (needs matplotlib: ``pip install -e '.[bench]'``).

Usage:
  .venv/bin/python benchmarks/bench_f2_load.py [--release v0.32.0] [--json F] [--png F]
      runs the scenario stock, then fixed, in the engine lane's venv (needs root, as
      that lane does). (The lane's load test runs fixed only: ``test_f2_load.py``.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "e2e"))  # the harness, its scenarios and analysis
MODES = ("stock", "fixed")


def measure() -> dict:
    """In the engine venv: the scenario stock, then fixed; their records."""
    import harness
    import scenarios

    return {mode: harness.run_scenario("nixl_load", mode, scenarios.LOAD_ARGS,
                                       label="bench-f2-load") for mode in MODES}


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


ROWS = [
    ("clients x n, window", lambda r: f"{r['clients']} x {r['n']}, {r['seconds']} s"),
    ("producer pool (blocks), prompt (tokens)",
     lambda r: f"{r['pool_blocks']}, {r['prompt_tokens']}"),
    ("prompts finished (per minute)", lambda r: f"{r['prompts']} ({r['prompts_per_min']})"),
    ("latency p50 / p90 (s)",
     lambda r: f"{r['latency_p50_s']:.1f} / {r['latency_p90_s']:.1f}"),
    ("producer KV usage: peak / mean / after the drain",
     lambda r: " / ".join(map(_percent, (r["usage_peak"], r["usage_mean"], r["usage_after"])))),
    ("samples with prefills waiting on a full pool",
     lambda r: f"{r['pool_bound_samples']} of {r['samples']}"),
    ('"Releasing expired KV blocks" lines', lambda r: r["expired_lines"]),
    ('"Potentially invalid KV blocks" lines', lambda r: r["invalid_kv_lines"]),
    ("bytes READ by the decoder (READs)",
     lambda r: f"{r['bytes_transferred'] / 2**20:.1f} MiB ({r['transfers']:.0f})"),
]


def table(summaries: dict) -> str:
    lines = ["| | stock | fixed |", "|---|---:|---:|"]
    for title, cell in ROWS:
        lines.append(f"| {title} | {cell(summaries['stock'])} | {cell(summaries['fixed'])} |")
    return "\n".join(lines)


def plot(summaries: dict, release: str, png: Path) -> None:
    """KV usage of the producer over time, stock against fixed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 3.6), dpi=100)
    for mode, colour in zip(MODES, ("tab:red", "tab:blue")):
        timeline = summaries[mode]["usage_timeline"]
        axes.plot([t for t, _ in timeline], [100 * u for _, u in timeline], color=colour,
                  label=f"{mode} ({summaries[mode]['expired_lines']} expired, "
                        f"{summaries[mode]['invalid_kv_lines']} invalid-KV lines)")
    axes.axvline(summaries["stock"]["seconds"], color="grey", linestyle=":", linewidth=1)
    axes.set_xlabel("seconds since the load started (dotted: no new prompts after)")
    axes.set_ylabel("producer KV usage (%)")
    axes.set_ylim(0, 105)
    first = summaries["stock"]
    axes.set_title(f"vLLM v{release}, NIXL P/D pair: {first['clients']} clients, "
                   f"n={first['n']}, pool {first['pool_blocks']} blocks", fontsize=10)
    axes.legend(loc="center right", fontsize=8)
    figure.tight_layout()
    figure.savefig(png)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", default="v0.32.0")
    parser.add_argument("--json", help="also write the summaries here")
    parser.add_argument("--png", help="plot KV usage over time here (needs matplotlib)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child, in the engine venv
        print(json.dumps(measure()))
        return 0
    # The tool's venv: the lane's modules and this package from the repository (the
    # ``--measure`` child uses the engine venv's installed package, as the lane does).
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]
    import analysis
    import engine_lane

    from vllm_patches._catalog import releases as _releases

    release = _releases.parse_release(args.release)
    records = engine_lane.measure_in_engine_venv(release, Path(__file__))
    summaries = {mode: analysis.load_summary(records[mode]) for mode in MODES}
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    print(f"vLLM v{release}; records: " + ", ".join(records[m]["run_dir"] for m in MODES))
    print(table(summaries))
    if args.png:
        plot(summaries, str(release), Path(args.png))
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
