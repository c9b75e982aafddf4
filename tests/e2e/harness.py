"""Running real vLLM engines for the e2e tests: one at a time, offline, in a private network.

Each scenario (``scenarios.py``) runs as its own Python process in the engine venv, in a
private network namespace (``unshare -n``, loopback only: nothing an engine binds, NIXL's
listener and torch.distributed's store included, is reachable from outside) and PID
namespace (no engine process outlives its scenario), while this
process holds ``/tmp/vllm-engine.lock`` (the lock every engine workload on the machine
takes, so engines never compete for the cores). Stock and fixed runs differ only in
``VLLM_PATCHES_DISABLE``. The scenario writes ``record.json`` into its run directory,
next to the engines' logs and the probe's events (``engine_plugins/e2e_probe.py``).

A run that *broke down* (an engine died or never became ready, a NIXL handshake failed)
exits with ``BREAKDOWN`` and is retried, at most ``ATTEMPTS`` times in all; a run whose
checks fail is never retried (the checks run here, on a complete record).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

E2E_DIR = Path(__file__).resolve().parent
PLUGINS_DIR = E2E_DIR / "engine_plugins"
ENGINE_LOCK = Path("/tmp/vllm-engine.lock")
# Exit status of a scenario whose engines broke down (EX_TEMPFAIL): retried.
BREAKDOWN = 75
ATTEMPTS = 3
# Stock: the plugin is installed but disabled; fixed: every fix the release needs.
MODES = {"stock": {"VLLM_PATCHES_DISABLE": "1"}, "fixed": {"VLLM_PATCHES_DISABLE": "0"}}
PROBE_ENV = "VLLM_PATCHES_E2E_PROBE"
PROBE_DIST = "vllm_patches_e2e_probe-0.dist-info"


def out_dir() -> Path:
    """Where runs write (``tools/engine_lane.py`` sets it); the lane's tests need it."""
    path = os.environ.get("VLLM_PATCHES_E2E_OUT")
    if not path:
        raise RuntimeError("VLLM_PATCHES_E2E_OUT is not set: run the real-engine lane "
                           "through tools/engine_lane.py")
    return Path(path)


def release() -> str:
    """The vLLM release of the engine venv, as the lane names it (``0.21.0``)."""
    return os.environ["VLLM_PATCHES_E2E_RELEASE"]


def block_size() -> int:
    """The KV block size of every engine of the lane: the release's (decided by
    ``tools/engine_lane.py``, ``engine_settings``)."""
    return int(os.environ["VLLM_PATCHES_E2E_BLOCK_SIZE"])


def quiet_roles() -> tuple[str, ...]:
    """The processes (``analysis.ROLES``) of the release's served engine that do not show
    the plugin's line (``tools/engine_lane.py``, ``engine_settings``)."""
    return tuple(filter(None, os.environ.get("VLLM_PATCHES_E2E_QUIET_ROLES", "").split(",")))


def pair_runs() -> list[tuple[str, str]]:
    """(mode, connector) of each run of a NIXL pair: stock and fixed NixlConnector.
    MultiConnector hands every call to its one NixlConnector child, so its stock run
    shows the bug stock NixlConnector shows (measured both ways until 2026-11-26,
    docs/real-engine-lane.md); that the fixes reach the child through it, the generated
    CI seeds that draw it prove, pull and push (tests/e2e/test_generated_pairs.py). The
    fixed pairs through it cut for CI's budget, 2026-11-28."""
    return [(mode, "NixlConnector") for mode in ("stock", "fixed")]


def activation_line(mode: str, environ: dict[str, str]) -> str:
    """The line the installed plugin logs in every process, for this release, ``mode``
    and the fixes ``environ`` selects."""
    from packaging.version import Version

    from vllm_patches._catalog import series as _series
    from vllm_patches._engine import runtime as _runtime

    if mode == "stock":
        return _runtime.Activation(None, [], disabled=True).line()
    series = _series.load()
    version = Version(release())
    ids = _runtime.selected_ids(series, environ)
    _runtime.require_requirements(series, version, ids, environ)
    return _runtime.Activation(version, _runtime.fix_states(series, version, ids)).line()


def bug_expected(fix_id: str, mode: str) -> bool:
    """Whether a run in ``mode`` must show the bug that ``fix_id`` fixes: a stock run on a
    release that needs the fix (not on one that has it upstream or never had the bug)."""
    from packaging.version import Version

    from vllm_patches._catalog import series as _series

    fix = next(fix for fix in _series.load().fixes if fix.id == fix_id)
    version = Version(release())
    return mode == "stock" and fix.on(version).needed


def probe_dist_root(root: Path) -> Path:
    """A folder holding the probe's dist-info: on PYTHONPATH, vLLM's plugin loader finds
    its entry point as if it were installed."""
    dist_info = root / PROBE_DIST
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-patches-e2e-probe\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ne2e_probe = e2e_probe:register\n")
    return root


def engine_env(mode: str, run_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a scenario and every engine process it starts."""
    env = {
        **os.environ,
        **MODES[mode],
        "PYTHONPATH": os.pathsep.join([str(PLUGINS_DIR), str(probe_dist_root(run_dir / "dist"))]),
        PROBE_ENV: str(run_dir / "probe.jsonl"),
        # GiB of KV cache per engine; vLLM would take about 90 % of the RAM otherwise.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # Every log line names its process: API server, engine core, worker.
        "VLLM_LOGGING_PREFIX": "[pid=%(process)d %(processName)s] ",
        "PYTHONUNBUFFERED": "1",
    }
    # All fixes, unless the scenario chooses some.
    env.pop("VLLM_PATCHES_FIXES", None)
    env.update(extra or {})
    return env


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    """Hold the machine-wide engine lock (the one ``flock /tmp/vllm-engine.lock`` takes)."""
    with open(ENGINE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def in_private_network(command: list[str]) -> list[str]:
    """``command`` in a new network namespace with only the loopback interface, up, and
    a new PID namespace (with its own /proc) in which ``command`` is process 1: when it
    exits, or ``unshare`` is killed (which kills it), the kernel kills every engine
    process it left behind."""
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c",
            'ip link set lo up && exec "$@"', "netns", *command]


def run_scenario(name: str, mode: str, args: dict[str, Any] | None = None,
                 extra_env: dict[str, str] | None = None, label: str | None = None
                 ) -> dict[str, Any]:
    """Run scenario ``name`` in ``mode`` ("stock"/"fixed"); returns its record, with
    ``run_dir`` and ``attempts`` added. Retries a breakdown; raises when every attempt
    broke down or the scenario failed otherwise."""
    base = out_dir() / (label or name) / mode
    for attempt in range(1, ATTEMPTS + 1):
        run_dir = base / f"attempt-{attempt}"
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        run_dir.mkdir(parents=True)
        command = [sys.executable, str(E2E_DIR / "scenarios.py"), name, str(run_dir),
                   json.dumps(args or {})]
        started = time.monotonic()
        with engine_lock(), open(run_dir / "scenario.log", "w") as log:
            code = subprocess.run(in_private_network(command), check=False, cwd=run_dir,
                                  env=engine_env(mode, run_dir, extra_env), stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        seconds = time.monotonic() - started
        if code == 0:
            record = json.loads((run_dir / "record.json").read_text())
            record.update(run_dir=str(run_dir), attempts=attempt, seconds=round(seconds, 1))
            return record
        if code != BREAKDOWN:
            raise RuntimeError(f"scenario {name} ({mode}) failed with exit {code}; "
                               f"see {run_dir / 'scenario.log'}")
        print(f"scenario {name} ({mode}) broke down on attempt {attempt} ({seconds:.0f} s): "
              f"{_last_line(run_dir / 'scenario.log')}", flush=True)
    raise RuntimeError(f"scenario {name} ({mode}) broke down {ATTEMPTS} times; see {base}")


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def probe_events(run_dir: str | Path, name: str = "probe.jsonl") -> list[dict[str, Any]]:
    """The probe's events of a run, in time order."""
    path = Path(run_dir) / name
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sorted(events, key=lambda event: event["t"])
