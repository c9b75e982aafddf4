"""The series metadata is data; these checks keep it true to the overlays and patches."""

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_patches._catalog import patchset as _patchset
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.patchset import PatchSet
from vllm_patches._engine.splice import Overlay

SERIES = _series.load()
FIXES = SERIES.fixes
REPO = _series.REPO_DIR
GITHUB = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$")


def overlay_files() -> list[Path]:
    """Every .py under vllm_patches/ but the machinery, whose names start with ``_``."""
    return sorted(p for p in _series.PACKAGE_DIR.rglob("*.py")
                  if not any(part.startswith("_")
                             for part in p.relative_to(_series.PACKAGE_DIR).parts))


def test_series_order_names_every_fix_file_once():
    on_disk = {p.stem for p in (_series.PACKAGE_DIR / "fixes").glob("*.toml")}
    assert [f.id for f in FIXES] == list(dict.fromkeys(f.id for f in FIXES))
    assert {f.id for f in FIXES} == on_disk


@pytest.mark.parametrize("fix", FIXES, ids=lambda f: f.id)
def test_fix_metadata_is_complete(fix):
    assert re.fullmatch(r"F\d+", fix.id)
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", fix.slug)
    assert re.match(r"^\[[\w\]\[]+\] \S", fix.title), "vLLM PR style: [Tag] Subject"
    assert GITHUB.match(fix.bug)
    assert fix.pr == "" or GITHUB.match(fix.pr)
    assert fix.overlays and fix.tests
    if fix.upstream_since is not None:
        assert fix.pr, "a fix that landed upstream names its PR"
        assert fix.on(fix.upstream_since).need is _series.Need.UPSTREAM
        assert any(fix.on(Version(f"0.{m}.0")).needed for m in range(100))


# What, Why, How and Future: a few sentences each, a short read together (the length
# of export.details); the longer reasoning lives in the overlay's docstring.
FIELD_WORDS = range(20, 151)
FIX_WORDS = 250


@pytest.mark.parametrize("fix", FIXES, ids=lambda f: f.id)
def test_fix_text_is_short(fix):
    words = {name: len(getattr(fix, name).split()) for name in ("what", "why", "how", "future")}
    assert all(count in FIELD_WORDS for count in words.values()), (fix.id, words)
    assert sum(words.values()) <= FIX_WORDS, (fix.id, words)


@pytest.mark.parametrize("fix", FIXES, ids=lambda f: f.id)
def test_fix_tests_exist_and_stock_fails_name_them(fix):
    for test in (*fix.tests, *fix.stock_fails):
        path = test.split("::")[0]
        assert (REPO / path).is_file(), test
        assert path.startswith("tests/v1/") and Path(path).name.startswith("test_")
    assert fix.stock_fails, "a fix without a test that fails on stock proves nothing"
    for node in fix.stock_fails:
        assert node.split("::")[0] in fix.tests


def test_a_test_failing_for_another_bug_is_no_proof_of_upstream_there_only():
    """F21 is upstream from v0.26.0; on v0.30.0 one of its reproductions fails on stock
    for F18's bug, so the lanes expect it to fail there and take the rest as proof."""
    f21 = SERIES.fix("F21")
    other_bug = "test_the_request_is_reported_once_after_its_last_write"
    on_v030 = f21.upstream_proof_on(Version("0.30.0"))
    assert on_v030 and not any(node.endswith(other_bug) for node in on_v030)
    assert any(node.endswith(other_bug) for node in f21.stock_fails_on(Version("0.30.0")))
    assert f21.upstream_proof_on(Version("0.33.0")) == f21.stock_fails


def test_series_tests_exist_belong_to_no_fix_and_apply_on_a_lane():
    """Tests of the series as a whole (series.toml ``[series_tests]``): files of
    tests/v1, each ``stock_fails`` node one of them, none listed by a fix (a fix's
    tests travel with its export; these must not), and a lane runs them."""
    whole = _series.load().series_tests
    for test in (*whole.tests, *whole.stock_fails):
        path = test.split("::")[0]
        assert (REPO / path).is_file(), test
        assert path.startswith("tests/v1/") and Path(path).name.startswith("test_")
    assert whole.stock_fails and all(n.split("::")[0] in whole.tests for n in whole.stock_fails)
    assert not {t for fix in FIXES for t in fix.tests} & set(whole.tests)
    assert any(whole.applies(lane) for lane in _series.load().lanes)


@pytest.mark.parametrize("fix", [f for f in FIXES if f.upstream_tests], ids=lambda f: f.id)
def test_every_fixs_upstream_suites_run_on_a_lane(fix):
    """A narrow lane runs upstream's suites of the fixes that start there only: each
    fix's suites still run on some lane (series.toml, ``narrow_lanes``)."""
    assert any(fix in SERIES.suites_run_on(lane) for lane in SERIES.lanes), fix.id


def test_the_project_passes_ruff_check():
    """The tool, its tools, tests and benchmarks, and the overlays pass ruff check;
    overlays with what the overlay spec allows them (``_overlay``; pyproject.toml's
    per-file-ignores): upstream's names unimported, a class written once per fix and
    range. An unused import or a bug ruff sees fails."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--quiet",
                           "."], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize("fix", FIXES, ids=lambda f: f.id)
def test_every_listed_overlay_holds_definitions_of_the_fix(fix):
    for overlay in fix.overlays:
        parsed = Overlay.parse(_series.PACKAGE_DIR / overlay, overlay_files())
        assert fix.id in parsed.fixes(), f"{overlay} has no definition of {fix.id}"


@pytest.mark.parametrize("path", overlay_files(), ids=lambda p: str(p.relative_to(_series.PACKAGE_DIR)))
def test_every_overlay_belongs_to_listed_fixes(path):
    parsed = Overlay.parse(path, overlay_files())
    relative = str(path.relative_to(_series.PACKAGE_DIR))
    if not parsed.definitions:
        assert path.name == "__init__.py"
        return
    for fix_id in parsed.fixes():
        assert relative in SERIES.fix(fix_id).overlays, f"{fix_id} does not list {relative}"


@pytest.mark.parametrize("release", SERIES.covered, ids=str)
def test_each_covered_release_has_one_patch_per_needed_fix(release):
    listed = [patch.path for patch in PatchSet.load(SERIES, release).patches]
    needed = SERIES.applicable(release)
    assert [p.name for p in listed] == [
        f"{n:04d}-{fix.name}.patch" for n, fix in enumerate(needed, start=1)]
    for path in listed:
        assert path.is_file()
    text = (_patchset.release_dir(release) / _patchset.SERIES_FILE).read_text()
    for fix in SERIES.fixes:
        if fix not in needed:
            assert f"# {fix.name}: {fix.on(release)}" in text


def test_patches_dir_holds_exactly_the_covered_releases():
    on_disk = sorted(p.name for p in _patchset.patches_dir().iterdir() if p.is_dir())
    assert on_disk == sorted(f"v{release}" for release in SERIES.covered)


def test_ranges_read_lower_bound_first_everywhere(capsys):
    """`list` wrote <0.24.0,>=0.18.0 where the docs write >=0.18.0,<0.24.0
    (the matrix's legend, docs/supported-releases.md, which README links to)."""
    from vllm_patches._cli import main

    assert SERIES.fix("F1").describe_needed() == ">=0.18.0,<0.24.0"
    main(["list"])
    out = capsys.readouterr().out
    assert "needed on vLLM >=0.18.0,<0.24.0;" in out and "<0.24.0,>=0.18.0" not in out
    docs = "".join(path.read_text() for path in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    assert ">=0.18.0,<0.24.0" in docs and "<0.24.0,>=0.18.0" not in docs


# Every release a fix's range or a deselect's range can name (vLLM is 0.x: 0.0.0 .. 0.99.9).
VERSION_GRID = [Version(f"0.{minor}.{patch}") for minor in range(100) for patch in range(10)]


@pytest.mark.parametrize("fix", FIXES, ids=lambda f: f.id)
def test_required_fixes_come_first_and_are_there_wherever_the_fix_is(fix):
    """``requires``: the fixes this one is built on. They come earlier in the series (so
    there is no cycle, and patch k is generated on top of them), and wherever this fix
    is needed and requires one (from its ``requires_from`` on) that one is needed too or
    already upstream. That every requirement is declared is proven by exporting each
    fix alone (tests/tool/test_export.py)."""
    order = [f.id for f in FIXES]
    assert len(set(fix.requires)) == len(fix.requires)
    for required_id in fix.requires:
        required = SERIES.fix(required_id)
        assert order.index(required_id) < order.index(fix.id), f"{required_id} comes later"
        for version in VERSION_GRID:
            if fix.on(version).needed and required_id in fix.requires_on(version):
                assert required.on(version).need is not _series.Need.NOT_APPLICABLE, (
                    f"v{version} needs {fix.id} but not {required_id}: {required.on(version)}")


def test_a_requirement_holds_from_its_requires_from_on():
    """F20's patch meets F4's only where F4 hooks the same methods (v0.20.0 on)."""
    f20 = SERIES.fix("F20")
    assert [f.id for f in SERIES.with_requirements(f20, Version("0.18.1"))] == ["F20"]
    assert [f.id for f in SERIES.with_requirements(f20, Version("0.19.1"))] == ["F20"]
    assert [f.id for f in SERIES.with_requirements(f20, Version("0.20.0"))] == ["F4", "F20"]


def test_requires_from_names_only_required_fixes(tmp_path):
    path = tmp_path / "F20.toml"
    path.write_text((_series.PACKAGE_DIR / "fixes" / "F20.toml").read_text().replace(
        'requires_from = { F4 = "0.20.0" }', 'requires_from = { F3 = "0.20.0" }'))
    with pytest.raises(ValueError, match="requires_from names F3, which requires does not"):
        _series.Fix.load(path)


def test_with_requirements_follows_requirements_of_requirements():
    f1, f2, f3, f4 = FIXES[:4]
    chained = _series.Series(
        fixes=(f1, replace(f2, requires=("F1",)), replace(f3, requires=("F2",)), f4),
        lanes=SERIES.lanes, covered=SERIES.covered)
    newest = SERIES.newest
    assert [f.id for f in chained.with_requirements(chained.fix("F3"), newest)] == [
        "F1", "F2", "F3"]
    assert [f.id for f in SERIES.with_requirements(SERIES.fix("F3"), newest)] == ["F2", "F3"]
    assert [f.id for f in SERIES.with_requirements(SERIES.fix("F4"), newest)] == ["F4"]


@pytest.mark.parametrize("fix", FIXES, ids=lambda f: f.id)
def test_deselects_say_why_and_name_upstream_tests_of_needed_releases(fix):
    # A fix may change the expectation of another fix's upstream suite (F3 of F2's).
    upstream_files = {test.split("::")[0] for f in FIXES for test in f.upstream_tests}
    needed = [v for v in VERSION_GRID if fix.on(v).needed]
    for entry in (*fix.deselect, *fix.timing_sensitive):
        assert len(entry.why.split()) >= 3, f"{entry.node}: say why it is listed"
        path, _, name = entry.node.partition("::")
        assert name, f"{entry.node}: deselect test nodes, not whole files"
        assert path in upstream_files, f"{entry.node}: not under an upstream_tests file"
        assert any(v in entry.releases for v in needed), (
            f"{entry.node}: releases {entry.releases} meet none of {fix.id}'s "
            f"{fix.describe_needed()}")
    for version in needed:  # one entry per node and release, so each says one why
        nodes = [entry.node for entry in fix.deselect if version in entry.releases]
        assert len(nodes) == len(set(nodes)), f"v{version}: a node deselected twice"


def test_deselect_is_an_array_of_tables_scoped_by_release(tmp_path):
    base = (_series.PACKAGE_DIR / "fixes" / "F1.toml").read_text()
    node = "tests/v1/core/test_prefix_caching.py::test_x[a]"
    path = tmp_path / "F9.toml"
    path.write_text(base + f'''
[[deselect]]
node = "{node}"
releases = ">=0.21.0,<0.23.0"
why = "needs an accelerator"

[[deselect]]
node = "{node.replace('[a]', '[b]')}"
why = "loads real model weights"
''')
    fix = _series.Fix.load(path)
    assert fix.deselect[0].why == "needs an accelerator"
    assert fix.deselected(Version("0.18.1")) == [node.replace("[a]", "[b]")]
    assert fix.deselected(Version("0.21.0")) == [node, node.replace("[a]", "[b]")]
    path.write_text(base + f'deselect = {{"{node}" = "the old format"}}\n')
    with pytest.raises(TypeError, match="array of tables"):
        _series.Fix.load(path)
    path.write_text(base + f'[[deselect]]\nnode = "{node}"\nwhy = "w"\nrelease = ">=0.21"\n')
    with pytest.raises(ValueError, match="keys are node, releases, why"):
        _series.Fix.load(path)


def test_timing_sensitive_notes_name_a_test_or_all_its_parameters(tmp_path):
    base = (_series.PACKAGE_DIR / "fixes" / "F1.toml").read_text()
    path = tmp_path / "F9.toml"
    path.write_text(base + '''
[[timing_sensitive]]
node = "tests/v1/core/test_prefix_caching.py::TestX::test_y"
releases = "<0.30.0"
why = "a 2.5 s limit on a busy machine"
''')
    (note,) = _series.Fix.load(path).timing_sensitive_on(Version("0.21.0"))
    assert note.names("tests/v1/core/test_prefix_caching.py::TestX::test_y[1-1]")
    assert note.names("tests/v1/core/test_prefix_caching.py::TestX::test_y")
    assert not note.names("tests/v1/core/test_prefix_caching.py::TestX::test_yz")
    assert not _series.Fix.load(path).timing_sensitive_on(Version("0.30.0"))


def test_a_series_file_that_does_not_match_the_series_is_refused(tmp_path, monkeypatch):
    import shutil

    release = SERIES.default_release
    shutil.copytree(_patchset.release_dir(release), tmp_path / f"v{release}")
    monkeypatch.setattr(_patchset, "patches_dir", lambda: tmp_path)
    assert len(PatchSet.load(SERIES, release).patches) == len(SERIES.applicable(release))
    series_file = tmp_path / f"v{release}" / _patchset.SERIES_FILE
    lines = series_file.read_text().splitlines()
    series_file.write_text("\n".join(lines[:2] + lines[3:]) + "\n")  # a fix left out
    with pytest.raises(_series.UserError, match="does not match the series"):
        PatchSet.load(SERIES, release)


def test_the_newest_covered_release_is_the_one_upper_bound():
    """How far the series is verified is written once, `covered`'s last entry;
    it is a lane, and the supported range ends there."""
    assert SERIES.newest == SERIES.covered[-1] == SERIES.lanes[-1]
    assert SERIES.newest in SERIES.supported
    assert Version(f"{SERIES.newest.major}.{SERIES.newest.minor + 1}.0") not in SERIES.supported
    assert all(fix.on(SERIES.newest).need is not _series.Need.NOT_APPLICABLE for fix in FIXES)


def test_a_fix_says_where_it_is_needed_from_not_where_it_is_verified(tmp_path):
    text = (_series.PACKAGE_DIR / "fixes" / "F2.toml").read_text()
    assert 'releases = ">=0.18.0"\n' in text
    path = tmp_path / "F2.toml"
    path.write_text(text.replace('releases = ">=0.18.0"', 'releases = ">=0.18.0,<0.34.0"'))
    with pytest.raises(ValueError, match="says where the fix is needed from .* not <0.34.0"):
        _series.Fix.load(path)


def test_one_verdict_in_one_vocabulary():
    f1, f4 = SERIES.fix("F1"), SERIES.fix("F4")
    assert f1.on(Version("0.23.0")) == _series.Verdict(_series.Need.NEEDED)
    assert str(f1.on(Version("0.24.0"))) == "upstream since v0.24.0"
    assert str(f4.on(Version("0.18.1"))) == (
        "not applicable: needed on vLLM >=0.19.0, not on v0.18.1")


@pytest.mark.parametrize("fix", FIXES, ids=lambda f: f.id)
def test_an_upstream_test_a_fix_changes_is_amended_never_deselected(fix):
    """An upstream test whose expectation the fix changes is amended by a test overlay
    at its upstream path (the fix's patch carries the updated test), of this fix's
    definitions only; no [[deselect]] leaves an amended test out of a lane."""
    deselected = {entry.node.partition("[")[0] for f in FIXES for entry in f.deselect}
    for test in fix.test_overlays:
        parsed = Overlay.parse(_series.REPO_DIR / test)
        assert parsed.definitions and parsed.fixes() == {fix.id}, test
        for definition in parsed.definitions:
            assert f"{test}::{definition.name}" not in deselected, definition.name
