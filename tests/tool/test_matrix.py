"""The compatibility matrix, and its generated section (docs/supported-releases.md) kept in
sync with it."""

import dataclasses
import importlib.util

import pytest
from packaging.version import Version

from vllm_patches import _cli
from vllm_patches._catalog import cache as _cache
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.patchset import PatchSet
from vllm_patches._commands import matrix as _matrix
from vllm_patches._engine import patch_writer as _patch_writer
from vllm_patches._errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED, UserError

SERIES = _series.load()
DOC = _series.REPO_DIR / _matrix.DOC
SUPPORTED = SERIES.supported


def doc() -> str:
    return DOC.read_text()


def test_generated_section_lists_every_covered_release():
    rows = _matrix.generated_rows(doc())
    assert list(rows) == list(SERIES.covered)
    assert all(release in SUPPORTED for release in rows)
    for release, line in rows.items():
        assert line.endswith(" |") and line.count("|") == len(SERIES.fixes) + 2, line
        assert ("(lane)" in line) == (release in SERIES.lanes)


def committed_row(release: Version) -> _matrix.Row:
    """The row the committed patches give: `regen --check` (CI) proves they are what the
    overlays generate, so the generated rows follow from them without splicing again."""
    patched = {patch.fix.id for patch in PatchSet.load(SERIES, release).patches}
    cells = {}
    for fix in SERIES.fixes:
        verdict = fix.on(release)
        if fix.id in patched:
            cells[fix.id] = _matrix.Cell(_matrix.PATCH)
        else:
            assert not verdict.needed, f"v{release} needs {fix.id}: regen"
            cells[fix.id] = _matrix.Cell(verdict.need.value)
    return _matrix.Row(release, cells, release in SERIES.lanes)


@pytest.mark.parametrize("release", SERIES.covered, ids=str)
def test_generated_rows_match_the_committed_patches(release):
    assert _matrix.generated_rows(doc())[release] == _matrix.render_row(committed_row(release)), \
        "stale: run `vllm-patches matrix --write-readme`"
    assert _matrix.generated_notes(doc(), release) == []


def test_the_generated_row_of_the_default_lane_matches_the_committed_one(pristine_v0_21_0):
    release = SERIES.default_release
    row = _matrix.row(SERIES, release, _releases.fetch(release))
    assert _matrix.render_row(row) == _matrix.render_row(committed_row(release))


def test_a_release_of_the_range_that_is_not_covered_is_a_problem(capsys, monkeypatch):
    newer = Version("0.21.1")
    monkeypatch.setattr(_releases, "sdist_releases", lambda: [*SERIES.covered, newer,
                                                              Version("0.99.0")])
    monkeypatch.setattr(_matrix, "compute", lambda series, releases: [])
    assert _cli.main(["matrix"]) == EXIT_REFUSED
    out = capsys.readouterr().out
    assert "- v0.21.1 is on the package index but not covered: add it to `covered`" in out
    assert "v0.99.0" not in out


def test_generated_legend_matches_the_series():
    section = _matrix.SECTION.search(doc()).group(1)
    legend = _matrix.render(SERIES, []).split("\n\n", 1)[1]
    assert legend in section


def test_cells_for_a_lane_and_an_upstream_release(pristine_v0_21_0):
    row = _matrix.row(SERIES, Version("0.21.0"), pristine_v0_21_0)
    assert row.lane and row.cells["F1"] == _matrix.Cell(_matrix.PATCH)
    assert _matrix.render_row(row).startswith("| v0.21.0 (lane) | patch")


def test_a_fix_that_does_not_splice_is_a_conflict_and_later_fixes_still_get_a_cell(
        monkeypatch, pristine_v0_21_0):
    f1 = SERIES.fix("F1")
    f2 = dataclasses.replace(f1, id="F2", slug="second")
    f3 = dataclasses.replace(f1, id="F3", slug="third")
    series = _series.Series((f1, f2, f3), SERIES.lanes)

    def generate(series_, release, tree):
        ids = [f.id for f in series_.fixes]
        if "F2" in ids:
            raise UserError("v0.21.0 has no vllm/v1/core/gone.py (overlay v1/core/gone.py)")
        if ids[-1] == "F3" and len(ids) == 3:
            raise AssertionError("F3 must be tried without the conflicting F2")
        return []

    monkeypatch.setattr(_patch_writer, "generate", generate)
    row = _matrix.row(series, Version("0.21.0"), pristine_v0_21_0)
    assert [c.state for c in row.cells.values()] == ["patch", "conflict", "patch"]
    assert _matrix.render_notes(row) == [
        "- v0.21.0 F2 conflict: v0.21.0 has no vllm/v1/core/gone.py (overlay v1/core/gone.py)"]

    monkeypatch.setattr(_patch_writer, "generate", lambda *a: (_ for _ in ()).throw(
        UserError("F1 changes nothing on v0.21.0: no overlay variant holds it")))
    row = _matrix.row(series, Version("0.21.0"), pristine_v0_21_0)
    assert row.cells["F1"].state == _matrix.NO_VARIANT


def test_render_and_replace_section():
    rows = [_matrix.Row(Version("0.18.0"), {"F1": _matrix.Cell(_matrix.PATCH)}, False),
            _matrix.Row(Version("0.24.0"), {"F1": _matrix.Cell(_series.Need.UPSTREAM.value, "since")}, True)]
    series = _series.Series((SERIES.fix("F1"),), SERIES.lanes)
    section = _matrix.generated_section(series, rows)
    text = f"# x\n\nbefore\n\n{_matrix.BEGIN}\nold\n{_matrix.END}\n\nafter\n"
    replaced = _matrix.replace_section(text, section)
    assert replaced.startswith("# x\n\nbefore\n\n") and replaced.endswith("\n\nafter\n")
    assert "| v0.18.0 | patch |\n| v0.24.0 (lane) | upstream |\n" in replaced
    assert list(_matrix.generated_rows(replaced)) == [Version("0.18.0"), Version("0.24.0")]
    with pytest.raises(UserError, match="no <!-- matrix:begin -->"):
        _matrix.replace_section("no section", section)


def test_matrix_command_on_cached_releases(capsys, monkeypatch, pristine_v0_21_0):
    monkeypatch.setattr(_releases, "cached_releases", lambda: [Version("0.21.0"), Version("0.17.0")])
    code = _cli.main(["matrix", "--cached-only"])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert out.startswith("| vLLM | F1 ")
    assert "| v0.21.0 (lane) | patch |" in out and "v0.17.0" not in out
    code = _cli.main(["matrix", "--cached-only", "--write-readme"])
    assert code == EXIT_BAD_INPUT and "drop --cached-only" in capsys.readouterr().err


def test_matrix_command_exits_1_on_a_conflict(capsys, monkeypatch, pristine_v0_21_0):
    monkeypatch.setattr(_releases, "cached_releases", lambda: [Version("0.21.0")])
    monkeypatch.setattr(_patch_writer, "generate", lambda *a: (_ for _ in ()).throw(
        UserError("spliced vllm/x.py is not ruff-formatted")))
    assert _cli.main(["matrix", "--cached-only"]) == EXIT_REFUSED
    assert "- v0.21.0 F1 conflict: spliced vllm/x.py is not ruff-formatted" in \
        capsys.readouterr().out


def test_write_readme_writes_the_section_of_the_doc_that_holds_it(tmp_path, capsys, monkeypatch):
    """`--write-readme` keeps its name, but the table lives in docs/supported-releases.md
    (README links to it): that file's section is replaced, the text around it kept."""
    target = tmp_path / _matrix.DOC
    target.parent.mkdir()
    target.write_text(f"# Supported releases\n\n{_matrix.BEGIN}\nold\n{_matrix.END}\n\nafter\n")
    monkeypatch.setattr(_series, "REPO_DIR", tmp_path)
    monkeypatch.setattr(_releases, "sdist_releases", lambda: list(SERIES.covered))
    monkeypatch.setattr(_matrix, "compute",
                        lambda series, releases: [committed_row(r) for r in releases])
    assert _cli.main(["matrix", "--write-readme"]) == EXIT_OK
    assert f"wrote the matrix into {target}" in capsys.readouterr().out
    written = target.read_text()
    assert written.startswith("# Supported releases\n\n") and written.endswith("\n\nafter\n")
    assert _matrix.SECTION.search(written).group(0) == _matrix.SECTION.search(doc()).group(0)


# ------------------------------------------------- without the dev extras

NO_RUFF = ("vllm-patches: error: regen and matrix need ruff, from the dev extras: in a "
           "vllm-patches clone, python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'\n")


def never(*args):
    raise AssertionError("nothing may be read from the index or fetched")


@pytest.mark.parametrize("argv", [["matrix"], ["matrix", "--cached-only"], ["regen"],
                                  ["regen", "--release", "v0.33.0"]])
def test_without_ruff_matrix_and_regen_refuse_in_one_line_before_fetching(argv, capsys,
                                                                          monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "ruff" else find_spec(name, *rest))
    for name in ("sdist_releases", "fetch", "_index_files"):
        monkeypatch.setattr(_releases, name, never)
    monkeypatch.setattr(_releases, "cached_releases", lambda: list(SERIES.covered))
    assert _cli.main(argv) == EXIT_BAD_INPUT
    assert capsys.readouterr() == ("", NO_RUFF)


def test_matrix_says_up_front_how_much_it_will_download(capsys, monkeypatch, tmp_path):
    cached, archived, *missing = SERIES.covered
    monkeypatch.setenv("VLLM_PATCHES_CACHE", str(tmp_path))
    _releases.sdists_dir().mkdir(parents=True)
    (_releases.sdists_dir() / f"vllm-{archived}.tar.gz").write_bytes(b"downloaded")
    monkeypatch.setattr(_releases, "_index_files", lambda: [
        {"filename": f"vllm-{release}.tar.gz", "size": 40 << 20} for release in SERIES.covered])
    monkeypatch.setattr(_releases, "cached_releases", lambda: [cached])
    monkeypatch.setattr(_matrix, "compute", lambda series, releases: [])
    assert _cli.main(["matrix"]) == EXIT_OK
    err = capsys.readouterr().err
    assert err == (f"matrix: fetching {len(missing) + 1} releases not in the cache "
                   f"({_cache.human(len(missing) * 40 << 20)} to download; `--cached-only` "
                   "skips them)\n")

