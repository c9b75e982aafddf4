"""Every git operation the tool performs, in one place. git is the patch engine."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_patches import _interrupt
from vllm_patches._errors import Refused


class GitError(Refused):
    """A git command failed; carries git's own message."""


def run(repo: Path, *args: str, env: dict[str, str] | None = None, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``git -C repo args``; raise GitError with git's stderr when ``check`` and it fails.

    git runs in a session of its own and a SIGINT or SIGTERM waits for it to end
    (``_interrupt``): a terminal's Ctrl-C or a `timeout` that signals our process group
    never kills git halfway through writing the index, a ref or the work tree."""
    full_env = {**os.environ, **env} if env else None
    with _interrupt.child():
        proc = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            env=full_env,
            input=input,
            start_new_session=True,
            check=False,
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


@dataclass(frozen=True)
class Identity:
    """Who a commit is by: a name, an email and, for commits whose ids must not depend on
    when they are made, a fixed date."""

    name: str
    email: str
    date: str | None = None

    def env(self, committer: Identity | None = None) -> dict[str, str]:
        """The ``GIT_*`` variables for commits by this identity, committed by ``committer``
        (by default this identity too)."""
        return {**self._role("AUTHOR"), **(committer or self)._role("COMMITTER")}

    def _role(self, role: str) -> dict[str, str]:
        env = {f"GIT_{role}_NAME": self.name, f"GIT_{role}_EMAIL": self.email}
        return env | ({f"GIT_{role}_DATE": self.date} if self.date is not None else {})

    @property
    def sign_off(self) -> str:
        return f"Signed-off-by: {self.name} <{self.email}>"

    @classmethod
    def configured(cls, where: Path, role: str) -> Identity | None:
        """The identity git gives ``role`` (``AUTHOR``, ``COMMITTER``) in ``where``, from
        its configuration or ``GIT_*`` environment; None where git would guess one
        (``user.useConfigOnly``: no name@hostname)."""
        proc = run(where, "-c", "user.useConfigOnly=true", "var", f"GIT_{role}_IDENT",
                   check=False)
        if proc.returncode != 0:
            return None
        name, _, rest = proc.stdout.strip().partition(" <")  # "Name <email> 1700000000 +0000"
        return cls(name, rest.partition(">")[0])


def has_user_email(repo: Path) -> bool:
    """Whether git commits in ``repo`` with an email the user configured."""
    return run(repo, "config", "user.email", check=False).returncode == 0


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


def file_at(repo: Path, rev: str, path: str) -> str | None:
    """The text of ``path`` in commit ``rev``; None where it has no such file."""
    proc = run(repo, "show", f"{rev}:{path}", check=False)
    return proc.stdout if proc.returncode == 0 else None


def tags_at_head(repo: Path) -> list[str]:
    proc = run(repo, "tag", "--points-at", "HEAD", check=False)
    return proc.stdout.split() if proc.returncode == 0 else []


def init_release_repo(tree: Path, tag: str, author: Identity) -> None:
    """Turn an unpacked release into a repository with one commit tagged ``tag``.

    ``add -f``: vLLM's ``.gitignore`` matches files the release ships (``*_hip*``);
    without it they would be left out and a later clean would delete them.
    """
    env = {**ISOLATED_ENV, **author.env()}  # the same commit id on every machine
    run(tree, "init", "-q", "-b", "main", env=env)
    run(tree, "add", "-A", "-f", env=env)
    run(tree, "commit", "-q", "--no-verify", "-m", f"vLLM {tag} (source archive)", env=env)
    run(tree, "tag", tag, env=env)


class Commits:
    """A chain of commits built on ``base`` in a scratch index and object store
    (``scratch_env``): the repository is only read. Each ``commit`` takes what was staged
    since the one before; ``patches`` turns the chain into ``git format-patch`` files. The
    one pipeline from trees to patches: regen's and export's."""

    def __init__(self, repo: Path, base: str, env: dict[str, str], scratch: Path):
        self.repo, self.base, self.env, self.scratch = repo, base, env, scratch
        self.tip = base
        self.count = 0
        run(repo, "read-tree", base, env=env)
        self._tip_tree = run(repo, "rev-parse", f"{base}^{{tree}}", env=env).stdout.strip()

    def base_has(self, path: str) -> bool:
        return run(self.repo, "cat-file", "-e", f"{self.base}:{path}", env=self.env,
                   check=False).returncode == 0

    def write(self, path: str, text: str) -> None:
        """Stage ``text`` as the file ``path``."""
        blob = run(self.repo, "hash-object", "-w", "--stdin", input=text,
                   env=self.env).stdout.strip()
        run(self.repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{path}",
            env=self.env)

    def apply(self, patch: Path, three_way: bool = False) -> str | None:
        """Stage ``patch`` (``--3way``: by git's 3-way merge where it does not apply as it
        is); None, or git's reason it cannot."""
        proc = run(self.repo, "apply", "--cached", *(["--3way"] if three_way else []),
                   str(patch), env=self.env, check=False)
        return None if proc.returncode == 0 else reason(proc.stderr)

    def changed(self) -> bool:
        """Whether what is staged differs from the last commit."""
        return self._tree() != self._tip_tree

    def commit(self, message: str) -> None:
        tree = self._tree()
        self.tip = run(self.repo, "commit-tree", tree, "-p", self.tip, "-F", "-", env=self.env,
                       input=message).stdout.strip()
        self._tip_tree = tree
        self.count += 1

    def patches(self, *options: str) -> list[tuple[str, str]]:
        """(file name, text) of each commit, as ``git format-patch --zero-commit
        --no-signature`` writes them, numbered ``[PATCH k/n]`` when there are several."""
        if not self.count:
            return []
        out = self.scratch / "out"
        run(self.repo, "format-patch", "--quiet", "--zero-commit", "--no-signature",
            "--numbered" if self.count > 1 else "--no-numbered", *options, "-o", str(out),
            f"{self.base}..{self.tip}", env=self.env)
        return [(path.name, path.read_text()) for path in sorted(out.iterdir())]

    def _tree(self) -> str:
        return run(self.repo, "write-tree", env=self.env).stdout.strip()


@contextmanager
def commits(repo: Path, base: str, identity: dict[str, str], isolated: bool) -> Iterator[Commits]:
    """``Commits`` on ``base`` of ``repo`` with the author and committer ``identity`` (its
    ``GIT_*`` variables: ``Identity.env``), in a scratch store removed after the block.
    ``isolated``: the user's and the system's git configuration stay out (``ISOLATED_ENV``)."""
    import tempfile  # only here: the quick verbs never build commits

    with tempfile.TemporaryDirectory(prefix="vllm-patches-") as scratch:
        env = {**identity, **(ISOLATED_ENV if isolated else {}),
               **scratch_env(repo, Path(scratch))}
        yield Commits(repo, base, env, Path(scratch))
