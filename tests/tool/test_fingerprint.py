"""The fingerprints of the fixes' targets: what regen commits, what the runtime computes."""

import ast
import importlib
import re

import pytest
from packaging.version import Version

from vllm_patches._catalog import patchset as _patchset
from vllm_patches._catalog import series as _series
from vllm_patches._engine import fingerprint as _fingerprint
from vllm_patches._engine import patch_writer as _patch_writer
from vllm_patches._engine import runtime as _runtime

SERIES = _series.load()
RELEASE = Version("0.21.0")


def test_the_committed_fingerprints_are_what_regen_writes(pristine_v0_21_0):
    """`regen` writes them next to the patches (`regen --check` proves every release fresh)."""
    files = _patch_writer.render(SERIES, RELEASE, pristine_v0_21_0)
    assert files[_fingerprint.FILE] == _patchset.committed(RELEASE)[_fingerprint.FILE]


@pytest.fixture
def installed_v0_21_0(pristine_v0_21_0, tmp_path, monkeypatch):
    """The v0.21.0 tree's ``vllm`` package on sys.path, found by the runtime's reader
    (its files are read, never imported)."""
    (tmp_path / "vllm").symlink_to(pristine_v0_21_0 / "vllm")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert "vllm" not in __import__("sys").modules


def test_the_runtime_computes_the_same_from_installed_files(installed_v0_21_0):
    actual = _fingerprint.compute(SERIES, RELEASE, _series.PACKAGE_DIR,
                                  _fingerprint.installed_reader("vllm"))
    assert actual == _fingerprint.recorded(RELEASE)
    # So a v0.21.1 with v0.21.0's code at every target runs the fixes as v0.21.0.
    basis = _runtime.release_basis("0.21.1", SERIES, SERIES.ids, allow_unsupported=False)
    assert (basis.release, basis.how) == (RELEASE, _runtime.VERIFIED)
    targets = {t for by_target in actual.values() for t in by_target}
    assert basis.why == f"{len(targets)} definitions compared"


@pytest.mark.parametrize("release", SERIES.covered, ids=str)
def test_each_covered_release_has_the_fingerprints_of_the_fixes_it_needs(release):
    recorded = _fingerprint.recorded(release)
    assert recorded is not None, f"no patches/v{release}/{_fingerprint.FILE}: run regen"
    assert list(recorded) == [fix.id for fix in SERIES.applicable(release)]
    for by_target in recorded.values():
        assert by_target and all(re.fullmatch(r"[0-9a-f]{16}|absent", v)
                                 for v in by_target.values())


def test_a_fingerprint_is_the_code_not_its_layout():
    def of(source: str) -> str:
        return _fingerprint.fingerprint(ast.parse(source).body)

    plain = of("def f(a, b=1):\n    return g(a, b)  # why\n")
    assert plain == of("\n\ndef f(a,\n      b = 1):\n    # a comment\n    return g(\n        a, b)\n")
    assert plain != of("def f(a, b=2):\n    return g(a, b)\n")
    assert of("x = f'{a}' 'b'\n") == of("x = f'{a}b'\n"), "f-string parts merged"
    assert _fingerprint.fingerprint([]) == _fingerprint.ABSENT


@pytest.mark.parametrize("release, candidate", [
    ("0.33.1", "0.33.0"), ("0.20.3", "0.20.2"), ("0.21.0.post1", "0.21.0"), ("0.34.0", None),
    ("0.17.1", None)])
def test_the_candidate_is_the_newest_covered_release_of_the_minor_series(release, candidate):
    expected = Version(candidate) if candidate else None
    assert _fingerprint.candidate(SERIES, Version(release)) == expected


def test_an_unreadable_installation_never_matches():
    for source, value in ((None, _fingerprint.NO_FILE), ("def (", _fingerprint.UNPARSABLE)):
        found = _fingerprint.compute(SERIES, RELEASE, _series.PACKAGE_DIR, lambda _, text=source: text)
        assert {v for by_target in found.values() for v in by_target.values()} == {value}
        differ = _fingerprint.differences(_fingerprint.recorded(RELEASE), found, SERIES.ids)
        assert differ and all(d.endswith(("no source file)", "source not parsable)"))
                              for d in differ)
