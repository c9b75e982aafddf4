"""The tool never changes what it did not create: a git operation of the user's that is
in progress and the tool's own cache of releases."""

import subprocess
from pathlib import Path

import pytest
from conftest import clone, git, snapshot

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._cli import main
from vllm_patches._engine import patch_writer as _patch_writer
from vllm_patches._errors import EXIT_OK, EXIT_REFUSED

RELEASE = _series.Version("0.21.0")
CHANGING = [["apply"], ["apply", "--no-commit"], ["apply", "--3way"], ["apply", "--check"],
            ["revert"], ["revert", "--no-commit"], ["revert", "--check"]]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _conflicting_branch(checkout: Path) -> str:
    """A branch `theirs` and HEAD that both changed README.md's first line; HEAD's id."""
    base = git(checkout, "rev-parse", "HEAD").strip()
    readme = checkout / "README.md"
    original = readme.read_text()
    git(checkout, "checkout", "-q", "-b", "theirs")
    readme.write_text("theirs\n" + original)
    git(checkout, "commit", "-qam", "theirs: README")
    git(checkout, "checkout", "-q", "-")
    readme.write_text("ours\n" + original)
    git(checkout, "commit", "-qam", "ours: README")
    return base


def _start(operation: str, checkout: Path, tmp_path: Path) -> None:
    """Leave ``operation`` of the user's stopped at a conflict in README.md."""
    _conflicting_branch(checkout)
    if operation == "am":
        mailbox = tmp_path / "theirs.mbox"
        mailbox.write_text(git(checkout, "format-patch", "-1", "--stdout", "theirs"))
        command = ["am", str(mailbox)]
    elif operation == "rebase":
        command = ["rebase", "theirs"]
    elif operation == "merge":
        command = ["merge", "theirs"]
    elif operation == "cherry-pick":
        command = ["cherry-pick", "theirs"]
    else:  # revert of HEAD's README change onto a README that moved on
        (checkout / "README.md").write_text("ours, later\n" + (checkout / "README.md").read_text())
        git(checkout, "commit", "-qam", "ours: README again")
        command = ["revert", "--no-edit", "HEAD~1"]
    stopped = subprocess.run(["git", "-C", str(checkout), *command], capture_output=True,
                             check=False)
    assert stopped.returncode != 0, "the operation must stop at the conflict"


@pytest.mark.parametrize("operation", ["am", "rebase", "merge", "cherry-pick", "revert"])
def test_an_operation_in_progress_is_refused_and_left_as_it_was(operation, checkout, tmp_path,
                                                                capsys):
    """A refused `apply` ran `git am --abort` on the user's own `git am`
    and deleted .git/rebase-apply with the patches not applied yet."""
    _start(operation, checkout, tmp_path)
    before = snapshot(checkout)
    assert any(before[name] for name in ("rebase-apply", "rebase-merge", "MERGE_HEAD",
                                         "CHERRY_PICK_HEAD", "REVERT_HEAD"))
    for argv in CHANGING:
        code, _, err = run(capsys, *argv, str(checkout))
        assert code == EXIT_REFUSED, (argv, err)
        assert "is in progress" in err and "finish it first" in err, err
        assert len(err.strip().splitlines()) == 1
        assert snapshot(checkout) == before, argv
    code, out, _ = run(capsys, "status", str(checkout))
    assert "note: " in out and "is in progress" in out
    assert snapshot(checkout) == before


def test_the_users_am_is_refused_before_the_series_is_tried(checkout, tmp_path, capsys):
    """The user's `git am` stopped with patches left; ours are all applicable."""
    _start("am", checkout, tmp_path)
    pending = sorted(p.name for p in (Path(git(checkout, "rev-parse", "--absolute-git-dir")
                                           .strip()) / "rebase-apply").iterdir())
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "a git am is in progress" in err
    assert "git am --continue, --skip or --abort" in err
    git_dir = Path(git(checkout, "rev-parse", "--absolute-git-dir").strip())
    assert sorted(p.name for p in (git_dir / "rebase-apply").iterdir()) == pending


@pytest.fixture
def cache(tmp_path, monkeypatch, checkout) -> Path:
    """A cache of its own holding v0.21.0 (from a local checkout: no network)."""
    monkeypatch.setenv("VLLM_PATCHES_CACHE", str(tmp_path / "cache"))
    return _releases.fetch_from_checkout(RELEASE, checkout)


def test_the_cache_is_refused_to_apply_and_revert(cache, capsys):
    """`apply` on the path `fetch` prints patched the cache itself."""
    before = snapshot(cache)
    for argv in CHANGING:
        code, _, err = run(capsys, *argv, str(cache))
        assert code == EXIT_REFUSED, argv
        assert "vllm-patches' cache of vLLM v0.21.0" in err and "git clone" in err
        assert snapshot(cache) == before
    code, out, _ = run(capsys, "status", str(cache))  # reading is fine
    assert code == EXIT_OK and "applicable" in out
    assert snapshot(cache) == before


def test_a_changed_cache_is_never_handed_out_as_pristine(cache, tmp_path, monkeypatch, capsys):
    """After the cache was patched, `fetch` handed it out as pristine,
    `regen --check` failed with a misleading message and a no-argument `apply` said
    "nothing to apply"."""
    (cache / "README.md").write_text("changed behind the tool's back\n")
    # The cache has no identity of its own (only fetch commits there, with a fixed one).
    git(cache, "-c", "user.name=Someone", "-c", "user.email=someone@example.org",
        "commit", "-qam", "a commit in the cache")
    before = snapshot(cache)
    code, _, err = run(capsys, "fetch", "v0.21.0")
    assert code == EXIT_REFUSED
    assert "the cached vLLM v0.21.0" in err and "was changed (HEAD is not the release" in err
    assert "vllm-patches cache --remove v0.21.0" in err
    code, _, err = run(capsys, "regen", "--check", "--release", "v0.21.0")
    assert code == EXIT_REFUSED and "was changed" in err and "stale" not in err
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "apply")
    assert code == EXIT_REFUSED and "was changed" in err and "nothing to apply" not in out
    assert not (tmp_path / "vllm-v0.21.0").exists()
    assert snapshot(cache) == before
    git(cache, "reset", "-q", "--hard", "HEAD~1")
    (cache / "README.md").write_text("edited, not committed\n")
    code, _, err = run(capsys, "fetch", "v0.21.0")
    assert code == EXIT_REFUSED and "files differ from the release" in err
    git(cache, "checkout", "-q", ".")
    code, out, _ = run(capsys, "fetch", "v0.21.0")
    assert code == EXIT_OK and out.strip() == str(cache)


def test_generating_patches_writes_nothing_into_the_cache(cache):
    """regen and matrix read the cached release; their commits go to a scratch store."""
    git(cache, "prune", "--expire=now")  # a local clone copied every object of the source
    before = (snapshot(cache), git(cache, "count-objects", "-v"))
    series = _series.load()
    assert _patch_writer.generate(series, RELEASE, cache)
    assert (snapshot(cache), git(cache, "count-objects", "-v")) == before


def test_a_users_clone_of_the_cache_is_theirs(cache, tmp_path, capsys):
    mine = clone(cache, tmp_path / "mine")
    code, out, _ = run(capsys, "apply", str(mine))
    assert code == EXIT_OK and "done: F1, F2, F3, F4, F5" in out
