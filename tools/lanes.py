"""Run the vLLM-style tests of the series against real vLLM release trees, on CPU.

For each lane (a covered release whose tests CI runs, `lanes` in series.toml):
  1. fetch the release (cached git checkout) and a venv with its Python requirements
     and the CPU torch build;
  2. make two fresh clones: ``stock``, and ``patched`` with the series applied by
     ``vllm-patches apply`` (the command users run);
  3. copy the fix tests into both, at their upstream paths;
  4. stock: every test a fix lists in ``stock_fails`` must fail, and those its
     ``[[fails_on_stock]]`` names for the release (a bug only there), the others pass;
  5. patched: the fix tests and upstream's own suites for the changed code pass, less the
     upstream tests a fix deselects for the release (``[[deselect]]``, each with its
     reason, the CPU, offline environment; each entry must match a test). A narrow lane
     (``narrow_lanes``) runs upstream's suites only of the fixes that start at its
     release (``Series.suites_run_on``). An upstream
     test whose expectation a fix changes runs as the fix's patch amends it
     (``test_overlays``), never deselected;
  6. for fixes already upstream in the release, their bug reproductions pass on stock;
  7. runtime mode: this package is installed into the lane venv (as a wheel, the way
     users install it), and the fix tests run on the *stock* tree once more with
     ``-p vllm_patches._engine.pytest_plugin``, which calls vLLM's ``load_general_plugins()``:
     through the real entry point every fix test must pass. The stock run of step 4
     loads the plugin too, with ``VLLM_PATCHES_DISABLE=1``: disabled, the bug must
     reproduce. Every other run here sets ``VLLM_PATCHES_DISABLE=1`` (vLLM loads
     general plugins on its own, e.g. in ``EngineArgs``), so stock stays stock and
     patched stays git-patched.

Lanes run ``--jobs`` at a time, newest first (default: one per CPU core). A lane is one
pytest process at a time, and upstream's NIXL suites spend much of theirs waiting:
two lanes side by side kept 1.1 of 2 cores busy (v0.23.0 and v0.33.0 together took
11.5 minutes, 2026-11-26). The log names each line's lane.

Usage: python tools/lanes.py [--release vX.Y.Z ...] [--skip-upstream] [--jobs N] [--venvs-only]
Exit code 0 only if every lane met every expectation.
"""

from __future__ import annotations

import argparse
import contextvars
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from venvs import UV_INSTALL_FLAGS, uv_pip_install

from vllm_patches import _git
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._commands import export as _export
from vllm_patches._plural import count

REPO = Path(__file__).resolve().parent.parent
# Plugins every lane's pytest loads: upstream's per-test cleanup off (each says why).
LANE_PLUGINS = REPO / "tools" / "pytest_plugins"
# Venvs, trees and reports; VLLM_PATCHES_BUILD puts them elsewhere (a second checkout or
# a parallel run can run lanes without touching another run's trees).
BUILD = Path(os.environ.get("VLLM_PATCHES_BUILD") or REPO / "build").resolve()
TORCH = "torch==2.13.0"  # the CPU build this machine's pip takes from local disk
# Test-only packages vLLM's test trees import, beyond the release's requirements.
# ray (with msgpack): upstream's test_nixl_connector.py imports it at module level.
TEST_PACKAGES = ["pytest", "pytest-reportlog", "hypothesis", "tblib", "pytest-asyncio", "httpx",
                 "ray"]
# xgrammar pulls triton (1 GB) that no CPU test needs: installed without deps.
NO_DEPS = {"xgrammar"}
NO_DEPS_EXTRA = ["apache-tvm-ffi"]
# Version floors dropped: package -> why. v0.33.0 asks certifi>=2026.10.19, a
# security floor newer than any certifi the package index here serves.
RELAXED = {"certifi": "security floor newer than the index serves; CA bundle unused offline"}


# The lane a thread works for, named in its log lines (lanes run side by side).
LANE = contextvars.ContextVar("LANE", default="")


def log(message: str) -> None:
    lane = LANE.get()
    print(f"[lanes {time.strftime('%H:%M:%S')}{' ' + lane if lane else ''}] {message}",
          flush=True)


def lane_requirements(tree: Path) -> tuple[list[str], list[str]]:
    """(requirements, no-deps requirements) from the release's requirements/common.txt."""
    regular, no_deps = [], []
    for line in (tree / "requirements" / "common.txt").read_text().splitlines():
        text = line.split(" #")[0].strip()
        if not text or text.startswith(("#", "-")):
            continue
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if requirement.marker and not requirement.marker.evaluate():
            continue
        requirement.marker = None
        if requirement.name in RELAXED:
            requirement.specifier = SpecifierSet()
        (no_deps if requirement.name in NO_DEPS else regular).append(str(requirement))
    return regular, no_deps


def ensure_venv(release: Version, tree: Path) -> Path:
    """A venv for ``release``'s tests; rebuilt when its requirements change."""
    regular, no_deps = lane_requirements(tree)
    wanted = "\n".join([TORCH, *regular, *no_deps, *NO_DEPS_EXTRA, *TEST_PACKAGES])
    installs = [[TORCH], [TORCH, *regular, *NO_DEPS_EXTRA, *TEST_PACKAGES], ["--no-deps", *no_deps]]
    return cached_venv(BUILD / "venvs" / f"v{release}", wanted, installs, f"v{release}")


def cached_venv(venv: Path, wanted: str, installs: list[list[str]], label: str) -> Path:
    """The python of a venv at ``venv`` made by ``installs`` (``uv pip install``
    arguments, in order); made again only when ``wanted`` (what they install) changes: a
    stamp of it sits in the venv, with how uv installs (``UV_INSTALL_FLAGS``). A
    rebuild downloads nothing uv's cache holds."""
    stamp = hashlib.sha256((wanted + json.dumps(UV_INSTALL_FLAGS)).encode()).hexdigest()
    python = venv / "bin" / "python"
    stamp_file = venv / ".requirements-sha256"
    venv.parent.mkdir(parents=True, exist_ok=True)
    # One maker per venv: tools/test.sh runs the lanes and the export check side by side,
    # and both need each release's venv; the second waits, then finds it made.
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp_file.is_file() and stamp_file.read_text() == stamp:
            return python
        log(f"{label}: creating {venv}")
        shutil.rmtree(venv, ignore_errors=True)
        # --seed: pip in the venv, as ``python -m venv`` made it (for whoever debugs in it).
        subprocess.run([sys.executable, "-m", "uv", "venv", "--quiet", "--seed", "--python",
                        sys.executable, str(venv)], check=True)
        for args in installs:
            problem = uv_pip_install(python, args)
            if problem:
                raise SystemExit(f"{label}: {problem}")
        stamp_file.write_text(stamp)
    return python


def fresh_clone(source: Path, target: Path) -> Path:
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    _git.run(source, "clone", "--quiet", str(source), str(target))
    return target


def platform_dist_info(release: Version, root: Path) -> Path:
    """vLLM's platform detection reads the installed version; ``+cpu`` selects CPU."""
    dist_info = root / f"vllm-{release}+cpu.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {release}+cpu\n")
    return root


def offline_hf_home() -> Path:
    """tools/hf_home (configs and a tokenizer stub, see its README) copied into the build,
    where the hub client may write; copied again whenever tools/hf_home changes."""
    source, target = REPO / "tools" / "hf_home", BUILD / "hf_home"
    digest = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    stamp = BUILD / "hf_home.sha256"
    if not (target.is_dir() and stamp.is_file() and stamp.read_text() == digest.hexdigest()):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
        stamp.write_text(digest.hexdigest())
    return target


def vllm_test_env(tree: Path, dist_root: Path) -> dict[str, str]:
    """The environment that runs a vLLM source tree's Python on CPU, offline."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, (tree, dist_root, LANE_PLUGINS))),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(offline_hf_home()),
        "TRANSFORMERS_OFFLINE": "1",
        # The package sits in the lane venv for runtime mode; elsewhere its plugin is off.
        "VLLM_PATCHES_DISABLE": "1",
    }


def package_stamp() -> str:
    """A hash of everything the installed package is built from."""
    digest = hashlib.sha256()
    folders = ("vllm_patches", "patches", "tests/v1")  # tests/v1: bundled for `export`
    files = [REPO / "pyproject.toml", *sorted(
        path for folder in folders for path in (REPO / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts)]
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def ensure_package(python: Path) -> str | None:
    """Install this package into a lane venv, as a wheel (so its entry point is
    registered, as for a user); reinstalled when its sources change. None, or why not."""
    stamp = package_stamp()
    stamp_file = python.parent.parent / ".vllm-patches-sha256"
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        return None
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    # --reinstall: rebuilt from the sources even where the version is unchanged.
    for args in (dependencies, ["--no-deps", "--reinstall", str(REPO)]):
        problem = uv_pip_install(python, args)
        if problem:
            return problem
    stamp_file.write_text(stamp)
    log(f"installed vllm-patches into {python.parent.parent}")
    return None


RUNTIME_PLUGIN = "vllm_patches._engine.pytest_plugin"
ACTIVATION_LINE = re.compile(r"^vllm-patches(:| on vLLM) .*$", re.MULTILINE)


def run_pytest(python: Path, tree: Path, dist_root: Path, tests: list[str],
               deselect: list[str], report: Path, runtime: str | None = None) -> tuple[int, str]:
    """Run ``tests`` in ``tree``; ``runtime`` "on"/"off": load vLLM's general plugins at
    session start (runtime mode) with the vllm_patches plugin enabled or disabled.
    Returns pytest's exit code and its summary line."""
    env = vllm_test_env(tree, dist_root)
    plugin = []
    if runtime is not None:
        plugin = ["-p", RUNTIME_PLUGIN]
        env["VLLM_PATCHES_DISABLE"] = "0" if runtime == "on" else "1"
    args = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            "-p", "skip_global_cleanup", *plugin,
            f"--report-log={report}", *tests, *(f"--deselect={d}" for d in deselect)]
    proc = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, check=False)
    summary = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    mode = f" [runtime {runtime}]" if runtime else ""
    files = dict.fromkeys(Path(t.split("::")[0]).name for t in tests)
    log(f"  pytest{mode} {' '.join(files)}: {summary[0]}")
    activation = ACTIVATION_LINE.search(proc.stdout)
    if activation:
        log(f"    {activation.group(0)}")
        report.with_suffix(".activation").write_text(activation.group(0))
    if proc.returncode not in (0, 1):
        sys.stdout.write(proc.stdout[-6000:] + proc.stderr[-3000:])
    return proc.returncode, summary[0]


def outcomes(report_log: Path) -> dict[str, str]:
    """pytest node id -> passed / failed / skipped, from a pytest-reportlog file."""
    result: dict[str, str] = {}
    for line in report_log.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("$report_type") != "TestReport":
            continue
        node, outcome = entry["nodeid"], entry["outcome"]
        if (outcome == "failed" or entry["when"] == "call" or node not in result) \
                and result.get(node) != "failed":
            result[node] = outcome
    return result


def run_lane(release: Version, skip_upstream: bool) -> list[str]:
    """Run one lane; returns the list of broken expectations (empty = green)."""
    series = _series.load()
    fixes = series.applicable(release)
    source = _releases.fetch(release)
    python = ensure_venv(release, source)
    lane_dir = BUILD / "lanes" / f"v{release}"
    dist_root = platform_dist_info(release, lane_dir / "dist")
    problems: list[str] = []
    if not fixes:
        log(f"v{release}: no fix applies ({'; '.join(f'{f.id} {f.on(release)}' for f in series.fixes)})")
    # The fixes' tests, and the series' own where they apply: each with what must fail
    # on stock (``expectations``: fixes and the series' tests alike).
    whole = series.series_tests
    expectations = [*fixes, *([whole] if whole.applies(release) else [])]
    fix_tests = [t for expected in expectations for t in expected.tests]
    # Where a fix is upstream, its bug reproductions must pass on stock: proof of "upstream".
    landed = [fix for fix in series.fixes if fix.on(release).need is _series.Need.UPSTREAM]
    landed_nodes = [node for fix in landed for node in fix.upstream_proof_on(release)]

    installed = ensure_package(python)
    if installed:
        return [f"v{release}: {installed}"]
    stock = fresh_clone(source, lane_dir / "stock" / "tree")
    patched = fresh_clone(source, lane_dir / "patched" / "tree")
    applied = subprocess.run([sys.executable, "-m", "vllm_patches", "apply", str(patched)],
                             cwd=REPO, capture_output=True, text=True, check=False)
    log(f"v{release}: vllm-patches apply -> exit {applied.returncode}")
    if applied.returncode != 0:
        return [f"v{release}: apply failed: {applied.stderr.strip()}"]
    for tree, tests in ((stock, fix_tests + [t for f in landed for t in f.tests]),
                        (patched, fix_tests)):
        for test in tests + _export.test_helpers(tests):
            (tree / test).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / test, tree / test)

    # One stock session for both (each session imports vLLM again): the plugin it loads
    # is disabled, so the landed fixes' reproductions meet stock upstream code.
    if fix_tests or landed_nodes:
        report = lane_dir / "stock" / "report.jsonl"
        run_pytest(python, stock, dist_root, fix_tests + landed_nodes, [], report,
                   runtime="off")
        results = outcomes(report)
        for node in landed_nodes:
            if results.get(node) != "passed":
                problems.append(f"v{release} stock: {node} {results.get(node, 'did not run')}, "
                                "but the fix is upstream here")

    if fix_tests:
        for expected in expectations:
            expected_fail = set(expected.stock_fails_on(release))
            for node in expected_fail - results.keys():
                problems.append(f"v{release} stock: {node} did not run")
            for node, outcome in results.items():
                if not any(node.startswith(t) for t in expected.tests):
                    continue
                if node in expected_fail and outcome != "failed":
                    problems.append(f"v{release} stock: {node} {outcome}, but it must fail (bug not reproduced)")
                if node not in expected_fail and outcome == "failed":
                    problems.append(f"v{release} stock: {node} failed, but it checks kept behaviour")

    if fix_tests:
        problems += run_runtime_mode(release, python, stock, dist_root, fixes, fix_tests,
                                     lane_dir)

    suites = [] if skip_upstream else series.suites_run_on(release)
    upstream = [t for fix in suites for t in fix.upstream_tests
                if (patched / t.split("::")[0]).exists()]
    # Deselects of the upstream files this run holds (a release may lack a file).
    upstream_files = {t.split("::")[0] for t in upstream}
    deselect = list(dict.fromkeys(node for fix in fixes for node in fix.deselected(release)
                                  if node.split("::")[0] in upstream_files))
    tests = list(dict.fromkeys(fix_tests + upstream))
    if tests:
        report = lane_dir / "patched" / "report.jsonl"
        code, summary = run_pytest(python, patched, dist_root, tests, deselect, report)
        failed = [n for n, o in outcomes(report).items() if o == "failed"]
        timing = [note for fix in fixes for note in fix.timing_sensitive_on(release)]
        flakes = rerun_timing_sensitive(python, patched, dist_root, failed, timing, lane_dir)
        failed = [node for node in failed if node not in flakes]
        if failed or code not in (0, 1):
            problems.append(f"v{release} patched: pytest exit {code}; failed: {', '.join(failed) or '-'}")
        # pytest ignores a --deselect that matches no test: a renamed upstream test or
        # parameter would leave a stale entry behind without this count.
        deselected = re.search(r"(\d+) deselected", summary)
        if len(deselect) != (int(deselected.group(1)) if deselected else 0):
            entries = count(len(deselect), "deselect entry", "deselect entries")
            problems.append(f"v{release} patched: {entries}, but "
                            f"pytest deselected {deselected.group(1) if deselected else 0}: "
                            "an entry names no test of this release")
    return problems


FLAKE_RERUNS = 2


def rerun_timing_sensitive(python: Path, tree: Path, dist_root: Path, failed: list[str],
                           timing: list[_series.UpstreamTestNote], lane_dir: Path) -> list[str]:
    """The failed tests that are flakes: listed timing-sensitive, and passing when rerun
    alone ``FLAKE_RERUNS`` times in a row. Each is reported; anything else stays failed.

    Upstream tests with a wall-clock limit (``[[timing_sensitive]]`` in a fix's metadata,
    each with why) can miss it when the 2-core machine is busy; the rerun alone shows
    whether the code or the load failed. A test that is not listed, or fails a rerun,
    fails the lane: a real failure is never retried away.
    """
    flakes = []
    for node in failed:
        if not any(note.names(node) for note in timing):
            continue
        runs = [run_pytest(python, tree, dist_root, [node], [],
                           lane_dir / "patched" / f"rerun-{attempt}.jsonl")[0]
                for attempt in range(FLAKE_RERUNS)]
        if all(code == 0 for code in runs):
            log(f"  FLAKE (timing-sensitive, failed under load, passed {FLAKE_RERUNS}/"
                f"{FLAKE_RERUNS} alone): {node}")
            flakes.append(node)
    return flakes


def run_runtime_mode(release: Version, python: Path, stock: Path, dist_root: Path,
                     fixes: list[_series.Fix], fix_tests: list[str],
                     lane_dir: Path) -> list[str]:
    """``fix_tests`` on the stock tree, ``fixes`` activated through vLLM's plugin loader."""
    report = lane_dir / "runtime" / "report.jsonl"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.with_suffix(".activation").unlink(missing_ok=True)
    code, _ = run_pytest(python, stock, dist_root, fix_tests, [], report, runtime="on")
    problems = []
    failed = [n for n, o in outcomes(report).items() if o == "failed"] if report.exists() else []
    if code != 0:
        problems.append(f"v{release} runtime: pytest exit {code}; failed: {', '.join(failed) or '-'}")
    line = report.with_suffix(".activation")
    text = line.read_text() if line.exists() else ""
    active = re.search(r"active: ([^;]*)", text)
    active_ids = set(active.group(1).split(", ")) if active else set()
    missing = [fix.id for fix in fixes if fix.id not in active_ids]
    if missing:
        problems.append(f"v{release} runtime: {', '.join(missing)} not active "
                        f"({text or 'no activation line'})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", type=_releases.parse_release)
    parser.add_argument("--skip-upstream", action="store_true",
                        help="only the fix tests, not upstream's suites")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="lanes run at a time (default: one per CPU core)")
    parser.add_argument("--venvs-only", action="store_true",
                        help="only build the lanes' venvs (tools/test.sh, in the background)")
    args = parser.parse_args()
    releases = args.release or list(_series.load().lanes)
    if args.venvs_only:
        for release in releases:
            ensure_venv(release, _releases.fetch(release))
        return 0
    offline_hf_home()  # made once, before lanes that read it run side by side

    def timed_lane(release: Version) -> list[str]:
        LANE.set(f"v{release}")
        started = time.monotonic()
        lane_problems = run_lane(release, args.skip_upstream)
        status = "ok" if not lane_problems else count(len(lane_problems), "problem")
        log(f"v{release}: {status} ({time.monotonic() - started:.0f} s)")
        return lane_problems

    # Newest first: newer lanes run more fixes and longer upstream suites, and the
    # longest lane started first ends the run soonest.
    ordered = sorted(releases, reverse=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        problems = [p for lane_problems in pool.map(timed_lane, ordered) for p in lane_problems]
    for problem in problems:
        print(f"LANE PROBLEM: {problem}")
    print(f"lanes: {len(releases) - len({p.split()[0] for p in problems})} passed, "
          f"{len({p.split()[0] for p in problems})} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
