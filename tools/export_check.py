"""Check what `vllm-patches export` gives a contributor, the way upstream would take it.

For each fix, on the newest lane that needs it (F1: v0.23.0; F2, F3, F4: v0.33.0), or on
the lanes given with --release:
  1. ``vllm-patches export FIX --onto`` a fresh clone of the release, as a contributor
     does (an identity of its own: export refuses without one);
  2. the exported tests still prove the fix: the fix's ``stock_fails``, taken from the
     exported commits and copied into a fresh stock clone, fail there; the fix's own
     tests pass on the exported tree (the lane venv of tools/lanes.py). Those of the
     fixes it requires pass on their own exports, and with every fix in the lanes: run
     on every export that carries them too, they took three times the test files
     (67 against 23, 2026-11-29) for CI's budget;
  3. upstream's pre-commit, as the release's config pins it (tools/precommit.py), passes
     on every file the series changes: the fixes' sources and their tests.

The exports, their test runs and their hook runs of every release go ``--jobs`` at a time
(default: one per CPU core).

Usage: python tools/export_check.py [--release vX.Y.Z ...] [--fix F2 ...] [--hooks-only]
                                    [--jobs N]
To check your edits of a fix's tests against upstream's hooks, run it with --fix and
--hooks-only (a minute once pre-commit's environments are cached).
Exit code 0 only if every export met every expectation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
import lanes
import precommit

from vllm_patches import _git
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._commands import export as _export
from vllm_patches._plural import count

# export signs the patches off with the git identity it finds; CI has none of its own.
IDENTITY = _git.Identity("vllm-patches export check",
                         "export-check@vllm-patches.invalid").env()


def export_onto(release: Version, fix: _series.Fix, target: Path) -> tuple[Path, str]:
    """A fresh clone of ``release`` with ``fix``'s exported series applied; its base."""
    tree = lanes.fresh_clone(_releases.fetch(release), target)
    base = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    proc = subprocess.run([sys.executable, "-m", "vllm_patches", "export", fix.id, "--onto",
                           str(tree)], cwd=lanes.REPO, capture_output=True, text=True,
                          check=False, env={**os.environ, **IDENTITY})
    if proc.returncode != 0:
        raise RuntimeError(f"export {fix.id} --onto: exit {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return tree, base


def changed_files(tree: Path, base: str) -> list[str]:
    return subprocess.run(["git", "-C", str(tree), "diff", "--name-only", base, "HEAD"],
                          capture_output=True, text=True, check=True).stdout.split()


def check_release(release: Version, fixes: list[_series.Fix], hooks_only: bool,
                  pool: ThreadPoolExecutor) -> list[str]:
    """Export each of ``fixes`` onto ``release``; the broken expectations (none: all met).
    Each export, its tests and its hooks are independent of the others' (and of other
    releases'): they run in ``pool``, which every release's check shares."""
    series = _series.load()
    work = lanes.BUILD / "exported" / f"v{release}"
    problems: list[str] = []
    exported: dict[str, tuple[Path, str]] = {}

    def export(fix: _series.Fix) -> str | None:
        try:
            exported[fix.id] = export_onto(release, fix, work / fix.id)
        except RuntimeError as exc:
            return f"v{release} {fix.id}: {exc}"
        return None

    def hooks(fix_id: str) -> str | None:
        tree, base = exported[fix_id]
        files = changed_files(tree, base)
        started = time.monotonic()
        code, report = precommit.run_hooks(tree, files)
        lanes.log(f"v{release} {fix_id}: pre-commit on {count(len(files), 'file')}: "
                  f"{'passed' if code == 0 else 'FAILED'} ({time.monotonic() - started:.0f} s)")
        if code == 0:
            return None
        sys.stdout.write(report)
        return (f"v{release} {fix_id}: upstream's pre-commit fails on the exported series "
                f"({', '.join(files)})")

    problems += [p for p in pool.map(export, fixes) if p]
    if not hooks_only and exported:
        problems += check_tests(release, series, fixes, exported, work, pool)
    precommit.runner()  # made once (under its venv's lock), before the hooks run side by side
    ordered = [fix.id for fix in fixes if fix.id in exported]
    problems += [p for p in pool.map(hooks, ordered) if p]
    return problems


def exported_tests(series: _series.Series, fix: _series.Fix, release: Version) -> list[str]:
    """The tests ``export`` sends with ``fix`` on ``release``: its own and those of the
    fixes it requires that the release needs (a requirement upstream there is not sent)."""
    return [t for f in series.with_requirements(fix, release) if f.on(release).needed
            for t in f.tests]


def check_tests(release: Version, series: _series.Series, fixes: list[_series.Fix],
                exported: dict[str, tuple[Path, str]], work: Path,
                pool: ThreadPoolExecutor) -> list[str]:
    """stock_fails fail on stock with the exported tests; each exported tree passes its
    fix's own tests."""
    source = _releases.fetch(release)
    python = lanes.ensure_venv(release, source)
    dist_root = lanes.platform_dist_info(release, work / "dist")
    problems: list[str] = []
    stock = lanes.fresh_clone(source, work / "stock")
    stock_fails = []
    for fix in fixes:
        if fix.id not in exported:
            continue
        tree, _ = exported[fix.id]
        # The tests as exported, not as this repository has them, with their helper
        # modules; those of the fixes it requires too (a fix test may build on theirs).
        tests = exported_tests(series, fix, release)
        for test in tests + _export.test_helpers(tests):
            shown = subprocess.run(["git", "-C", str(tree), "show", f"HEAD:{test}"],
                                   capture_output=True, text=True, check=True).stdout
            (stock / test).parent.mkdir(parents=True, exist_ok=True)
            (stock / test).write_text(shown)
        stock_fails += fix.stock_fails

    def stock_run() -> list[str]:
        report = work / "stock-report.jsonl"
        lanes.run_pytest(python, stock, dist_root, stock_fails, [], report)
        results = lanes.outcomes(report)
        return [f"v{release} stock: {node} {results.get(node, 'did not run')}, but the "
                "exported test must fail there"
                for node in stock_fails if results.get(node) != "failed"]

    def exported_run(fix_id: str) -> list[str]:
        tree, _ = exported[fix_id]
        tests = series.fix(fix_id).tests
        report = work / f"{fix_id}-report.jsonl"
        code, _ = lanes.run_pytest(python, tree, dist_root, tests, [], report)
        failed = [n for n, o in lanes.outcomes(report).items() if o == "failed"]
        if code == 0:
            return []
        return [f"v{release} export {fix_id}: pytest exit {code}; failed: {', '.join(failed) or '-'}"]

    runs = [pool.submit(stock_run)] + [pool.submit(exported_run, fix.id)
                                       for fix in fixes if fix.id in exported]
    for run in runs:
        problems += run.result()
    return problems


def plan(series: _series.Series, releases: list[Version] | None,
         fix_ids: list[str] | None) -> dict[Version, list[_series.Fix]]:
    """Release -> the fixes to export there: each fix on the newest lane that needs it,
    or every fix each given lane needs; ``fix_ids`` narrows either."""
    chosen = [series.fix(fix_id) for fix_id in fix_ids] if fix_ids else list(series.fixes)
    result: dict[Version, list[_series.Fix]] = {}
    for fix in chosen:
        lanes_needing = [r for r in sorted(series.lanes, reverse=True)
                         if fix.on(r).needed and (releases is None or r in releases)]
        for release in lanes_needing if releases else lanes_needing[:1]:
            result.setdefault(release, []).append(fix)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", type=_releases.parse_release,
                        help="export on this lane (repeatable; default: each fix's newest)")
    parser.add_argument("--fix", action="append", help="only this fix (repeatable)")
    parser.add_argument("--hooks-only", action="store_true",
                        help="only upstream's pre-commit, not the tests")
    parser.add_argument("--skip-upstream", action="store_true",
                        help="no effect: accepted because tools/test.sh passes its arguments "
                             "to tools/lanes.py and here (no upstream suite runs here)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="exports, test runs and hook runs at a time (default: one per "
                             "CPU core)")
    args = parser.parse_args()
    # Every release at once, their work in one pool of ``--jobs`` workers, the release with
    # the most fixes first: one release at a time left cores idle while a release's last
    # hooks ran (the checks ended 7 minutes after the lanes beside them, 2026-11-30).
    releases = sorted(plan(_series.load(), args.release, args.fix).items(),
                      key=lambda item: len(item[1]), reverse=True)

    def timed(release: Version, fixes: list[_series.Fix]) -> list[str]:
        started = time.monotonic()
        lanes.log(f"v{release}: export {', '.join(f.id for f in fixes)}")
        release_problems = check_release(release, fixes, args.hooks_only, pool)
        lanes.log(f"v{release}: {'ok' if not release_problems else 'problems'} "
                  f"({time.monotonic() - started:.0f} s)")
        return release_problems

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool, \
            ThreadPoolExecutor(max_workers=max(1, len(releases))) as releases_pool:
        checks = [releases_pool.submit(timed, release, fixes) for release, fixes in releases]
        problems = [p for check in checks for p in check.result()]
    for problem in problems:
        print(f"EXPORT PROBLEM: {problem}")
    print(f"exported series: {'all met' if not problems else count(len(problems), 'problem')}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
