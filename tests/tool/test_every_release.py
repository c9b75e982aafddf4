"""Every release the series covers is first class: its committed patches, status on it,
and the whole cycle (apply, status, export, revert) on releases that are not lanes.

The status and cycle tests use the releases already in the cache (`vllm-patches fetch`;
CI's `regen --check` fetches every covered release first) and skip the others.
"""

import re

import pytest
from conftest import clone, git, snapshot
from packaging.version import Version

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._cli import main
from vllm_patches._errors import EXIT_OK

SERIES = _series.load()
CACHED = set(_releases.cached_releases())


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cached(release: Version):
    if release not in CACHED:
        pytest.skip(f"v{release} is not cached (vllm-patches fetch v{release})")
    return _releases.checkout_path(release)


def test_covered_releases_fill_the_range_of_the_lanes():
    covered = list(SERIES.covered)
    assert covered == sorted(set(covered)), "oldest first, once each"
    assert set(SERIES.lanes) <= set(covered)
    oldest = min(SERIES.lanes)
    assert covered[0] == Version(f"{oldest.major}.{oldest.minor}.0")
    assert covered[-1] == max(SERIES.lanes)


@pytest.mark.parametrize("release", SERIES.covered, ids=str)
def test_each_covered_release_has_its_patches_numbered_k_of_n(release):
    """The patches said [PATCH 2/2], [PATCH 4/4] in a series of 4."""
    directory = _series.PATCHES_DIR / f"v{release}"
    assert (directory / "series").is_file(), f"no patches for v{release}"
    patches = [directory / line for line in (directory / "series").read_text().splitlines()
               if line and not line.startswith("#")]
    assert len(patches) == len(SERIES.applicable(release))
    for number, patch in enumerate(patches, start=1):
        subject = re.search(r"^Subject: (\[PATCH[^\]]*\])", patch.read_text(), re.MULTILINE)
        # git pads k to the width of n ("[PATCH 01/10]"), as mailing lists expect.
        width = len(str(len(patches)))
        expected = f"[PATCH {number:0{width}}/{len(patches)}]" if len(patches) > 1 else "[PATCH]"
        assert subject and subject.group(1) == expected, patch
        assert f"Base: vLLM v{release} (" in patch.read_text()


@pytest.mark.parametrize("release", SERIES.covered, ids=str)
def test_status_on_each_cached_release(release, capsys):
    """`status` on the pristine release (the cache may be read, never changed): each fix
    applicable, upstream since the release that has it, or not applicable."""
    tree = cached(release)
    before = snapshot(tree)
    code, out, err = run(capsys, "status", str(tree))
    assert code == EXIT_OK, err
    assert out.splitlines()[0] == f"{tree}: vLLM v{release}"
    for fix in SERIES.fixes:
        line = next(line for line in out.splitlines() if line.split()[0] == fix.id)
        verdict = fix.on(release)
        if verdict.need is _series.Need.UPSTREAM:
            assert line.endswith(f"upstream (since v{fix.upstream_since})"), line
        elif verdict.needed:
            assert " applicable (" in line, line
        else:
            assert " not applicable (needed on vLLM " in line, line
    assert snapshot(tree) == before


@pytest.mark.parametrize("release", ["0.20.1", "0.25.1"])
def test_the_whole_cycle_on_a_release_that_is_not_a_lane(release, tmp_path, capsys,
                                                         contributor):
    """Status and apply on releases between the lanes exited 2 ("not a
    supported release"); a user on v0.24.0 could not even learn that F1 is upstream
    (v0.24.0 has been a lane since; v0.25.1, between lanes, has F1 upstream too)."""
    release = Version(release)
    assert release not in SERIES.lanes
    checkout = clone(cached(release), tmp_path / "vllm")
    base = git(checkout, "rev-parse", "HEAD").strip()
    needed = SERIES.applicable(release)
    code, out, _ = run(capsys, "apply", str(checkout))
    assert code == EXIT_OK and f"done: {', '.join(f.id for f in needed)}" in out
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_OK and out.count(" applied") == len(needed)
    if release >= Version("0.24.0"):
        assert "upstream (since v0.24.0)" in out
    for fix in needed:
        target = tmp_path / f"export-{fix.id}"
        code, _, _ = run(capsys, "export", fix.id, "--release", f"v{release}", "-o", str(target))
        assert code == EXIT_OK and f"on vLLM v{release} (upstream commit " in (
            target / "pr-description.md").read_text()
    code, out, _ = run(capsys, "revert", str(checkout))
    assert code == EXIT_OK
    assert git(checkout, "diff", base, "HEAD") == ""


def test_a_main_like_tree_resembles_its_release(tmp_path, capsys):
    """A checkout that is no release (no vllm/_version.py, no tag): the nearest covered
    release by its files, and the command to run, in one line."""
    release = max(SERIES.lanes)
    checkout = clone(cached(release), tmp_path / "main")
    git(checkout, "tag", "-d", f"v{release}")
    version = checkout / "vllm" / "_version.py"
    if version.exists():
        version.unlink()
        git(checkout, "commit", "-qam", "a main clone has no _version.py")
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"it resembles v{release} (" in err and "files its patches change are as in" in err
    # Every file its patches change is as in that release: no --3way to advise.
    assert f"`vllm-patches apply --release v{release} {checkout}`" in err
