"""Every git operation the tool performs, in one place. git is the patch engine."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from vllm_patches._errors import Refused


class GitError(Refused):
    """A git command failed; carries git's own message."""


def run(repo: Path, *args: str, env: dict[str, str] | None = None, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``git -C repo args``; raise GitError with git's stderr when ``check`` and it fails."""
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input,
    )
    if check and proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        raise GitError(f"git {args[0]} failed in {repo}: {message[0] if message else proc.returncode}")
    return proc


def reason(stderr: str) -> str:
    """git apply's or am's reason on one line: its errors, or the files a 3-way merge left
    conflicted (those it reports as ``U path``)."""
    lines = stderr.strip().splitlines()
    reasons = [line.removeprefix("error: ") for line in lines if line.startswith("error:")]
    conflicted = [line[2:] for line in lines if line.startswith("U ")]
    if conflicted:
        reasons.append("3-way merge conflicts in " + ", ".join(conflicted))
    return "; ".join(reasons or lines)


# For output that must not depend on who runs git: the user's and the system's
# configuration (diff.noprefix, format.signature, diff.renames, ...) stay out.
ISOLATED_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
# Read-only calls (status) must not refresh and rewrite the user's index.
READ_ONLY_ENV = {"GIT_OPTIONAL_LOCKS": "0"}


def objects_dir(repo: Path) -> Path:
    """The repository's object store (shared by all its worktrees)."""
    return repo / run(repo, "rev-parse", "--git-path", "objects").stdout.strip()


def scratch_env(repo: Path, scratch: Path, reads: tuple[Path, ...] = ()) -> dict[str, str]:
    """Environment for git calls that must leave ``repo`` as it is: a throwaway index
    (``scratch/index``) and a throwaway object store (``scratch/objects``) that reads
    ``repo``'s objects, and those of the stores ``reads``, as alternates. Blobs, trees and
    commits such calls write go to ``scratch``; the repository is only read."""
    objects = scratch / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    alternates = [objects_dir(repo), *(store / "objects" for store in reads)]
    return {"GIT_INDEX_FILE": str(scratch / "index"), "GIT_OBJECT_DIRECTORY": str(objects),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": os.pathsep.join(map(str, alternates))}


def is_repo(path: Path) -> bool:
    return run(path, "rev-parse", "--git-dir", check=False).returncode == 0 if path.is_dir() else False


def has_ref(repo: Path, ref: str) -> bool:
    return run(repo, "rev-parse", "--verify", "--quiet", ref, check=False).returncode == 0


def head(repo: Path) -> str:
    return run(repo, "rev-parse", "HEAD").stdout.strip()


def tags_at_head(repo: Path) -> list[str]:
    proc = run(repo, "tag", "--points-at", "HEAD", check=False)
    return proc.stdout.split() if proc.returncode == 0 else []


def init_release_repo(tree: Path, tag: str, commit_env: dict[str, str]) -> None:
    """Turn an unpacked release into a repository with one commit tagged ``tag``.

    ``add -f``: vLLM's ``.gitignore`` matches files the release ships (``*_hip*``);
    without it they would be left out and a later clean would delete them.
    """
    env = {**ISOLATED_ENV, **commit_env}  # the same commit id on every machine
    run(tree, "init", "-q", "-b", "main", env=env)
    run(tree, "add", "-A", "-f", env=env)
    run(tree, "commit", "-q", "--no-verify", "-m", f"vLLM {tag} (source archive)", env=env)
    run(tree, "tag", tag, env=env)
