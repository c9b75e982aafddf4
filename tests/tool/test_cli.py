"""The vllm-patches verbs on a real vLLM v0.21.0 checkout: what they do, and that
every refusal leaves the checkout exactly as it was."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import git, run, snapshot

from vllm_patches._catalog import series as _series
from vllm_patches._errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED

SERIES = _series.load()
RELEASE = _series.Version("0.21.0")
# The committed patches of RELEASE in order, as quilt's series file lists them.
PATCHES = [_series.PATCHES_DIR / f"v{RELEASE}" / line for line in
           (_series.PATCHES_DIR / f"v{RELEASE}" / "series").read_text().splitlines()
           if line and not line.startswith("#")]

COORDINATOR = "vllm/v1/core/kv_cache_coordinator.py"
# A context line of F1's first hunk in the coordinator (not a line F1 changes).
CONTEXT_LINE = "            num_local_computed_tokens: The number of local computed tokens."


def test_status_on_stock_says_applicable(checkout, capsys):
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_OK
    assert "vLLM v0.21.0" in out
    assert "F1" in out and "applicable" in out


def test_apply_commits_the_series_and_revert_undoes_it(checkout, capsys):
    base = git(checkout, "rev-parse", "HEAD")
    code, out, _ = run(capsys, "apply", str(checkout))
    assert code == EXIT_OK, out
    subjects = git(checkout, "log", "--reverse", "--format=%s", f"{base.strip()}..HEAD")
    assert subjects.splitlines() == [fix.title for fix in SERIES.applicable(RELEASE)]
    assert "def add_local_computed_blocks" in (checkout / "vllm/v1/core/single_type_kv_cache_manager.py").read_text()
    assert "applied" in run(capsys, "status", str(checkout))[1]

    code, out, _ = run(capsys, "apply", str(checkout))
    assert code == EXIT_OK and "nothing to apply" in out

    code, out, _ = run(capsys, "revert", str(checkout))
    assert code == EXIT_OK, out
    assert git(checkout, "diff", base.strip(), "HEAD") == ""
    assert git(checkout, "status", "--porcelain") == ""


def test_apply_no_commit_changes_only_the_work_tree(checkout, capsys):
    head = git(checkout, "rev-parse", "HEAD")
    index = git(checkout, "ls-files", "--stage")
    code, _, _ = run(capsys, "apply", "--no-commit", str(checkout))
    assert code == EXIT_OK
    assert git(checkout, "rev-parse", "HEAD") == head
    assert git(checkout, "ls-files", "--stage") == index
    assert COORDINATOR in git(checkout, "status", "--porcelain")
    # The series is in the work tree: a committing apply is refused, not re-applied.
    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "applied in the work tree but not committed" in err
    assert "revert --no-commit" in err
    assert snapshot(checkout) == before


def test_no_commit_apply_is_seen_by_status_and_undone_by_no_commit_revert(checkout, capsys):
    """After `apply --no-commit`, status and apply said "applicable"
    and `revert --no-commit` refused (uncommitted changes)."""
    code, out, _ = run(capsys, "apply", "--no-commit", str(checkout))
    assert code == EXIT_OK
    assert " applicable (0" not in out and out.count("applied, not committed") == len(PATCHES)
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_OK and out.count("applied, not committed") == len(PATCHES)
    code, out, _ = run(capsys, "apply", "--no-commit", str(checkout))
    assert code == EXIT_OK and "nothing to apply" in out
    code, out, _ = run(capsys, "revert", "--no-commit", str(checkout))
    assert code == EXIT_OK, out
    assert git(checkout, "status", "--porcelain") == ""
    code, out, _ = run(capsys, "status", str(checkout))
    assert out.count(" applicable (0") == len(PATCHES)
    # The other way round: committed, then reverted in the work tree only.
    assert run(capsys, "apply", str(checkout))[0] == EXIT_OK
    code, out, _ = run(capsys, "revert", "--no-commit", str(checkout))
    assert code == EXIT_OK and out.count("reverted, not committed") == len(PATCHES)
    before = snapshot(checkout)
    code, _, err = run(capsys, "revert", str(checkout))
    assert code == EXIT_REFUSED and "reverted in the work tree but not committed" in err
    assert snapshot(checkout) == before
    code, out, _ = run(capsys, "apply", "--no-commit", str(checkout))
    assert code == EXIT_OK and git(checkout, "status", "--porcelain") == ""


def test_check_modes_change_nothing(checkout, capsys):
    before = snapshot(checkout)
    code, out, _ = run(capsys, "apply", "--check", str(checkout))
    assert code == EXIT_OK and "check passed" in out
    assert snapshot(checkout) == before
    code, out, _ = run(capsys, "revert", "--check", str(checkout))
    assert code == EXIT_OK and "nothing to revert" in out
    assert snapshot(checkout) == before


def test_conflicting_local_commit_is_reported_and_refused(checkout, capsys):
    path = checkout / COORDINATOR
    text = path.read_text()
    path.write_text(text.replace("for i, manager in enumerate(self.single_type_managers):",
                                 "for i, manager in enumerate(list(self.single_type_managers)):"))
    git(checkout, "commit", "-qam", "local change")
    before = snapshot(checkout)
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_REFUSED
    assert "conflict" in out and COORDINATOR in out
    for argv in (["apply", str(checkout)], ["apply", "--no-commit", str(checkout)],
                 ["apply", "--3way", str(checkout)], ["apply", "--3way", "--no-commit",
                                                       str(checkout)]):
        code, _, err = run(capsys, *argv)
        assert code == EXIT_REFUSED, argv
        assert "F1 conflicts" in err
        assert snapshot(checkout) == before
    code, _, err = run(capsys, "apply", "--3way", str(checkout))
    assert "a 3-way merge conflicts in " + COORDINATOR in err


def test_a_half_applied_series_is_finished_by_apply_and_undone_by_revert(checkout, capsys):
    """Apply, apply --3way and revert all refused a half-applied series
    ("revert the applied fixes or finish them by hand first"): a dead end."""
    first, second, *rest = PATCHES
    base = git(checkout, "rev-parse", "HEAD").strip()
    git(checkout, "am", "--quiet", "--keep-non-patch", str(first), str(second))
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_OK
    # F6 is not applicable on RELEASE (heartbeats start at v0.22): "not applicable".
    applicable = out.count("applicable") - out.count("not applicable")
    assert out.count(" applied") == 2 and applicable == len(rest)
    code, out, _ = run(capsys, "revert", "--check", str(checkout))
    assert code == EXIT_OK and "F1, F2 reverts cleanly" in out
    code, out, _ = run(capsys, "apply", str(checkout))
    assert code == EXIT_OK and "done: F3, F4, F5" in out
    assert out.count(" applied") == len(PATCHES)
    # Half-applied the other way: revert undoes exactly the applied prefix.
    git(checkout, "reset", "--quiet", "--hard", base)
    git(checkout, "am", "--quiet", "--keep-non-patch", str(first))
    code, out, _ = run(capsys, "revert", str(checkout))
    assert code == EXIT_OK and "done: F1" in out
    assert git(checkout, "diff", base, "HEAD") == ""


def test_apply_3way_merges_where_a_context_line_was_edited(checkout, capsys):
    """The pre-check refused every patch that needs a 3-way merge, so
    `apply --3way` never merged ("F1 conflicts") where plain `git am -3` applies all four."""
    path = checkout / COORDINATOR
    assert CONTEXT_LINE in path.read_text()
    path.write_text(path.read_text().replace(CONTEXT_LINE, CONTEXT_LINE.replace(
        "local computed", "locally computed")))
    git(checkout, "commit", "-qam", "edit a context line of F1's hunk")
    edited = git(checkout, "rev-parse", "HEAD").strip()
    before = snapshot(checkout)
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_REFUSED and "it merges with --3way" in out
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "F1 conflicts" in err and "merges with --3way" in err
    assert snapshot(checkout) == before
    code, out, _ = run(capsys, "apply", "--3way", "--check", str(checkout))
    assert code == EXIT_OK and "by a 3-way merge" in out
    assert snapshot(checkout) == before

    code, out, err = run(capsys, "apply", "--3way", str(checkout))
    assert code == EXIT_OK, err
    subjects = git(checkout, "log", "--format=%s", f"{edited}..HEAD").splitlines()
    assert subjects[::-1] == [fix.title for fix in SERIES.applicable(RELEASE)]
    text = path.read_text()
    assert "locally computed" in text and "in two phases over all groups" in text
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_OK and out.count(" applied") == len(PATCHES)
    code, out, _ = run(capsys, "apply", str(checkout))
    assert code == EXIT_OK and "nothing to apply" in out
    code, out, _ = run(capsys, "revert", str(checkout))
    assert code == EXIT_OK, out
    assert git(checkout, "diff", edited, "HEAD") == ""


def test_apply_3way_in_the_work_tree_leaves_the_index_alone(checkout, capsys):
    path = checkout / COORDINATOR
    path.write_text(path.read_text().replace(CONTEXT_LINE, CONTEXT_LINE + "  "))
    git(checkout, "commit", "-qam", "trailing blanks on a context line")
    index = git(checkout, "ls-files", "--stage")
    code, out, _ = run(capsys, "apply", "--3way", "--no-commit", str(checkout))
    assert code == EXIT_OK, out
    assert git(checkout, "ls-files", "--stage") == index
    assert out.count("applied, not committed") == len(PATCHES)
    code, out, _ = run(capsys, "revert", "--no-commit", str(checkout))
    assert code == EXIT_OK and git(checkout, "status", "--porcelain") == ""


def test_failed_git_am_is_rolled_back(checkout, capsys, monkeypatch):
    """If git am itself fails midway, the checkout is restored (all or nothing)."""
    from vllm_patches import _git

    before = snapshot(checkout)
    real_run = _git.run

    def failing_am(repo, *args, **kwargs):
        if args[:1] == ("am",) and "--abort" not in args:
            real_run(repo, *args, **kwargs)  # the patches land as commits ...
            raise _git.GitError("git am failed (injected)")  # ... then am "fails"
        return real_run(repo, *args, **kwargs)

    monkeypatch.setattr(_git, "run", failing_am)
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "injected" in err
    monkeypatch.undo()
    assert snapshot(checkout) == before
    assert not (checkout / ".git" / "rebase-apply").exists()


def test_failed_revert_commit_is_rolled_back(checkout, capsys, monkeypatch):
    from vllm_patches import _git

    assert run(capsys, "apply", str(checkout))[0] == EXIT_OK
    (checkout / "README.md").write_text("a local change the user keeps\n")
    before = snapshot(checkout)
    real_run = _git.run
    commits = []

    def failing_second_commit(repo, *args, **kwargs):
        if args[:1] == ("commit",):
            commits.append(args)
            if len(commits) == 2:
                raise _git.GitError("git commit failed (injected)")
        return real_run(repo, *args, **kwargs)

    monkeypatch.setattr(_git, "run", failing_second_commit)
    code, _, err = run(capsys, "revert", str(checkout))
    assert code == EXIT_REFUSED and "injected" in err
    monkeypatch.undo()
    assert snapshot(checkout) == before


@pytest.mark.parametrize(
    "make_target, message",
    [
        (lambda tmp, co: tmp / "missing", "no such directory"),
        # A file was "no such directory".
        (lambda tmp, co: co / "setup.py", "setup.py: a file, not a directory"),
        (lambda tmp, co: tmp, "not a git repository"),
        (lambda tmp, co: co / "vllm", "not the top of its git repository"),
    ],
)
def test_bad_paths_are_one_line_errors(tmp_path, checkout, capsys, make_target, message):
    target = make_target(tmp_path, checkout)
    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", str(target))
    assert code == EXIT_BAD_INPUT
    assert message in err and len(err.strip().splitlines()) == 1
    assert snapshot(checkout) == before


def test_not_a_vllm_tree(tmp_path, capsys):
    repo = tmp_path / "other"
    repo.mkdir()
    git(repo, "init", "-q")
    code, _, err = run(capsys, "status", str(repo))
    assert code == EXIT_BAD_INPUT and "not a vLLM source tree" in err


def test_uncovered_and_unknown_releases(checkout, capsys):
    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", "--release", "v0.17.0", str(checkout))
    assert code == EXIT_BAD_INPUT and "not a release the series covers (v0.18.0 .. " in err
    assert "it is vLLM v0.21.0 (vllm/_version.py says so)" in err and "--3way" not in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "apply", "--release", "banana", str(checkout))
    assert code == EXIT_BAD_INPUT
    assert err.startswith("vllm-patches apply: error: argument --release: not a vLLM release")
    assert len(err.strip().splitlines()) == 1
    assert snapshot(checkout) == before


def test_undetectable_release_names_the_nearest_and_the_command(checkout, capsys):
    (checkout / "vllm" / "_version.py").unlink()
    git(checkout, "commit", "-qam", "drop version file")
    git(checkout, "tag", "-d", "v0.21.0")
    code, _, err = run(capsys, "status", str(checkout))
    assert code == EXIT_BAD_INPUT and "cannot tell which vLLM release this is" in err
    assert "it resembles v0.21.0 (" in err
    # Every file the patches change is as in v0.21.0: they apply without --3way.
    assert f"run `vllm-patches status --release v0.21.0 {checkout}`" in err
    assert len(err.strip().splitlines()) == 1
    code, out, _ = run(capsys, "status", "--release", "v0.21.0", str(checkout))
    assert code == EXIT_OK and "applicable" in out
    # An uncovered --release named the range but advised --3way.
    code, _, err = run(capsys, "status", "--release", "v9.9.9", str(checkout))
    assert code == EXIT_BAD_INPUT and len(err.strip().splitlines()) == 1
    assert "vLLM v9.9.9 is not a release the series covers (v0.18.0 .. v0.33.0)" in err
    assert f"run `vllm-patches status --release v0.21.0 {checkout}`" in err, err
    coordinator = checkout / COORDINATOR  # an edited context line: --3way merges there
    coordinator.write_text(coordinator.read_text().replace(CONTEXT_LINE, CONTEXT_LINE + " "))
    git(checkout, "commit", "-qam", "edit a context line")
    code, _, err = run(capsys, "status", str(checkout))
    assert f"run `vllm-patches status --release v0.21.0 --3way {checkout}`" in err, err


def test_a_release_is_three_numbers(checkout, capsys):
    """`--release 0.21` (equal to 0.21.0 as a PEP 440 version) was told
    to run `regen`, a developer verb."""
    code, _, err = run(capsys, "status", "--release", "0.21", str(checkout))
    assert code == EXIT_BAD_INPUT and len(err.strip().splitlines()) == 1, err
    assert "not a vLLM release: '0.21' (a release is vX.Y.Z, e.g. v0.21.0)" in err
    assert "the series covers v0.18.0 .. v0.33.0" in err and "regen" not in err


@pytest.mark.parametrize("given", ["v9.9.9", "v0.20.0"])
def test_a_release_the_checkout_contradicts_is_refused(checkout, capsys, given):
    """`--release v9.9.9` on a v0.21.0 tree was advised `--3way`
    although every file matches; a covered --release other than the checkout's own
    planned that release's patches on it."""
    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", "--release", given, str(checkout))
    assert code == EXIT_BAD_INPUT and len(err.strip().splitlines()) == 1, err
    assert (f"it is vLLM v0.21.0 (vllm/_version.py says so), not --release {given}" in err)
    assert "drop --release" in err and "--3way" not in err
    assert ("(v0.18.0 .. v0.33.0)" in err) == (given == "v9.9.9")
    assert snapshot(checkout) == before


def test_a_development_build_names_the_release_before_it(checkout, capsys):
    version = checkout / "vllm" / "_version.py"
    version.write_text(version.read_text().replace("'0.21.0'", "'0.22.0.dev12+g1234abc'"))
    git(checkout, "commit", "-qam", "a development build")
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_BAD_INPUT
    assert "vLLM 0.22.0.dev12+g1234abc is a development build, not a release" in err
    assert "it resembles v0.21.0" in err and f"apply --release v0.21.0 {checkout}" in err


def test_staged_changes_elsewhere_refuse_git_am(checkout, capsys):
    (checkout / "README.md").write_text("local\n")
    git(checkout, "add", "README.md")
    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "staged changes" in err
    assert snapshot(checkout) == before


def test_list_shows_the_series(capsys):
    code, out, _ = run(capsys, "list", "--verbose")
    assert code == EXIT_OK
    assert out.splitlines()[0].startswith("1. F1 ")
    assert "Why:" in out and "Future:" in out
    for fix in SERIES.fixes:
        marker = (f"; backport of PR #{fix.pr.rpartition('/')[2]} (upstream since "
                  f"v{fix.upstream_since})")
        backport = fix.upstream_since is not None and any(
            fix.releases.contains(r) and r < fix.upstream_since for r in SERIES.covered)
        assert (marker in out) == backport, fix.id


def test_version_is_one_line_with_the_covered_range(capsys):
    import importlib.metadata

    code, out, err = run(capsys, "--version")
    assert (code, err) == (EXIT_OK, "")
    assert out == (f"vllm-patches {importlib.metadata.version('vllm-patches')} (vLLM "
                   f"v{SERIES.covered[0]} .. v{SERIES.covered[-1]}, "
                   f"{len(SERIES.covered)} releases)\n")


def test_patches_are_fresh(capsys):
    """patches/ equals what the overlays generate today, for the default lane here;
    tools/test.sh runs `regen --check` over every covered release."""
    code, _, err = run(capsys, "regen", "--check", "--release", str(SERIES.default_release))
    assert code == EXIT_OK, err


def test_fetch_from_an_existing_checkout(tmp_path, checkout, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PATCHES_CACHE", str(tmp_path / "cache"))
    code, out, _ = run(capsys, "fetch", "v0.21.0", "--from", str(checkout))
    assert code == EXIT_OK
    cached = Path(out.strip())
    assert cached.is_relative_to(tmp_path / "cache")
    assert git(cached, "rev-parse", "HEAD") == git(checkout, "rev-parse", "v0.21.0")
    code, _, err = run(capsys, "fetch", "v0.22.0", "--from", str(checkout))
    assert code == EXIT_BAD_INPUT and "has no tag v0.22.0" in err


def test_without_a_checkout_the_verbs_work_on_the_one_they_run_in(checkout, capsys,
                                                                  monkeypatch):
    """`apply` run inside one's own vLLM checkout, with no CHECKOUT, fetched v0.21.0 into
    a subfolder of it and patched that. Now status, apply and revert work on the checkout
    the current directory is in, wherever in it."""
    base = git(checkout, "rev-parse", "HEAD").strip()
    monkeypatch.chdir(checkout / "vllm" / "v1")
    code, out, _ = run(capsys, "status")
    assert code == EXIT_OK and out.startswith(f"{checkout}: vLLM v0.21.0\n")
    code, out, _ = run(capsys, "apply")
    assert code == EXIT_OK and out.startswith(f"{checkout}: vLLM v0.21.0\n") and "done: " in out
    assert git(checkout, "status", "--porcelain", "--untracked-files=all") == ""  # no fetch
    assert run(capsys, "revert")[0] == EXIT_OK
    assert git(checkout, "diff", base, "HEAD") == ""


def test_without_a_checkout_outside_one_status_names_what_to_do(tmp_path, capsys,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    for verb in ("status", "revert"):
        code, out, err = run(capsys, verb)
        assert code == EXIT_BAD_INPUT and out == "" and len(err.splitlines()) == 1
        assert f"{tmp_path} is in no vLLM checkout" in err and "`vllm-patches apply`" in err


def test_a_read_only_checkout_is_refused_before_anything_changes(checkout, tmp_path):
    """A read-only checkout was refused with "git reset failed" (git am failed, and then
    its rollback). The run, in a mount namespace where the checkout is read-only (as
    root, whom file modes do not stop) or with the write bits cleared."""
    before = snapshot(checkout)
    command = [sys.executable, "-m", "vllm_patches", "apply", str(checkout)]
    if os.getuid() == 0:
        command = ["unshare", "--mount", "sh", "-c", ('mount --bind -o ro "$0" "$0" && '
                                                      'exec "$@"'), str(checkout), *command]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(checkout)], check=True)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, check=False,
                              env={**os.environ, "PYTHONPATH": str(_series.REPO_DIR)})
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(checkout)], check=True)
    assert proc.returncode == EXIT_REFUSED, proc.stderr
    assert proc.stderr.startswith(f"vllm-patches: refused: {checkout}: read-only (")
    assert "nothing was changed" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert snapshot(checkout) == before


def test_the_hint_after_a_no_commit_verb_restores_exactly_what_was_there(checkout, capsys):
    """After `revert --no-commit`, the refusal's hint was `apply --no-commit`, which also
    applied fixes that had never been there (and `revert --no-commit` the other way
    round undid committed ones too). Each hint names the fixes, and running it restores
    exactly the state before."""
    assert run(capsys, "apply", "--fix", "F1,F4", str(checkout))[0] == EXIT_OK
    # (the verb in the work tree only, then the committing one, whose hint undoes it)
    for no_commit, committing, fix in (("revert", "apply", "F4"), ("apply", "revert", "F2")):
        assert run(capsys, no_commit, "--no-commit", "--fix", fix, str(checkout))[0] == EXIT_OK
        code, _, err = run(capsys, committing, str(checkout))
        hint = f"`vllm-patches {committing} --no-commit --fix {fix} {checkout}`"
        assert code == EXIT_REFUSED and hint in err, err
        assert run(capsys, *hint.strip("`").split()[1:])[0] == EXIT_OK
        assert git(checkout, "status", "--porcelain") == ""
    out = run(capsys, "status", str(checkout))[1]
    assert [line.split()[2] for line in out.splitlines()[1:6]] == [
        "applied", "applicable", "applicable", "applied", "applicable"]
