"""How fast the command starts, and `apply` against plain `git am` of the same patches.

On a clone of the cached vLLM v0.21.0 (`vllm-patches fetch v0.21.0` first), in rounds:
the wall time of `vllm-patches --help`, `list` and `status CHECKOUT`, and of applying
the release's whole series with `vllm-patches apply CHECKOUT` and with `git am` of the
same patch files, the checkout reset to the release before each (the two alternate, so
machine drift hits both). Prints the median of each and apply/git-am.

Goals: `--help`, `list` and `status` under 0.2 s; `apply` within 3x `git am`.
Run it with the machine otherwise idle, e.g. `flock /tmp/heavy.lock .venv/bin/python
benchmarks/bench_cli_startup.py --rounds 15`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.patchset import PatchSet

RELEASE = _series.Version("0.21.0")
COMMAND = Path(sys.executable).parent / "vllm-patches"


def timed(args: list[str], cwd: Path | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(args, cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def git(checkout: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(checkout), *args], check=True, capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if not COMMAND.exists():
        raise SystemExit(f"{COMMAND}: not found; install the tool into this Python first")
    patches = [str(p.path) for p in PatchSet.load(_series.load(), RELEASE).patches]
    times: dict[str, list[float]] = {name: [] for name in
                                     ("--help", "list", "status", "apply", "git am")}
    with tempfile.TemporaryDirectory() as scratch:
        checkout = Path(scratch) / "vllm"
        subprocess.run(["git", "clone", "--quiet", str(_releases.fetch(RELEASE)), str(checkout)],
                       check=True)
        git(checkout, "config", "user.name", "bench")
        git(checkout, "config", "user.email", "bench@example.invalid")
        base = f"v{RELEASE}"
        for _ in range(args.rounds):
            times["--help"].append(timed([str(COMMAND), "--help"]))
            times["list"].append(timed([str(COMMAND), "list"]))
            times["status"].append(timed([str(COMMAND), "status", str(checkout)]))
            git(checkout, "reset", "--quiet", "--hard", base)
            times["git am"].append(timed(["git", "-C", str(checkout), "am", "--quiet",
                                          "--keep-non-patch", *patches]))
            git(checkout, "reset", "--quiet", "--hard", base)
            times["apply"].append(timed([str(COMMAND), "apply", str(checkout)]))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        spread = f"{min(times[name]):.3f} .. {max(times[name]):.3f}"
        print(f"{name:<8} median {value:.3f} s  ({spread} s, {args.rounds} rounds)")
    print(f"apply / git am: {medians['apply'] / medians['git am']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
