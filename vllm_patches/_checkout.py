"""A user's vLLM checkout: opening it, reading what git says about it, and carrying out
a plan (``_plan``) on it: apply or revert, all or nothing.

The rule: the tool changes nothing it did not create. Before changing anything it
refuses, with one line and the checkout untouched, when a git operation of the user's
is in progress (``git am``, rebase, merge, cherry-pick, revert: their state is the
user's work), when the checkout is the tool's own cache of a release (only ``fetch``
changes it), and when files the series touches carry changes that are not the series'
own. A git command that fails midway is rolled back to where the operation started.
Every verb opens the checkout under its repository's lock (``opened``, ``_lock``): a
second run on the same repository waits for the first, or refuses, before it reads
anything its plan is made of.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vllm_patches import _git, _lock, _releases
from vllm_patches._errors import Refused, UserError
from vllm_patches._git import GitError
from vllm_patches._patchset import PATCH_AUTHOR_EMAIL, PATCH_AUTHOR_NAME, Blobs
from vllm_patches._plan import FixStatus, Plan, State

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

    def work_tree_blobs(self, paths: tuple[str, ...]) -> Blobs:
        """The blob id each path's work-tree file would get (None: no such file); nothing
        is written."""
        present = [path for path in paths if (self.path / path).is_file()]
        ids = _git.run(self.path, "hash-object", "--stdin-paths",
                       input="".join(f"{path}\n" for path in present)).stdout.split()
        blobs: Blobs = dict.fromkeys(paths)
        blobs.update(zip(present, ids, strict=True))
        return blobs


@contextmanager
def opened(given: Path, verb: str, *, writes: bool) -> Iterator[Checkout]:
    """The checkout at ``given``, under its repository's lock for the block (exclusive
    when the verb ``writes``, shared for a reader): opened again once the lock is held,
    so that the HEAD its plan and a rollback use is the one no other run moves."""
    found = Checkout.open(given)
    with _lock.hold(found.common_dir, found.path, verb, shared=not writes):
        yield Checkout.open(given)


def _require_changeable(plan: Plan) -> None:
    checkout = plan.checkout
    busy = checkout.operation_in_progress()
    if busy:
        raise Refused(busy)
    tag = checkout.cached_release()
    if tag:
        raise Refused(f"{checkout.path} is vllm-patches' cache of vLLM {tag}, which only "
                      f"`vllm-patches fetch` changes; clone it and work there: "
                      f"git clone {checkout.path} vllm-{tag}")


def _require_no_staged_touched(plan: Plan) -> None:
    if plan.staged_touched:
        raise Refused(f"{plan.checkout.path}: staged changes in files the series touches: "
                      f"{', '.join(plan.staged_touched)}; --no-commit changes the work tree "
                      "only, unstage them first (git restore --staged FILE)")


def _require_clean_for_commits(plan: Plan, verb: str) -> None:
    """Commits need the touched files as HEAD has them and nothing else staged."""
    path = plan.checkout.path
    if plan.local_changes:
        statuses = plan.statuses
        uncommitted = [s.fix.id for s in statuses if s.state is State.UNCOMMITTED]
        reverted = [s.fix.id for s in statuses if s.state is State.REVERTED_UNCOMMITTED]
        if plan.tree is None or not (uncommitted or reverted):
            raise Refused(f"{path}: uncommitted changes in files the series touches: "
                          f"{', '.join(plan.local_changes)}")
        if uncommitted:
            raise Refused(f"{path}: {', '.join(uncommitted)} applied in the work tree but not "
                          f"committed (apply --no-commit); commit them with git, or undo them "
                          f"with `vllm-patches revert --no-commit`, then {verb}")
        raise Refused(f"{path}: {', '.join(reverted)} reverted in the work tree but not "
                      f"committed (revert --no-commit); commit that with git, or restore them "
                      f"with `vllm-patches apply --no-commit`, then {verb}")
    if plan.staged_elsewhere:
        raise Refused(f"{path}: the index has staged changes ({', '.join(plan.staged_elsewhere)}) "
                      f"that the commits of `{verb}` would take along: commit or unstage them "
                      "first")


def _require_known_tree(plan: Plan) -> int:
    """The work tree's position, for --no-commit; refuses foreign local changes."""
    if plan.tree is None:
        raise Refused(f"{plan.checkout.path}: uncommitted changes in files the series touches: "
                      f"{', '.join(plan.local_changes)}")
    _require_no_staged_touched(plan)
    return plan.tree


def _require_no_conflict(todo: list[FixStatus]) -> None:
    conflicts = [s for s in todo if s.state is State.CONFLICT]
    if conflicts:
        raise Refused("; ".join(f"{s.fix.id} conflicts: {s.detail}" for s in conflicts))


def apply(plan: Plan, commit: bool, check: bool) -> tuple[list[FixStatus], Plan]:
    """Apply the patches the checkout does not hold yet, all or nothing: with ``commit``
    one commit per fix (``git am``), else in the work tree (``git apply``). Finishes a
    half-applied series. Returns what was (or, with ``check``, would be) applied and the
    plan after it."""
    _require_changeable(plan)
    if commit:
        _require_clean_for_commits(plan, "apply")
        start = plan.head
    else:
        start = _require_known_tree(plan)
    last = len(plan.patches)
    todo = [s for s in plan.statuses if s.patch is not None
            and plan.patches.index(s.patch) >= start]
    _require_no_conflict(todo)
    if check or not todo:
        return todo, plan
    if commit:
        args = ["am", "--quiet", "--keep-non-patch", *(["--3way"] if plan.three_way else []),
                *(str(patch.path) for patch in plan.patches[start:])]
        git_am(plan.checkout, args, _identity_env(plan.checkout.path))
        return todo, plan.after(last, last)
    finish = plan.finish
    if finish is None:  # no position of the series is known beyond a merge git cannot make
        raise Refused(f"{plan.checkout.path}: the series cannot be finished in the work tree")
    _git.run(plan.checkout.path, "apply", *finish.args, input=finish.text)  # atomic
    return todo, plan.after(plan.head, last)


def revert(plan: Plan, commit: bool, check: bool) -> tuple[list[FixStatus], Plan]:
    """Undo the applied patches, newest first, all or nothing: with ``commit`` one revert
    commit per fix, else in the work tree. Undoes the applied part of a half-applied
    series. Returns what was (or would be) reverted and the plan after it."""
    _require_changeable(plan)
    if commit:
        _require_clean_for_commits(plan, "revert")
        end = plan.head
    else:
        end = _require_known_tree(plan)
    todo = [s for s in plan.statuses if s.patch is not None
            and plan.patches.index(s.patch) < end]
    if check or not todo:
        return todo, plan
    repo = plan.checkout.path
    if not commit:
        changes = [plan.undo[number] for number in range(end, 0, -1)]
        if all(change.text is None for change in changes):
            _git.run(repo, "apply", *(arg for change in changes for arg in change.args))
        else:
            _git.run(repo, "apply", "-", input="".join(change.text or "" for change in changes))
        return todo, plan.after(plan.head, 0)
    orig_head = plan.checkout.orig_head()
    identity = _identity_env(repo)
    try:
        for number in range(end, 0, -1):
            change, fix = plan.undo[number], plan.patches[number - 1].fix
            _git.run(repo, "apply", "--index", *change.args, input=change.text)
            _git.run(repo, "commit", "--quiet", "--no-verify", "-m",
                     f'Revert "{fix.title}"\n\nVllm-Patches-Fix: {fix.id}', env=identity)
    except GitError:
        _roll_back(plan.checkout, orig_head)
        raise
    return todo, plan.after(0, 0)


def git_am(checkout: Checkout, args: list[str], env: dict[str, str]) -> None:
    """Run ``git am`` (``args`` from ``am`` on) all or nothing: if it fails, abort it (it
    is ours: the caller refused any operation in progress) and put HEAD, the index, the
    touched files and ORIG_HEAD back."""
    orig_head = checkout.orig_head()
    try:
        _git.run(checkout.path, *args, env=env)
    except GitError:
        _git.run(checkout.path, "am", "--abort", check=False)
        _roll_back(checkout, orig_head)
        raise


def _roll_back(checkout: Checkout, orig_head: str | None) -> None:
    """HEAD, the index and the files the operation changed back where it found them, and
    ORIG_HEAD (git am and git reset move it) to what the user had. ``--merge`` resets
    what differs from the start and keeps the user's unstaged changes elsewhere: before a
    committing operation nothing was staged and the touched files were clean."""
    _git.run(checkout.path, "reset", "--quiet", "--merge", checkout.head)
    if orig_head is None:
        _git.run(checkout.path, "update-ref", "-d", "ORIG_HEAD", check=False)
    else:
        _git.run(checkout.path, "update-ref", "--no-deref", "ORIG_HEAD", orig_head)


def _identity_env(repo: Path) -> dict[str, str]:
    """A committer identity for git am/commit where the user has none configured."""
    if _git.run(repo, "config", "user.email", check=False).returncode == 0:
        return {}
    return {"GIT_COMMITTER_NAME": PATCH_AUTHOR_NAME, "GIT_COMMITTER_EMAIL": PATCH_AUTHOR_EMAIL,
            "GIT_AUTHOR_NAME": PATCH_AUTHOR_NAME, "GIT_AUTHOR_EMAIL": PATCH_AUTHOR_EMAIL}
