"""The vllm-patches verbs on a real vLLM v0.21.0 checkout: what they do, and that
every refusal leaves the checkout exactly as it was."""

from pathlib import Path

import pytest
from conftest import git, snapshot

from vllm_patches import _patches, _series
from vllm_patches._cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED, main

SERIES = _series.load()
RELEASE = _series.Version("0.21.0")

COORDINATOR = "vllm/v1/core/kv_cache_coordinator.py"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse rejects bad arguments with exit 2
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


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
    code, _, _ = run(capsys, "apply", "--no-commit", str(checkout))
    assert code == EXIT_OK
    assert git(checkout, "rev-parse", "HEAD") == head
    assert COORDINATOR in git(checkout, "status", "--porcelain")
    # Local changes in touched files: a second apply is refused, not re-applied.
    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "uncommitted changes" in err
    assert snapshot(checkout) == before


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
                 ["apply", "--3way", str(checkout)]):
        code, _, err = run(capsys, *argv)
        assert code == EXIT_REFUSED, argv
        assert "F1 conflicts" in err
        assert snapshot(checkout) == before


def test_half_applied_series_is_refused(checkout, capsys):
    first, *rest = _patches.series_patches(RELEASE)
    assert rest, "needs a lane with two or more patches"
    git(checkout, "am", "--quiet", "--keep-non-patch", str(first))
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_OK
    assert " applied" in out and "applicable" in out
    before = snapshot(checkout)
    for verb in ("apply", "revert"):
        code, _, err = run(capsys, verb, str(checkout))
        assert code == EXIT_REFUSED and "half-applied" in err, verb
        assert snapshot(checkout) == before


def test_failed_git_am_is_rolled_back(checkout, capsys, monkeypatch):
    """If git am itself fails midway, the checkout is restored (all or nothing)."""
    from vllm_patches import _checkout

    before = snapshot(checkout)
    real_run = _checkout._git.run

    def failing_am(repo, *args, **kwargs):
        if args[:1] == ("am",) and "--abort" not in args:
            real_run(repo, *args, **kwargs)  # the patches land as commits ...
            raise _checkout.GitError("git am failed (injected)")  # ... then am "fails"
        return real_run(repo, *args, **kwargs)

    monkeypatch.setattr(_checkout._git, "run", failing_am)
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "injected" in err
    monkeypatch.undo()
    assert snapshot(checkout) == before
    assert not (checkout / ".git" / "rebase-apply").exists()


@pytest.mark.parametrize(
    "make_target, message",
    [
        (lambda tmp, co: tmp / "missing", "no such directory"),
        (lambda tmp, co: tmp, "not a git repository"),
        (lambda tmp, co: co / "vllm", "not the top of its git repository"),
    ],
)
def test_bad_paths_are_one_line_errors(tmp_path, checkout, capsys, make_target, message):
    target = make_target(tmp_path, checkout)
    before = snapshot(checkout)
    code, out, err = run(capsys, "apply", str(target))
    assert code == EXIT_BAD_INPUT
    assert message in err and len(err.strip().splitlines()) == 1
    assert snapshot(checkout) == before


def test_not_a_vllm_tree(tmp_path, capsys):
    repo = tmp_path / "other"
    repo.mkdir()
    git(repo, "init", "-q")
    code, _, err = run(capsys, "status", str(repo))
    assert code == EXIT_BAD_INPUT and "not a vLLM source tree" in err


def test_unsupported_and_unknown_releases(checkout, capsys):
    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", "--release", "v0.20.1", str(checkout))
    assert code == EXIT_BAD_INPUT and "not a supported release" in err and "v0.21.0" in err
    code, _, err = run(capsys, "apply", "--release", "banana", str(checkout))
    assert code == EXIT_BAD_INPUT
    assert snapshot(checkout) == before


def test_undetectable_release_asks_for_release(checkout, capsys):
    (checkout / "vllm" / "_version.py").unlink()
    git(checkout, "commit", "-qam", "drop version file")
    git(checkout, "tag", "-d", "v0.21.0")
    code, _, err = run(capsys, "status", str(checkout))
    assert code == EXIT_BAD_INPUT and "pass --release" in err
    code, out, _ = run(capsys, "status", "--release", "v0.21.0", str(checkout))
    assert code == EXIT_OK and "applicable" in out


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


def test_patches_are_fresh(capsys):
    """patches/ equals what the overlays generate today (CI's freshness proof)."""
    code, out, err = run(capsys, "regen", "--check")
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
