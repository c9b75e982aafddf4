"""Search seeds of the generated NIXL pairs (tests/e2e/generated.py) for invariant violations.

Runs seeds ``--start S`` on (``--seeds N`` of them, or as many as ``--for-minutes M``
allow), each one real pair in the engine venv of ``--release`` (as tools/engine_lane.py
runs the lane), fixed unless ``--mode stock`` (stock breaks the invariants the fixes keep:
that shows they can fail). Writes every failing seed, its drawn parameters and the
invariants it broke to ``--out`` (JSON) and prints the command that reruns it.

Usage: python tools/scenario_search.py [--start S] [--seeds N | --for-minutes M]
                                       [--mode fixed|stock] [--release vX.Y.Z] [--out FILE]
Exit code 0 only if no seed broke an invariant (or broke down).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The e2e harness, its scenarios and the probe (whose stall key the scenarios send).
E2E = [str(REPO / "tests" / "e2e"), str(REPO / "tests" / "e2e" / "engine_plugins")]


def measure(seed: int, mode: str) -> dict:
    """One seed's run, in the engine venv: its parameters, violations and seconds."""
    sys.path[:0] = E2E
    from generated import draw, violations
    from harness import release, run_scenario

    params = draw(seed, release())
    try:
        record = run_scenario("generated", mode, params, label=f"search-{seed}")
    except RuntimeError as error:  # broke down every attempt, or the scenario failed
        return {"seed": seed, "mode": mode, "params": params, "error": str(error)}
    return {"seed": seed, "mode": mode, "params": params, "violations": violations(record),
            "seconds": record["seconds"], "run_dir": record["run_dir"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=0)
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--seeds", type=int, default=1)
    runs.add_argument("--for-minutes", type=float)
    parser.add_argument("--mode", choices=("fixed", "stock"), default="fixed")
    parser.add_argument("--release", default="v0.32.0")
    parser.add_argument("--out", type=Path, default=Path("scenario_search.json"))
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child, in the engine venv: seed --start
        print(json.dumps(measure(args.start, args.mode)))
        return 0
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]
    import engine_lane

    from vllm_patches._catalog import releases as _releases

    sys.path[:0] = E2E
    from generated import rerun_command

    release = _releases.parse_release(args.release)
    deadline = time.monotonic() + 60 * args.for_minutes if args.for_minutes else None
    failing, seed = [], args.start
    while (seed < args.start + args.seeds) if deadline is None else time.monotonic() < deadline:
        result = engine_lane.measure_in_engine_venv(
            release, Path(__file__), ["--start", str(seed), "--mode", args.mode])
        broken = result.get("violations") or result.get("error")
        print(f"seed {seed} ({args.mode}, {result.get('seconds', '-')} s): "
              + ("; ".join(result["violations"]) if result.get("violations")
                 else result.get("error", "every invariant kept")), flush=True)
        if broken:
            failing.append(result)
            args.out.write_text(json.dumps(failing, indent=1))
            print(f"  rerun: {rerun_command(seed, str(release), args.mode)}", flush=True)
        seed += 1
    print(f"{seed - args.start} seeds from {args.start}, {args.mode}: {len(failing)} failing"
          + (f" (written to {args.out})" if failing else ""))
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
