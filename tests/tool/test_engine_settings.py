"""tools/engine_lane.py: the per-release engine settings are one table, read by one
function, and name only e2e test files that exist; every e2e test file runs on some
engine release of the lane (a test file left out of every entry would never run)."""

import sys

from packaging.version import Version

from vllm_patches._catalog import series as _series

sys.path.insert(0, str(_series.REPO_DIR / "tools"))  # tools/ is not a package
import engine_lane


def test_each_release_takes_the_newest_entry_not_after_it() -> None:
    settings = engine_lane.ENGINE_SETTINGS
    assert engine_lane.engine_settings(Version("0.21.0")) is settings[Version("0.18.0")]
    assert engine_lane.engine_settings(Version("0.30.0")) is settings[Version("0.30.0")]
    assert engine_lane.engine_settings(Version("0.32.0")) is settings[Version("0.31.0")]
    assert engine_lane.engine_settings(Version("0.32.0")).block_size == 32


def test_every_e2e_test_file_runs_on_some_engine_release() -> None:
    e2e = _series.REPO_DIR / "tests" / "e2e"
    files = {f"tests/e2e/{path.name}" for path in e2e.glob("test_*.py")}
    run = {test for release in engine_lane.ENGINE_RELEASES
           for test in engine_lane.engine_settings(release).tests}
    assert run <= files, f"settings name missing files: {sorted(run - files)}"
    assert files <= run, f"never run by the lane: {sorted(files - run)}"
