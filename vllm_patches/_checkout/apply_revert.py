"""Carrying out a plan (``plan``) on a user's checkout (``checkout``): apply or revert
the chosen fixes, all or nothing.

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
from vllm_patches._catalog.patchset import PATCH_AUTHOR
from vllm_patches._checkout.plan import FixStatus, Numbers, Plan, State, combined
from vllm_patches._errors import Refused
from vllm_patches._git import GitError


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
        # The command that undoes exactly these (a plain --no-commit verb would also
        # take the fixes committed, or never applied, with them).
        if uncommitted:
            raise Refused(f"{path}: {', '.join(uncommitted)} applied in the work tree but not "
                          f"committed (apply --no-commit); commit them with git, or undo them "
                          f"with `vllm-patches revert --no-commit --fix {','.join(uncommitted)} "
                          f"{path}`, then {verb}")
        raise Refused(f"{path}: {', '.join(reverted)} reverted in the work tree but not "
                      f"committed (revert --no-commit); commit that with git, or restore them "
                      f"with `vllm-patches apply --no-commit --fix {','.join(reverted)} "
                      f"{path}`, then {verb}")
    if plan.staged_elsewhere:
        raise Refused(f"{path}: the index has staged changes ({', '.join(plan.staged_elsewhere)}) "
                      f"that the commits of `{verb}` would take along: commit or unstage them "
                      "first")


def _require_known_tree(plan: Plan) -> Numbers:
    """The work tree's position, for --no-commit; refuses foreign local changes."""
    if plan.tree is None:
        raise Refused(f"{plan.checkout.path}: uncommitted changes in files the series touches: "
                      f"{', '.join(plan.local_changes)}")
    _require_no_staged_touched(plan)
    return plan.tree


def _require_writable(plan: Plan, todo: list[FixStatus], commit: bool) -> None:
    """A read-only checkout is refused before the change: git would stop halfway."""
    paths = sorted({path for s in todo if s.patch for path in s.patch.changes})
    problem = plan.checkout.unwritable(paths, commits=commit)
    if problem:
        raise Refused(problem)


def _require_no_conflict(todo: list[FixStatus], again: str) -> None:
    """All or nothing: a chosen fix that conflicts, or is blocked by one, stops the whole
    apply. The line names each and the command that applies the others."""
    stopped = [s for s in todo if s.state in (State.CONFLICT, State.BLOCKED)]
    if not stopped:
        return
    why = "; ".join(f"{s.fix.id} {'conflicts' if s.state is State.CONFLICT else 'is blocked'}: "
                    f"{s.detail}" for s in stopped)
    others = [s.fix.id for s in todo if s not in stopped]
    rest = (f"; nothing was applied: `{again.format(fixes=','.join(others))}` applies "
            f"{', '.join(others)}" if others else "")
    raise Refused(why + rest)


def _require_requirements(plan: Plan, start: Numbers) -> None:
    """A chosen fix whose requirement is neither chosen nor held is refused, naming it:
    the tool applies what it is told, never more."""
    for status in plan.statuses:
        if status.state is not State.BLOCKED:
            continue
        missing = [plan.patches[n - 1].fix.id for n in plan.required(status.fix)
                   if n not in start and not plan.chooses(plan.patches[n - 1].fix)]
        if missing:
            raise Refused(f"{status.fix.id} requires {', '.join(missing)}, which is neither "
                          f"applied nor chosen: add --fix {','.join(missing)}")


def _require_no_dependents(plan: Plan, start: Numbers) -> None:
    """Reverting a fix that another applied fix requires, without that one, is refused."""
    for fix, required in plan.stranded(start):
        raise Refused(f"{fix.id} requires {', '.join(required)} and stays applied: "
                      f"revert it too (add --fix {fix.id})")


def _position(plan: Plan, commit: bool, verb: str) -> Numbers:
    """Where ``verb`` starts from: HEAD's set when it commits, the work tree's with
    --no-commit; refuses what either would trip over, before anything changes."""
    _require_changeable(plan)
    if commit:
        _require_clean_for_commits(plan, verb)
        return plan.head
    return _require_known_tree(plan)


def apply(plan: Plan, commit: bool, check: bool,
          again: str = "vllm-patches apply --fix {fixes}") -> tuple[list[FixStatus], Plan]:
    """Apply the chosen patches the checkout does not hold yet, all or nothing: with
    ``commit`` one commit per fix (``git am``), else in the work tree (``git apply``).
    Finishes a half-applied series. Returns what was (or, with ``check``, would be)
    applied and the plan after it. ``again`` is the command that applies other fixes,
    with ``{fixes}`` for their ids, for the refusal of a conflict."""
    start = _position(plan, commit, "apply")
    todo = [s for s in plan.statuses if s.patch is not None
            and plan.patches.index(s.patch) + 1 not in start]
    _require_requirements(plan, start)
    _require_no_conflict(todo, again)
    if check or not todo:
        return todo, plan
    _require_writable(plan, todo, commit)
    numbers = frozenset(plan.patches.index(s.patch) + 1 for s in todo if s.patch)
    if commit:
        plan.checkout.am([s.patch.path for s in todo if s.patch],
                         _fallback_identity(plan.checkout.path), three_way=plan.three_way)
        return todo, plan.after(start | numbers, start | numbers)
    finish = plan.finish
    if finish is None:  # no set of the patches is known beyond a merge git cannot make
        raise Refused(f"{plan.checkout.path}: the series cannot be finished in the work tree")
    with _interrupt.change():
        _git.run(plan.checkout.path, "apply", *finish.args, input=finish.text)  # atomic
    return todo, plan.after(plan.head, start | numbers)


def revert(plan: Plan, commit: bool, check: bool) -> tuple[list[FixStatus], Plan]:
    """Undo the chosen patches the checkout holds, newest first, all or nothing: with
    ``commit`` one revert commit per fix, else in the work tree. Undoes the applied
    part of a half-applied series. Returns what was (or would be) reverted and the
    plan after it."""
    start = _position(plan, commit, "revert")
    _require_no_dependents(plan, start)
    todo = [s for s in plan.statuses if s.patch is not None
            and plan.patches.index(s.patch) + 1 in start]
    if check or not todo:
        return todo, plan
    _require_writable(plan, todo, commit)
    steps = plan.undo[start]
    if len(steps) != len(todo):
        raise Refused(f"{plan.checkout.path}: git cannot undo "
                      f"{', '.join(s.fix.id for s in todo)} here")
    rest = start - {number for number, _change in steps}
    repo = plan.checkout.path
    if not commit:
        change = combined([change for _number, change in steps])
        with _interrupt.change():  # one git apply: atomic
            _git.run(repo, "apply", *change.args, input=change.text)
        return todo, plan.after(plan.head, rest)
    orig_head = plan.checkout.orig_head()
    identity = _fallback_identity(repo)
    with _interrupt.change():  # every revert commit, or (rolled back) none
        try:
            for number, change in steps:
                fix = plan.patches[number - 1].fix
                _git.run(repo, "apply", "--index", *change.args, input=change.text)
                _git.run(repo, "commit", "--quiet", "--no-verify", "-m",
                         f'Revert "{fix.title}"\n\nVllm-Patches-Fix: {fix.id}', env=identity)
        except GitError:
            plan.checkout.roll_back(orig_head)
            raise
    return todo, plan.after(rest, rest)


def _fallback_identity(repo: Path) -> dict[str, str]:
    """The patches' author as committer of git am and the revert commits, where the user
    has no identity configured; none where the user has one."""
    return {} if _git.has_user_email(repo) else PATCH_AUTHOR.env()
