"""Fixtures for the tool's own tests: real vLLM release checkouts, cloned per test."""

import hashlib
import subprocess
from pathlib import Path

import pytest

from vllm_patches._catalog import releases as _releases

# What the git directory holds for an operation in progress, and the rest of its state
# that a refused command must leave alone.
GIT_STATE = ("rebase-apply", "rebase-merge", "MERGE_HEAD", "MERGE_MSG", "CHERRY_PICK_HEAD",
             "REVERT_HEAD", "sequencer", "ORIG_HEAD", "logs/refs/stash")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """The verb ``argv`` in this process: its exit code, stdout and stderr."""
    from vllm_patches._cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse rejects bad arguments with exit 2
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def _files_digest(path: Path) -> str | None:
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path.parent)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def snapshot(repo: Path) -> dict[str, object]:
    """Everything a refused command must leave as it was: HEAD and every ref, the index
    (stages included), the work tree (changes and untracked files), the stash, and the
    git directory's state of operations in progress (am, rebase, merge, cherry-pick)."""
    git_dir = Path(git(repo, "rev-parse", "--absolute-git-dir").strip())
    diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary"],
                          capture_output=True, check=False).stdout
    return {
        "HEAD": git(repo, "rev-parse", "HEAD"),
        "refs": git(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
        "index": git(repo, "ls-files", "--stage"),
        "status": git(repo, "status", "--porcelain", "-uall"),
        "work tree": hashlib.sha256(diff).hexdigest(),
        "stash": git(repo, "stash", "list"),
        **{name: _files_digest(git_dir / name) for name in GIT_STATE},
    }


@pytest.fixture(scope="session")
def pristine_v0_21_0() -> Path:
    return _releases.fetch(_releases.parse_release("0.21.0"))


def clone(source: Path, target: Path) -> Path:
    """A user's checkout of ``source`` with a configured identity."""
    subprocess.run(["git", "clone", "--quiet", str(source), str(target)], check=True)
    git(target, "config", "user.name", "Test User")
    git(target, "config", "user.email", "test@example.invalid")
    return target


@pytest.fixture
def checkout(tmp_path: Path, pristine_v0_21_0: Path) -> Path:
    """A user's vLLM v0.21.0 checkout with a configured identity."""
    return clone(pristine_v0_21_0, tmp_path / "vllm")


CONTRIBUTOR_NAME, CONTRIBUTOR_EMAIL = "Ada Contributor", "ada@example.org"


@pytest.fixture
def contributor(tmp_path, monkeypatch) -> Path:
    """A contributor whose git identity is in a global config of their own."""
    home = tmp_path / "home"
    home.mkdir()
    config = home / ".gitconfig"
    config.write_text(f"[user]\n\tname = {CONTRIBUTOR_NAME}\n\temail = {CONTRIBUTOR_EMAIL}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    for variable in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
                     "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(home)
    return home
