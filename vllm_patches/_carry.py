"""Carrying out a plan (``_plan``) on a user's checkout (``_checkout``): apply or revert,
all or nothing.

The rule: the tool changes nothing it did not create. Before changing anything it
refuses, with one line and the checkout untouched, when a git operation of the user's
is in progress (``git am``, rebase, merge, cherry-pick, revert: their state is the
user's work), when the checkout is the tool's own cache of a release (only ``fetch``
changes it), and when files the series touches carry changes that are not the series'
own. A git command that fails midway is rolled back to where the operation started.
Each change is one step that a SIGINT or SIGTERM waits for (``_interrupt.change``): it
ends done or rolled back, never half done.
"""

from __future__ import annotations

from pathlib import Path

from vllm_patches import _git, _interrupt
from vllm_patches._errors import Refused
from vllm_patches._git import GitError
from vllm_patches._patchset import PATCH_AUTHOR
from vllm_patches._plan import FixStatus, Plan, State


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


def _position(plan: Plan, commit: bool, verb: str) -> int:
    """Where ``verb`` starts from: HEAD's position when it commits, the work tree's with
    --no-commit; refuses what either would trip over, before anything changes."""
    _require_changeable(plan)
    if commit:
        _require_clean_for_commits(plan, verb)
        return plan.head
    return _require_known_tree(plan)


def apply(plan: Plan, commit: bool, check: bool) -> tuple[list[FixStatus], Plan]:
    """Apply the patches the checkout does not hold yet, all or nothing: with ``commit``
    one commit per fix (``git am``), else in the work tree (``git apply``). Finishes a
    half-applied series. Returns what was (or, with ``check``, would be) applied and the
    plan after it."""
    start = _position(plan, commit, "apply")
    last = len(plan.patches)
    todo = [s for s in plan.statuses if s.patch is not None
            and plan.patches.index(s.patch) >= start]
    _require_no_conflict(todo)
    if check or not todo:
        return todo, plan
    if commit:
        plan.checkout.am([patch.path for patch in plan.patches[start:]],
                         _fallback_identity(plan.checkout.path), three_way=plan.three_way)
        return todo, plan.after(last, last)
    finish = plan.finish
    if finish is None:  # no position of the series is known beyond a merge git cannot make
        raise Refused(f"{plan.checkout.path}: the series cannot be finished in the work tree")
    with _interrupt.change():
        _git.run(plan.checkout.path, "apply", *finish.args, input=finish.text)  # atomic
    return todo, plan.after(plan.head, last)


def revert(plan: Plan, commit: bool, check: bool) -> tuple[list[FixStatus], Plan]:
    """Undo the applied patches, newest first, all or nothing: with ``commit`` one revert
    commit per fix, else in the work tree. Undoes the applied part of a half-applied
    series. Returns what was (or would be) reverted and the plan after it."""
    end = _position(plan, commit, "revert")
    todo = [s for s in plan.statuses if s.patch is not None
            and plan.patches.index(s.patch) < end]
    if check or not todo:
        return todo, plan
    repo = plan.checkout.path
    if not commit:
        changes = [plan.undo[number] for number in range(end, 0, -1)]
        with _interrupt.change():  # one git apply: atomic
            if all(change.text is None for change in changes):
                _git.run(repo, "apply", *(arg for change in changes for arg in change.args))
            else:
                _git.run(repo, "apply", "-",
                         input="".join(change.text or "" for change in changes))
        return todo, plan.after(plan.head, 0)
    orig_head = plan.checkout.orig_head()
    identity = _fallback_identity(repo)
    with _interrupt.change():  # every revert commit, or (rolled back) none
        try:
            for number in range(end, 0, -1):
                change, fix = plan.undo[number], plan.patches[number - 1].fix
                _git.run(repo, "apply", "--index", *change.args, input=change.text)
                _git.run(repo, "commit", "--quiet", "--no-verify", "-m",
                         f'Revert "{fix.title}"\n\nVllm-Patches-Fix: {fix.id}', env=identity)
        except GitError:
            plan.checkout.roll_back(orig_head)
            raise
    return todo, plan.after(0, 0)


def _fallback_identity(repo: Path) -> dict[str, str]:
    """The patches' author as committer of git am and the revert commits, where the user
    has no identity configured; none where the user has one."""
    return {} if _git.has_user_email(repo) else PATCH_AUTHOR.env()
