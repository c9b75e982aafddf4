"""`vllm-patches export`: one fix as an upstream pull request, on real release trees.

A contributor's checkout is a clone of a release (v0.33.0, the newest lane), or a main
clone: the same tree without ``vllm/_version.py`` and without a release tag (upstream
main cannot be fetched here; that tree stands in for it).
"""

import hashlib
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from conftest import CONTRIBUTOR_EMAIL, CONTRIBUTOR_NAME, git, run, snapshot
from packaging.version import Version

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.patchset import PatchSet
from vllm_patches._commands import export as _export
from vllm_patches._errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED

SERIES = _series.load()
NEWEST = max(SERIES.lanes)
NAME, EMAIL = CONTRIBUTOR_NAME, CONTRIBUTOR_EMAIL
SIGN_OFF = f"Signed-off-by: {NAME} <{EMAIL}>"
# A fix that needs another one, and the newest lane where that shows.
DEPENDENT = next(fix for fix in SERIES.fixes if fix.requires_on(NEWEST) and fix.on(NEWEST).needed)


@pytest.fixture(scope="session")
def pristine_newest() -> Path:
    return _releases.fetch(NEWEST)


def clone(source: Path, target: Path, main_like: bool) -> Path:
    subprocess.run(["git", "clone", "--quiet", str(source), str(target)], check=True)
    if main_like:
        git(target, "rm", "--quiet", "vllm/_version.py")
        git(target, "-c", "user.name=upstream", "-c", "user.email=upstream@example.invalid",
            "commit", "--quiet", "-m", "main")
        git(target, "tag", "-d", f"v{NEWEST}")
    return target


@pytest.fixture(params=[False, True], ids=["release-clone", "main-clone"])
def any_clone(request, tmp_path, pristine_newest) -> Path:
    """A contributor's clone: of the release, or of main (checked with both)."""
    return clone(pristine_newest, tmp_path / "vllm", main_like=request.param)


@pytest.fixture
def vllm_clone(tmp_path, pristine_newest) -> Path:
    return clone(pristine_newest, tmp_path / "vllm", main_like=False)


def git_state(repo: Path) -> tuple[tuple[str, str, str], str]:
    """``snapshot`` (HEAD, status, local changes), the index's entries and a hash of every
    file under .git but the index file itself (``git status`` may refresh its stat data)."""
    digest = hashlib.sha256(git(repo, "ls-files", "--stage").encode())
    for path in sorted(p for p in (repo / ".git").rglob("*") if p.is_file()):
        if path.name != "index":
            digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes())
    return snapshot(repo), digest.hexdigest()


def subjects(repo: Path, since: str) -> list[str]:
    return git(repo, "log", "--reverse", "--format=%s", f"{since}..HEAD").splitlines()


@pytest.mark.parametrize("release", SERIES.lanes, ids=str)
def test_every_fix_exports_alone_with_what_it_requires(release, contributor):
    """Each fix's series applies on the pristine release by itself: its requirements
    (``requires``) are all it needs. Every patch holds the fix's tests."""
    tree = _releases.fetch(release)
    before = git_state(tree)
    identity = _export.Contributor.of(contributor)
    for fix in SERIES.applicable(release):
        export = _export.build(SERIES, fix, release, tree, identity)
        assert export.applies, [step.line() for step in export.steps]
        assert [f.id for f in export.fixes] == [f.id for f in SERIES.with_requirements(fix, release)
                                                if f.on(release).needed]
        for (name, text), each in zip(export.patches, export.fixes, strict=True):
            total = len(export.fixes)
            number = "" if total == 1 else f" {export.fixes.index(each) + 1}/{total}"
            assert f"Subject: [PATCH{number}] {each.title[:40]}" in text.replace("\n ", " ")
            assert f"From: {NAME} <{EMAIL}>" in text and SIGN_OFF in text
            for test in each.tests:
                assert f"create mode 100644 {test}" in text
            assert "Vllm-Patches-Fix" not in text and "Origin:" not in text
    assert git_state(tree) == before, "export wrote into the release's cached checkout"


def test_exported_series_git_am_cleanly_with_tags_sign_off_and_tests(contributor, any_clone,
                                                                     capsys):
    base = git(any_clone, "rev-parse", "HEAD").strip()
    for fix in SERIES.applicable(NEWEST):
        output = contributor / f"out-{fix.id}"
        code, out, _ = run(capsys, "export", fix.id, "--release", f"v{NEWEST}", "-o", str(output))
        assert code == EXIT_OK
        am_line = next(line for line in out.splitlines() if "git am --keep-non-patch" in line)
        patches = am_line.split("git am --keep-non-patch ")[1].split()
        fixes = [f for f in SERIES.with_requirements(fix, NEWEST) if f.on(NEWEST).needed]
        assert len(patches) == len(fixes)
        cover = (output / _export.COVER_FILE).read_text()
        title = fix.series_title if len(fixes) > 1 else fix.title
        assert (output / _export.TITLE_FILE).read_text() == title + "\n"
        assert "```bash\npytest -q " in cover
        assert f"#{fix.pr.rsplit('/', 1)[-1]}" in cover or fix.bug in cover
        assert f"v{NEWEST} (upstream commit " in cover

        git(any_clone, "am", "--quiet", "--keep-non-patch", *patches)
        assert subjects(any_clone, base) == [f.title for f in fixes]
        authors = git(any_clone, "log", "--format=%an <%ae>", f"{base}..HEAD").splitlines()
        assert authors == [f"{NAME} <{EMAIL}>"] * len(fixes)
        assert SIGN_OFF in git(any_clone, "log", "-1", "--format=%b")
        tests = [t for f in fixes for t in f.tests]
        for test in tests + _export.test_helpers(tests):
            assert (any_clone / test).read_text() == (_series.REPO_DIR / test).read_text()
        git(any_clone, "reset", "--quiet", "--hard", base)


def test_the_tests_helper_modules_are_shipped_with_them():
    """The modules beside a fix's tests that they import and this repository has go
    with them; upstream's own (utils.py) and other test modules do not."""
    push_test = "tests/v1/kv_connector/unit/test_nixl_push_aborted_child.py"
    assert _export.test_helpers([push_test]) == [
        "tests/v1/kv_connector/unit/nixl_harness.py"]
    assert _export.test_helpers(["tests/v1/core/test_two_phase_allocation.py"]) == []
    for fix in SERIES.fixes:
        export = _export.Export(fix, (fix,), (), NEWEST, "", (), ())
        for helper in _export.test_helpers(fix.tests):
            assert not Path(helper).name.startswith("test_")
            assert helper in export.touched()  # a dirty one is refused


def test_stdout_is_an_mbox_for_git_am(contributor, vllm_clone, capsys):
    code, out, err = run(capsys, "export", DEPENDENT.id, "--release", f"v{NEWEST}")
    assert code == EXIT_OK
    assert f"{DEPENDENT.id} requires" in err and "git am --keep-non-patch" in err
    total = len(SERIES.with_requirements(DEPENDENT, NEWEST))
    assert out.count("\nSubject: [PATCH ") == total and f"[PATCH {total}/{total}]" in out
    base = git(vllm_clone, "rev-parse", "HEAD").strip()
    subprocess.run(["git", "-C", str(vllm_clone), "am", "--quiet", "--keep-non-patch"],
                   input=out, text=True, check=True)
    assert subjects(vllm_clone, base)[-1] == DEPENDENT.title


def test_a_single_patch_is_not_numbered(contributor, capsys):
    fix = next(f for f in SERIES.applicable(NEWEST) if not f.requires_on(NEWEST))
    code, out, _ = run(capsys, "export", fix.id, "--release", f"v{NEWEST}")
    assert code == EXIT_OK
    assert f"Subject: [PATCH] {fix.title[:30]}" in out.replace("\n ", " ")


def test_onto_applies_signed_off_commits_on_the_branch(contributor, any_clone, capsys):
    vllm_clone = any_clone
    base = git(vllm_clone, "rev-parse", "HEAD").strip()
    before = git_state(vllm_clone)
    code, out, _ = run(capsys, "export", DEPENDENT.id, "--onto", str(vllm_clone), "--check")
    assert code == EXIT_OK and "check passed" in out
    assert git_state(vllm_clone) == before
    fixes = SERIES.with_requirements(DEPENDENT, NEWEST)
    for number, fix in enumerate(fixes, start=1):
        assert f"{number}/{len(fixes)} {fix.id} {fix.slug}: applies" in out

    code, out, _ = run(capsys, "export", DEPENDENT.id, "--onto", str(vllm_clone))
    assert code == EXIT_OK, out
    assert subjects(vllm_clone, base) == [f.title for f in fixes]
    assert SIGN_OFF in git(vllm_clone, "log", "-1", "--format=%b")
    assert git(vllm_clone, "status", "--porcelain") == ""
    assert f"the PR title: {DEPENDENT.series_title}" in out
    assert "- [x] " in out and "pytest -q " in out  # the PR description, ready to paste
    if not (vllm_clone / "vllm" / "_version.py").exists():
        assert f"using the v{NEWEST} patches" in out


def release_patch(fix) -> Path:
    return next(p.path for p in PatchSet.load(SERIES, NEWEST).patches if p.fix == fix)


def test_onto_a_conflict_is_reported_per_patch_and_changes_nothing(contributor, vllm_clone,
                                                                   capsys):
    """A local commit changed a line the first patch changes: no merge can help."""
    first = SERIES.fix(DEPENDENT.requires[0])
    # The first line the patch removes, and the file it is in.
    target = removed = ""
    for line in release_patch(first).read_text().splitlines():
        if line.startswith("+++ b/"):
            target = line[6:]
        elif target and line.startswith("-") and not line.startswith("---") and line[1:].strip():
            removed = line[1:]
            break
    source = vllm_clone / target
    source.write_text(source.read_text().replace(removed, removed + "  # edited", 1))
    git(vllm_clone, "commit", "--quiet", "-am", "a local change where the series writes")
    before = git_state(vllm_clone)
    for extra in ([], ["--3way"], ["--check"]):
        code, out, err = run(capsys, "export", DEPENDENT.id, "--onto", str(vllm_clone), *extra)
        assert code == EXIT_REFUSED, extra
        assert f"1/2 {first.id} {first.slug}: conflict" in out
        assert f"2/2 {DEPENDENT.id} {DEPENDENT.slug}: not tried (needs {first.id})" in out
        assert len(err.strip().splitlines()) == 1 and "does not apply" in err
        assert git_state(vllm_clone) == before


def test_onto_a_checkout_that_has_the_fix_already_is_refused(contributor, vllm_clone, capsys):
    fix = next(f for f in SERIES.applicable(NEWEST) if not f.requires_on(NEWEST))
    git(vllm_clone, "am", "--quiet", "--keep-non-patch", str(release_patch(fix)))
    before = git_state(vllm_clone)
    for extra in ([], ["--3way"]):
        code, out, _ = run(capsys, "export", fix.id, "--onto", str(vllm_clone), *extra)
        assert code == EXIT_REFUSED and f"1/1 {fix.id} {fix.slug}: conflict" in out
        assert git_state(vllm_clone) == before
    assert "the base has it already" in out


def test_onto_three_way_merges_an_edited_context_line(contributor, vllm_clone, capsys):
    fix = next(f for f in SERIES.applicable(NEWEST) if not f.requires_on(NEWEST))
    lines = release_patch(fix).read_text().splitlines()
    target = next(line[6:] for line in lines if line.startswith("+++ b/"))
    # The first line of the first hunk: context, three lines away from the change.
    context = lines[lines.index(next(line for line in lines if line.startswith("@@"))) + 1]
    assert context.startswith(" ") and context.strip()
    source = vllm_clone / target
    text = source.read_text()
    assert text.count(context[1:] + "\n") == 1
    source.write_text(text.replace(context[1:] + "\n", context[1:] + "  # local\n"))
    git(vllm_clone, "commit", "--quiet", "-am", "edit a context line")
    before = git_state(vllm_clone)
    code, out, _ = run(capsys, "export", fix.id, "--onto", str(vllm_clone))
    assert code == EXIT_REFUSED and git_state(vllm_clone) == before
    code, out, _ = run(capsys, "export", fix.id, "--onto", str(vllm_clone), "--3way")
    assert code == EXIT_OK, out
    assert subjects(vllm_clone, "HEAD~1") == [fix.title]
    assert context[1:] + "  # local" in source.read_text()


@pytest.mark.parametrize("state", ["am-in-progress", "staged", "dirty", "untracked-test"])
def test_onto_refuses_a_busy_or_dirty_checkout_and_leaves_it_as_it_was(
        state, contributor, vllm_clone, capsys):
    fix = next(f for f in SERIES.applicable(NEWEST) if not f.requires_on(NEWEST))
    if state == "am-in-progress":
        (vllm_clone / "README.md").write_text("local\n")
        git(vllm_clone, "commit", "--quiet", "-am", "readme")
        mail = git(vllm_clone, "format-patch", "--stdout", "-1")
        git(vllm_clone, "reset", "--quiet", "--hard", "HEAD~1")
        (vllm_clone / "README.md").write_text("conflicting\n")
        git(vllm_clone, "commit", "--quiet", "-am", "conflicting readme")
        subprocess.run(["git", "-C", str(vllm_clone), "am"], input=mail, text=True,
                       capture_output=True, check=False)  # stops at the conflict
        assert (vllm_clone / ".git" / "rebase-apply").is_dir()
        message = "in progress"
    elif state == "staged":
        (vllm_clone / "README.md").write_text("local\n")
        git(vllm_clone, "add", "README.md")
        message = "staged changes"
    else:
        path = (vllm_clone / fix.tests[0] if state == "untracked-test"
                else vllm_clone / _series.Fix.upstream_path(fix.overlays[0]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("local\n")
        message = "local changes or untracked files"
    before = git_state(vllm_clone)
    code, _, err = run(capsys, "export", fix.id, "--onto", str(vllm_clone))
    assert code == EXIT_REFUSED and message in err and len(err.strip().splitlines()) == 1
    assert git_state(vllm_clone) == before


def test_no_git_identity_is_refused_in_one_line(tmp_path, monkeypatch, vllm_clone, capsys):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for variable in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
                     "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)
    before = git_state(vllm_clone)
    for argv in (["export", "F4", "--release", f"v{NEWEST}"],
                 ["export", "F4", "--onto", str(vllm_clone)]):
        code, out, err = run(capsys, *argv)
        assert code == EXIT_REFUSED and out == ""
        assert "no git identity" in err and len(err.strip().splitlines()) == 1
    assert git_state(vllm_clone) == before


def test_bad_input(contributor, capsys, tmp_path):
    code, _, err = run(capsys, "export", "F99")
    assert code == EXIT_BAD_INPUT and "unknown fix" in err
    code, _, err = run(capsys, "export", "F4", "--3way")
    assert code == EXIT_BAD_INPUT and "--onto" in err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "old.patch").write_text("")
    code, _, err = run(capsys, "export", "F4", "-o", str(occupied))
    assert code == EXIT_BAD_INPUT and "not an empty directory" in err


# What upstream has never seen: this project's fix ids and its name.
PROJECT_WORDS = re.compile(r"\bF\d+\b|vllm[-_]patches", re.IGNORECASE)


def export_dir(capsys, tmp_path, fix, *extra: str, name: str = "") -> tuple[Path, str]:
    """``export FIX EXTRA -o DIR``: DIR and what export printed."""
    output = tmp_path / (name or f"out-{fix.id}")
    code, out, err = run(capsys, "export", fix.id, *extra, "-o", str(output))
    assert code == EXIT_OK, out + err
    return output, out


def test_what_export_writes_is_in_upstreams_words(contributor, tmp_path, capsys):
    """Commit messages, diffs (overlay docstrings, fix tests), PR title and description of
    every fix's series name no fix id and not this project: they come from metadata
    written for upstream, which the same rule holds for (a fix no lane exports too)."""
    for fix in SERIES.fixes:
        words = [text for t in fix.pr_texts for text in (t.purpose, t.details)]
        for field in (fix.title, fix.why, fix.how, fix.pr_title, *words,
                      fix.pr_relation):
            assert not PROJECT_WORDS.search(field), (fix.id, PROJECT_WORDS.search(field))
    for fix in SERIES.applicable(NEWEST):
        output, _ = export_dir(capsys, tmp_path, fix, "--release", f"v{NEWEST}")
        for path in output.iterdir():
            # A diff's index line holds blob ids, not words ("index 2889a8b..f090471").
            text = "\n".join(line for line in path.read_text().splitlines()
                             if not line.startswith("index "))
            found = PROJECT_WORDS.search(text)
            assert not found, f"{path.name}: {found.group()!r}"


def template_checklist(template: str) -> list[str]:
    return [line[6:] for line in template.splitlines() if line.startswith("- [ ] ")]


@pytest.mark.parametrize("release", [r for r in SERIES.lanes if DEPENDENT.on(r).needed],
                         ids=str)
def test_the_description_is_the_bases_template_filled_in(release, contributor, tmp_path,
                                                         capsys):
    """Upstream's sections in its order (they changed in v0.32), a purpose of a line or
    two first, no instruction left where export wrote, and the checklist block with the
    items the description does what they ask ticked, the others left."""
    template = (_releases.fetch(release) / _export.TEMPLATE).read_text()
    output, _ = export_dir(capsys, tmp_path, DEPENDENT, "--release", f"v{release}")
    cover = (output / _export.COVER_FILE).read_text()
    headings = [line for line in cover.splitlines() if line.startswith("## ")]
    assert headings == [line for line in template.splitlines() if line.startswith("## ")]
    assert "PLEASE FILL IN" not in cover and "<!-- Summarize" not in cover
    summary = next(line for line in template.splitlines() if line.startswith("<summary>"))
    assert summary in cover
    assert cover.rstrip().endswith(template.rstrip().splitlines()[-1])  # BEFORE SUBMITTING
    items = template_checklist(template)
    ticked = [item.startswith(_export.FULFILLED) for item in items]
    assert any(ticked) and not all(ticked)
    for item, tick in zip(items, ticked, strict=True):
        assert f"- [{'x' if tick else ' '}] {item}" in cover
    purpose = cover.split(headings[0] + "\n\n")[1].split("\n\n")[0]
    words = DEPENDENT.on(release).words
    assert words is not None and purpose == " ".join(words.purpose.split())
    for fix in SERIES.with_requirements(DEPENDENT, NEWEST):
        assert fix.title.rpartition("] ")[2] in cover
    assert "```bash\npytest -q " + SERIES.with_requirements(DEPENDENT, NEWEST)[0].tests[0] in cover


def test_the_template_is_the_bases_own(contributor, vllm_clone, tmp_path, capsys):
    """A base whose template has another section and item: those are kept (the section
    left to the contributor, said so); a base with none gets upstream's sections."""
    fix = next(f for f in SERIES.applicable(NEWEST) if not f.requires_on(NEWEST))
    path = vllm_clone / _export.TEMPLATE
    template = path.read_text().replace("\n---\n", "\n## AI Assistance\n\n---\n", 1).replace(
        "</details>", "- [ ] The AI assistance used, if any.\n</details>")
    path.write_text(template)
    git(vllm_clone, "commit", "--quiet", "-am", "template")
    output, out = export_dir(capsys, tmp_path, fix, "--onto", str(vllm_clone), "--check")
    cover = (output / _export.COVER_FILE).read_text()
    assert cover.count("## AI Assistance\n\n---\n") == 1
    assert "- [ ] The AI assistance used, if any." in cover
    assert "the template's section 'AI Assistance' is yours to fill in" in out
    git(vllm_clone, "rm", "--quiet", _export.TEMPLATE)
    git(vllm_clone, "commit", "--quiet", "-m", "no template")
    output, out = export_dir(capsys, tmp_path, fix, "--onto", str(vllm_clone), "--check",
                             name="bare")
    assert f"the base has no {_export.TEMPLATE}" in out
    cover = (output / _export.COVER_FILE).read_text()
    assert [line for line in cover.splitlines() if line.startswith("## ")] == [
        f"## {name}" for name in _export.TEMPLATE_SECTIONS]
    assert "- [" not in cover


def test_a_series_is_titled_for_the_series(contributor, tmp_path, capsys):
    """The PR of a fix that brings others is not titled by its last commit: the title
    covers the series (``export.title``, which a fix that requires others must have)."""
    output, _ = export_dir(capsys, tmp_path, DEPENDENT, "--release", f"v{NEWEST}")
    title = (output / _export.TITLE_FILE).read_text().strip()
    assert title == DEPENDENT.pr_title
    assert title not in {f.title for f in SERIES.with_requirements(DEPENDENT, NEWEST)}
    single = next(f for f in SERIES.applicable(NEWEST) if not f.requires_on(NEWEST))
    assert single.series_title == single.title


@pytest.mark.parametrize(("key", "message"), [
    ("title", "export.title is required exactly when the fix requires others"),
    ("relation", "export.relation (one line: does the series supersede or complement"),
    ("purpose", "export.purpose (the PR's purpose, one or two sentences) is missing"),
    ("details", "export.details (root cause and design, a few sentences) is missing"),
])
def test_pull_request_metadata_is_checked(key, message, tmp_path):
    """A series of several commits needs its own title, a fix whose upstream PR is open
    must say how it relates to it, and every fix needs its PR's purpose."""
    path = _series.PACKAGE_DIR / "fixes" / f"{DEPENDENT.id}.toml"
    data = tomllib.loads(path.read_text())
    del data["export"][key]
    with pytest.raises(ValueError, match=re.escape(message)):
        _series._pull_request_fields(data, path)


def test_the_description_says_how_the_series_relates_to_the_open_pr(contributor, tmp_path,
                                                                     capsys):
    """A fix whose upstream PR is still open says, in one line, whether the series
    supersedes or complements it."""
    open_pr = [f for f in SERIES.applicable(NEWEST) if f.pr and not f.upstream_since]
    assert open_pr
    for fix in open_pr:
        output, _ = export_dir(capsys, tmp_path, fix, "--release", f"v{NEWEST}")
        cover = (output / _export.COVER_FILE).read_text()
        number = fix.pr.rsplit("/", 1)[-1]
        (line,) = [line for line in cover.splitlines() if f"#{number}" in line]
        assert re.match(rf"(Supersedes|Complements) .*#{number}", line), line


def test_onto_an_archive_clone_names_the_upstream_commit_not_its_own(contributor, any_clone,
                                                                     tmp_path, capsys):
    """A clone of a release's source archive (as fetch makes it) has a HEAD upstream
    never saw: the description names the commit the release was built from, and no
    patch says base-commit. A clone of upstream's git (main) has a HEAD upstream knows:
    its patches carry base-commit."""
    head = git(any_clone, "rev-parse", "HEAD").strip()
    output, _ = export_dir(capsys, tmp_path, DEPENDENT, "--onto", str(any_clone), "--check")
    patches = [p.read_text() for p in sorted(output.glob("*.patch"))]
    cover = (output / _export.COVER_FILE).read_text()
    if (any_clone / "vllm" / "_version.py").exists():
        upstream = _releases.upstream_commit(any_clone)
        assert upstream and f"v{NEWEST} (upstream commit {upstream})" in cover
        assert head[:12] not in cover and not any("base-commit:" in p for p in patches)
    else:
        assert f"commit {head[:12]}" in cover
        assert f"base-commit: {head}" in patches[0]  # git format-patch: the first message


# What a reviewer reads in two minutes: the words export writes into the template's
# sections (its checklist and notes not counted), and an overview of a line or two.
DESCRIPTION_WORDS = 450
OVERVIEW_WORDS = 70


def written_sections(cover: str) -> dict[str, str]:
    """Each ``## `` section of a description and its text, up to the checklist."""
    body = cover.split("\n---\n")[0]
    return {part.partition("\n")[0]: part.partition("\n")[2].strip()
            for part in body.split("\n## ")[1:]}


@pytest.mark.parametrize("release", [min(SERIES.lanes), NEWEST], ids=str)
def test_every_description_is_short_and_in_the_templates_sections(release, contributor,
                                                                   tmp_path, capsys):
    """Every fix's description has its base's sections, each filled, an overview of a
    line or two first, and fits a two-minute read; the long reasoning is in the commit
    messages, not here."""
    template = (_releases.fetch(release) / _export.TEMPLATE).read_text()
    headings = [line[3:] for line in template.splitlines() if line.startswith("## ")]
    for fix in SERIES.applicable(release):
        output, _ = export_dir(capsys, tmp_path, fix, "--release", f"v{release}",
                               name=f"{fix.id}-{release}")
        cover = (output / _export.COVER_FILE).read_text()
        sections = written_sections(cover)
        assert list(sections) == headings and all(sections.values()), (fix.id, sections)
        words = sum(len(text.split()) for text in sections.values())
        assert words <= DESCRIPTION_WORDS, (fix.id, words)
        overview = sections[headings[0]].split("\n\n")[0]
        assert len(overview.split()) <= OVERVIEW_WORDS, (fix.id, overview)
        assert fix.why not in cover and " ".join(fix.how.split()) not in cover
        assert "<details>" not in cover.split("\n---\n")[0]


def test_the_words_are_true_for_the_base_release(contributor, tmp_path, capsys):
    """Up to v0.21 the producer releases a request's KV at an abort timeout (480 s);
    from v0.22 by lease (kv_lease_duration). The description of each base says the one
    its release has: ``Fix.on`` picks the words, as it decides everything else."""
    for fix in (f for f in SERIES.fixes if len(f.pr_texts) > 1):
        for release, says, never in ((Version("0.21.0"), "480 s", "lease"),
                                     (NEWEST, "lease", "480 s")):
            output, _ = export_dir(capsys, tmp_path, fix, "--release", f"v{release}",
                                   name=f"{fix.id}-{release}")
            sections = written_sections((output / _export.COVER_FILE).read_text())
            overview = next(iter(sections.values())).split("\n\n")[0]
            assert says in overview and never not in overview, (fix.id, release, overview)


def test_fixes_is_said_of_issues_only(contributor, tmp_path, capsys):
    """``Fixes #N`` closes issue N on merge; a PR the fix relates to is named in the
    relation line (supersedes, complements), never as fixed."""
    for fix in SERIES.applicable(NEWEST):
        output, _ = export_dir(capsys, tmp_path, fix, "--release", f"v{NEWEST}")
        cover = (output / _export.COVER_FILE).read_text()
        for number in re.findall(r"Fixes #(\d+)", cover):
            assert fix.bug.endswith(f"/issues/{number}"), (fix.id, number)
        if _series.is_pull_request(fix.bug):
            number = fix.bug.rsplit("/", 1)[1]
            assert f"Fixes #{number}" not in cover and "/pull/" not in cover
            relation = rf"^(Supersedes|Complements) .*#{number}\b"
            assert re.search(relation, cover, re.MULTILINE), fix.id


def test_a_fix_upstream_on_the_base_is_refused_in_one_line(contributor, vllm_clone,
                                                            tmp_path, capsys):
    """Upstream has it: nothing to send, on a release or onto a checkout of one."""
    fix = next(f for f in SERIES.fixes if f.upstream_since and f.upstream_since <= NEWEST)
    before = git_state(vllm_clone)
    for argv in (["--release", f"v{NEWEST}"], ["--onto", str(vllm_clone)]):
        code, _, err = run(capsys, "export", fix.id, *argv, "-o", str(tmp_path / "x"))
        assert code == EXIT_REFUSED and not (tmp_path / "x").exists(), argv
        assert len(err.strip().splitlines()) == 1, err
        assert f"{fix.id} is upstream on v{NEWEST}" in err
        assert f"since v{fix.upstream_since}" in err
    assert git_state(vllm_clone) == before


def test_a_fix_before_the_release_that_has_it_is_a_backport(contributor, tmp_path, capsys):
    """Exporting onto an older release is legitimate, and says in one line that the PR
    is a backport of what upstream has had since its release."""
    fix = next(f for f in SERIES.fixes if f.upstream_since)
    release = max(r for r in SERIES.covered if fix.on(r).needed)
    output, out = export_dir(capsys, tmp_path, fix, "--release", f"v{release}")
    (line,) = [line for line in out.splitlines() if "backport" in line]
    assert f"since v{fix.upstream_since}" in line and f"v{release}" in line
    branch = f"v{release.major}.{release.minor} release branch, not main"
    assert branch in line
    cover = (output / _export.COVER_FILE).read_text()
    assert f"Backport to v{release} of #{fix.pr.rsplit('/', 1)[1]}" in cover and branch in cover


def test_an_upstream_test_the_series_changes_is_updated_in_its_patch(contributor, tmp_path,
                                                                     capsys):
    """The series carries, as a small change of upstream's own test module (not a copy
    of it), each upstream test whose expectation it changes; the description says so."""
    fix = next(f for f in SERIES.applicable(NEWEST)
               if any(each.test_overlays for each in SERIES.with_requirements(f, NEWEST)))
    output, _ = export_dir(capsys, tmp_path, fix, "--release", f"v{NEWEST}")
    patches = "".join(p.read_text() for p in sorted(output.glob("*.patch")))
    cover = (output / _export.COVER_FILE).read_text()
    for test in (t for f in SERIES.with_requirements(fix, NEWEST) for t in f.test_overlays):
        diff = patches.split(f"diff --git a/{test} b/{test}\n")[1].split("\ndiff --git")[0]
        assert "new file mode" not in diff
        changed = [line for line in diff.splitlines()[3:] if line[:1] in "+-"]
        assert 0 < len(changed) < 30, len(changed)
        export = _export.build(SERIES, fix, NEWEST, _releases.fetch(NEWEST),
                               _export.Contributor.of(contributor))
        for name in export.amended_tests:
            assert f"def {name}(" in diff and f"`{name}`" in cover
