"""A user's vLLM checkout: opening it under its repository's lock, reading what git says
about it, and ``git am`` on it all or nothing. What a plan (``plan``) is made of is read
here; carrying a plan out is ``apply_revert``'s.

Every verb opens the checkout under its repository's lock (``opened``, ``lock``): a
second run on the same repository waits for the first, or refuses, before it reads
anything its plan is made of. A git command that fails midway is rolled back to where
the operation started (``roll_back``); a SIGINT or SIGTERM waits for such an operation,
rollback included, to end (``_interrupt.change``), so the checkout ends exactly as before
or exactly as after it.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_patches import _git, _interrupt
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog.patchset import Blobs
from vllm_patches._checkout import lock as _lock
from vllm_patches._errors import UserError
from vllm_patches._git import GitError

# Files in the git directory that mean an operation of the user's is in progress: the
# name, what it is, how to settle it.
IN_PROGRESS = (
    ("rebase-apply/applying", "a git am", "git am --continue, --skip or --abort"),
    ("rebase-apply", "a git rebase", "git rebase --continue or --abort"),
    ("rebase-merge", "a git rebase", "git rebase --continue or --abort"),
    ("MERGE_HEAD", "a git merge", "commit it or git merge --abort"),
    ("CHERRY_PICK_HEAD", "a git cherry-pick", "git cherry-pick --continue or --abort"),
    ("REVERT_HEAD", "a git revert", "git revert --continue or --abort"),
    ("sequencer", "a git cherry-pick or revert sequence", "--continue or --abort it"),
)


@dataclass(frozen=True)
class LocalStatus:
    """Paths with changes against HEAD (index or work tree), and those staged."""

    changed: frozenset[str]
    staged: frozenset[str]


@dataclass(frozen=True)
class Checkout:
    """A vLLM source tree at the top of its git repository, with at least one commit."""

    path: Path
    git_dir: Path
    common_dir: Path  # the repository's own git directory, shared by its worktrees
    head: str

    @classmethod
    def open(cls, given: Path) -> Checkout:
        path = given.resolve()
        if path.is_file():
            raise UserError(f"{given}: a file, not a directory (name the top directory of "
                            "your vLLM git checkout)")
        if not path.is_dir():
            raise UserError(f"{given}: no such directory")
        proc = _git.run(path, "rev-parse", "--show-toplevel", "--absolute-git-dir",
                        "--git-common-dir", "HEAD", check=False)
        lines = proc.stdout.splitlines()
        if len(lines) < 3:
            raise UserError(f"{given}: not a git repository (git init && git add -A && "
                            "git commit it first)")
        if Path(lines[0]) != path:
            raise UserError(f"{given}: not the top of its git repository ({lines[0]})")
        if not (path / "vllm" / "v1").is_dir():
            raise UserError(f"{given}: not a vLLM source tree (no vllm/v1/)")
        if proc.returncode != 0:
            raise UserError(f"{given}: the repository has no commit yet")
        return cls(path, Path(lines[1]), (path / lines[2]).resolve(), lines[3])

    def unwritable(self, paths: list[str], commits: bool) -> str | None:
        """The first place a change of ``paths`` (with ``commits``, git's objects, refs and
        index too) would find read-only, as a refusal; None when every one is writable.
        Asked before anything changes: git would fail halfway, and so would its rollback."""
        places = [self.git_dir, self.common_dir, self.common_dir / "objects"] if commits else []
        for path in paths:
            file = self.path / path
            directory = next(d for d in file.parents if d.exists())
            places += [directory, *([file] if file.exists() else [])]
        for place in places:
            if not os.access(place, os.W_OK):
                return (f"{self.path}: read-only ({place} is not writable); nothing was "
                        "changed: make the checkout writable, or copy it (git clone)")
        return None

    def operation_in_progress(self) -> str | None:
        """The user's git operation under way here, as a refusal; None when there is none."""
        for name, what, settle in IN_PROGRESS:
            if (self.git_dir / name).exists():
                return (f"{self.path}: {what} is in progress ({self.git_dir / name}); "
                        f"finish it first ({settle})")
        return None

    def orig_head(self) -> str | None:
        """ORIG_HEAD as the user left it (git am and git reset move it)."""
        path = self.git_dir / "ORIG_HEAD"
        return path.read_text().strip() if path.is_file() else None

    def cached_release(self) -> str | None:
        """The release tag, when this checkout is the tool's own cache of a release."""
        return self.path.name if self.path.parent == _releases.checkouts_dir().resolve() else None

    def head_blobs(self, paths: list[str]) -> Blobs:
        """The blob id of each path in HEAD (None: not in HEAD)."""
        listed = _git.run(self.path, "ls-tree", "-z", "HEAD", "--", *paths).stdout
        blobs: Blobs = dict.fromkeys(paths)
        for entry in filter(None, listed.split("\0")):
            info, path = entry.split("\t", 1)
            blobs[path] = info.split()[2]
        return blobs

    def local_status(self) -> LocalStatus:
        """What differs from HEAD, from one ``git status`` (tracked files only)."""
        out = _git.run(self.path, "status", "--porcelain=v2", "-z", "--untracked-files=no",
                       "--ignore-submodules=all", env=_git.READ_ONLY_ENV).stdout
        changed, staged = set(), set()
        entries = iter(out.split("\0"))
        for entry in entries:
            if not entry:
                continue
            kind, fields = entry[0], entry.split(" ")
            if kind == "1":
                path = entry.split(" ", 8)[8]
            elif kind == "2":
                path = entry.split(" ", 9)[9]
                changed.add(next(entries))  # a rename's source
            elif kind == "u":
                path = entry.split(" ", 10)[10]
                staged.add(path)
            else:
                continue
            changed.add(path)
            if fields[1][0] != ".":
                staged.add(path)
        return LocalStatus(frozenset(changed), frozenset(staged))

    def has_staged(self) -> bool:
        """Whether the index differs from HEAD."""
        return _git.run(self.path, "diff", "--cached", "--quiet", check=False).returncode != 0

    def dirty(self, paths: list[str]) -> list[str]:
        """Those of ``paths`` with local changes, or untracked files there."""
        out = _git.run(self.path, "status", "--porcelain", "-uall", "--", *paths).stdout
        return [line[3:] for line in out.splitlines() if line.strip()]

    def branch(self) -> str | None:
        """The branch checked out; None on a detached HEAD."""
        return _git.run(self.path, "branch", "--show-current").stdout.strip() or None

    def work_tree_blobs(self, paths: tuple[str, ...]) -> Blobs:
        """The blob id each path's work-tree file would get (None: no such file); nothing
        is written."""
        present = [path for path in paths if (self.path / path).is_file()]
        ids = _git.run(self.path, "hash-object", "--stdin-paths",
                       input="".join(f"{path}\n" for path in present)).stdout.split()
        blobs: Blobs = dict.fromkeys(paths)
        blobs.update(zip(present, ids, strict=True))
        return blobs

    def am(self, patches: list[Path], env: dict[str, str], three_way: bool = False) -> None:
        """``git am --keep-non-patch`` (the subjects' ``[Tag]`` prefixes stay) of
        ``patches``, all or nothing: if it fails, abort it (it is ours: the caller refused
        any operation in progress) and roll back. One step for a signal (``_interrupt``):
        it waits for git am and the rollback to end."""
        orig_head = self.orig_head()
        with _interrupt.change():
            try:
                _git.run(self.path, "am", "--quiet", "--keep-non-patch",
                         *(["--3way"] if three_way else []), *map(str, patches), env=env)
            except GitError:
                _git.run(self.path, "am", "--abort", check=False)
                self.roll_back(orig_head)
                raise

    def roll_back(self, orig_head: str | None) -> None:
        """HEAD, the index and the files the operation changed back where it found them,
        and ORIG_HEAD (git am and git reset move it) to what the user had. ``--merge``
        resets what differs from the start and keeps the user's unstaged changes
        elsewhere: before a committing operation nothing was staged and the touched files
        were clean."""
        _git.run(self.path, "reset", "--quiet", "--merge", self.head)
        if orig_head is None:
            _git.run(self.path, "update-ref", "-d", "ORIG_HEAD", check=False)
        else:
            _git.run(self.path, "update-ref", "--no-deref", "ORIG_HEAD", orig_head)


def _is_vllm_tree(path: Path) -> bool:
    """Whether ``path`` is the top of a vLLM source tree: its ``vllm`` package with the
    version module, or a pyproject.toml naming the project vllm (a main clone)."""
    if (path / "vllm" / "version.py").is_file() or (path / "vllm" / "_version.py").is_file():
        return True
    try:
        with open(path / "pyproject.toml", "rb") as file:
            return tomllib.load(file).get("project", {}).get("name") == "vllm"
    except (OSError, ValueError):
        return False


def vllm_tree_around(start: Path) -> Path | None:
    """The vLLM source tree ``start`` is in: ``start`` or the nearest directory above it,
    up to the top of the git repository it is in; None outside one."""
    for path in (start, *start.parents):
        if _is_vllm_tree(path):
            return path
        if (path / ".git").exists():
            return None
    return None


@contextmanager
def opened(given: Path, verb: str, *, writes: bool) -> Iterator[Checkout]:
    """The checkout at ``given``, under its repository's lock for the block (exclusive
    when the verb ``writes``, shared for a reader): opened again once the lock is held,
    so that the HEAD its plan and a rollback use is the one no other run moves. A signal
    in the block says whether the checkout was changed (``_interrupt.guard``)."""
    found = Checkout.open(given)
    with _lock.hold(found.common_dir, found.path, verb, shared=not writes), \
            _interrupt.guard(found.path, verb):
        yield Checkout.open(given)
