"""The port drill: a port to a release whose code the fixes touch is unchanged
costs one bound edit plus `regen`.

On a copy of the repository, the newest covered release is taken out of the series
(its `covered` entry and its patches), then ported back as CONTRIBUTING's checklist
says ("Porting to a new release", steps 4 and 5): one line appended to `covered` in
series.toml, then `vllm-patches regen --release`. The patches it writes must equal the
committed ones, and the edit must be one line of one file. Uses the cached release (no
network); skipped when it is not cached.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import git

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series

SERIES = _series.load()
NEWEST = SERIES.newest
REPO = _series.REPO_DIR
# What `regen` reads: the package (overlays, metadata, series.toml), patches/, and the
# upstream tests the fixes amend (``test_overlays``, under tests/v1).
COPIED = ("vllm_patches", "patches", "pyproject.toml", "tests/v1")


def covered_line(release) -> str:
    return f'    "{release}",\n'


@pytest.fixture
def repo_without_newest(tmp_path: Path) -> Path:
    """A git repository holding a copy of this one with ``NEWEST`` taken out of the series."""
    if NEWEST not in _releases.cached_releases():
        pytest.skip(f"v{NEWEST} is not cached (vllm-patches fetch v{NEWEST})")
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, repo / name)
    series_toml = repo / "vllm_patches" / "series.toml"
    text = series_toml.read_text()
    assert text.count(covered_line(NEWEST)) == 1, "covered lists one release per line"
    series_toml.write_text(text.replace(covered_line(NEWEST), ""))
    shutil.rmtree(repo / "patches" / f"v{NEWEST}")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=drill", "-c", "user.email=drill@example.invalid",
        "commit", "-qm", f"the series without v{NEWEST}")
    return repo


def test_a_port_is_one_bound_edit_plus_regen(repo_without_newest):
    repo = repo_without_newest
    series_toml = repo / "vllm_patches" / "series.toml"
    # Step 4: the one bound, appended to `covered`.
    text = series_toml.read_text()
    last = covered_line(SERIES.covered[-2])
    series_toml.write_text(text.replace(last, last + covered_line(NEWEST), 1))
    # Step 5: regen for the new release, with the copy's package.
    env = {**os.environ, "PYTHONPATH": str(repo)}
    result = subprocess.run([sys.executable, "-m", "vllm_patches", "regen", "--release",
                             f"v{NEWEST}"], cwd=repo, env=env, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr

    generated = repo / "patches" / f"v{NEWEST}"
    committed = REPO / "patches" / f"v{NEWEST}"
    assert sorted(p.name for p in generated.iterdir()) == sorted(p.name for p in committed.iterdir())
    for path in committed.iterdir():
        assert (generated / path.name).read_bytes() == path.read_bytes(), path.name
    # The edit: one line of one file (patches/ is generated).
    git(repo, "add", "-A")
    edited = [line.split("\t") for line in git(
        repo, "diff", "--cached", "--numstat", "--", ".", ":!patches").splitlines()]
    assert edited == [["1", "0", "vllm_patches/series.toml"]]
    # The ported release is the series' newest and a lane again, as before the drill.
    check = ("from vllm_patches._catalog import series as _series; s = _series.load(); "
             "print(s.newest, s.lanes[-1], s.supported)")
    out = subprocess.run([sys.executable, "-c", check], cwd=repo, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[:2] == [str(NEWEST), str(NEWEST)]
