"""What the series is on one checkout, worked out once: the release, each fix's state,
the patch files, and how many of the release's patches HEAD and the work tree hold.

`status` prints a plan; `apply` and `revert` check it and carry it out (``_carry``);
nothing recomputes it. Positions: the release's patches form a chain (patch k was
generated on top of patches 1..k-1), so a tree holds the first ``k`` of them, its
*position*, or is off the chain. git applies only a prefix (``git am`` stops at the
first failure), and `apply` finishes a half-applied series from its position while
`revert` undoes the prefix, so half-applied is a position like any other.

Two ways to find the positions, the first one free:

- **Exact.** The committed patches carry full blob ids (``_patchset``), so the blob ids
  of the touched files at every position are known. A checkout whose touched files are
  exactly the release's, with or without some of the patches, is recognized from one
  ``git ls-tree``: nothing is tried, every remaining patch applies as it is.
- **Tried.** Otherwise git tries the patches in a scratch index and object store
  (``_git.scratch_env``; the checkout is only read): the applied prefix is the longest
  one whose patches reverse-apply, newest first; the rest are applied on top, in order,
  each plainly or (``--3way``) with git's 3-way merge. A 3-way step must change the tree
  (a merge that changes nothing means the change is already there). Reverse steps may
  also merge: to recognize a series applied with ``--3way`` on edited files, the patches
  are first replayed onto the release's own blobs (when the repository has them) so that
  git has the post-images to merge with. Forward steps never see those replayed blobs:
  they must only succeed where ``git am --3way`` in the checkout itself succeeds.

The work tree is compared with the positions found: the touched files are either at a
position (for instance after ``apply --no-commit``: the fixes are "applied, not
committed") or carry other local changes, which `apply` and `revert` refuse.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.version import Version

from vllm_patches import _git, _releases
from vllm_patches._checkout import Checkout
from vllm_patches._errors import UserError
from vllm_patches._patchset import Blobs, Patch, PatchSet
from vllm_patches._series import Fix, Need, Series


class State(enum.Enum):
    """Where a needed fix's patch is on the checkout (a fix not needed has ``Fix.on``'s
    ``Need`` instead)."""

    APPLICABLE = "applicable"
    APPLIED = "applied"
    UNCOMMITTED = "applied, not committed"  # in the work tree, not in HEAD
    REVERTED_UNCOMMITTED = "reverted, not committed"  # in HEAD, not in the work tree
    CONFLICT = "conflict"


@dataclass(frozen=True)
class FixStatus:
    fix: Fix
    state: State | Need
    detail: str = ""
    patch: Patch | None = None

    def line(self) -> str:
        text = f"{self.fix.id:<4} {self.fix.slug:<40} {self.state.value}"
        return f"{text} ({self.detail})" if self.detail else text


@dataclass(frozen=True)
class Change:
    """A change to the checkout that plain ``git apply`` makes: patch files, or a patch
    text on stdin (then ``args`` is ``("-",)``)."""

    args: tuple[str, ...]
    text: str | None = None


@dataclass(frozen=True)
class Plan:
    """The series on one checkout (see the module docstring)."""

    checkout: Checkout
    series: Series
    release: Version
    three_way: bool
    patches: tuple[Patch, ...]
    head: int  # how many of the patches HEAD holds
    tree: int | None  # how many the work tree holds; None: touched files changed otherwise
    local_changes: tuple[str, ...]  # touched files whose work tree or index differs from HEAD
    staged_touched: tuple[str, ...]  # touched files with staged changes
    staged_elsewhere: tuple[str, ...]  # other files with staged changes (git am would commit them)
    # Patch number (1-based) -> its state when it is beyond both positions; missing: applicable.
    ahead: dict[int, tuple[State, str]] = field(default_factory=dict)
    # Patch number -> the change that takes the tree from that position to the one before.
    undo: dict[int, Change] = field(default_factory=dict)
    # The change that takes the work tree from its position to the last patch.
    finish: Change | None = None

    @property
    def statuses(self) -> list[FixStatus]:
        """Every fix of the series on this checkout, in series order."""
        numbered = {patch.fix.id: (number, patch)
                    for number, patch in enumerate(self.patches, start=1)}
        result = []
        for fix in self.series.fixes:
            if fix.id in numbered:
                number, patch = numbered[fix.id]
                state, detail = self._patch_state(number, patch)
                result.append(FixStatus(fix, state, detail, patch))
            else:
                verdict = fix.on(self.release)
                result.append(FixStatus(fix, verdict.need, verdict.detail))
        return result

    def _patch_state(self, number: int, patch: Patch) -> tuple[State, str]:
        tree = self.head if self.tree is None else self.tree
        if number <= min(self.head, tree):
            return State.APPLIED, ""
        if number <= tree:
            return State.UNCOMMITTED, ""
        if number <= self.head:
            return State.REVERTED_UNCOMMITTED, ""
        return self.ahead.get(number, (State.APPLICABLE, patch.path.name))

    def after(self, head: int, tree: int) -> Plan:
        """The plan once an operation moved HEAD and the work tree to these positions."""
        return replace(self, head=head, tree=tree)

    def notes(self) -> list[str]:
        """What else a reader of the statuses must know: foreign local changes."""
        if self.tree is None:
            return ["local changes in files the series touches, not from the series: "
                    + ", ".join(self.local_changes)]
        return []


def make(checkout: Checkout, series: Series, release: Version, three_way: bool) -> Plan:
    """The plan of ``release``'s patches on ``checkout`` (see the module docstring)."""
    patchset = PatchSet.load(series, release)
    base = Plan(checkout, series, release, three_way, patchset.patches, head=0, tree=0,
                local_changes=(), staged_touched=(), staged_elsewhere=())
    if not patchset.patches:
        return base
    paths = patchset.paths()
    head_blobs = checkout.head_blobs(paths)
    status = checkout.local_status()
    changed = tuple(path for path in paths if path in status.changed)
    staged_touched = tuple(path for path in paths if path in status.staged)
    staged_elsewhere = tuple(path for path in status.staged if path not in paths)
    tree_blobs = {**head_blobs, **checkout.work_tree_blobs(changed)} if changed else head_blobs
    base = replace(base, local_changes=changed, staged_touched=staged_touched,
                   staged_elsewhere=staged_elsewhere)
    exact = patchset.positions()
    if head_blobs in exact:
        head = exact.index(head_blobs)
        tree = exact.index(tree_blobs) if tree_blobs in exact else None
        patch_files = [str(patch.path) for patch in patchset.patches]
        start = head if tree is None else tree
        return replace(
            base, head=head, tree=tree,
            undo={n: Change(("-R", patch_files[n - 1])) for n in range(1, len(exact))},
            finish=Change(tuple(patch_files[start:])))
    import tempfile  # only here: most checkouts are recognized without trying a patch

    with tempfile.TemporaryDirectory(prefix="vllm-patches-") as scratch:
        trial = _Trial(checkout, patchset, head_blobs, Path(scratch), three_way)
        return trial.plan(base, tree_blobs)


class _Trial:
    """The patches tried by git in scratch stores (the "tried" way of the module docstring).

    Stores under ``scratch``: ``replay`` holds the release's post-images replayed onto its
    own blobs; ``back`` the reverse steps (reads ``replay``); ``forth`` the forward steps
    (reads the checkout only, as ``git am`` would); ``diff`` reads them all to write the
    changes ``revert`` and ``apply --no-commit`` make.
    """

    def __init__(self, checkout: Checkout, patchset: PatchSet, head_blobs: Blobs, scratch: Path,
                 three_way: bool):
        self.repo = checkout.path
        self.patchset = patchset
        self.head_blobs = head_blobs
        self.paths = patchset.paths()
        self.scratch = scratch
        self.three_way = three_way
        self.trees: dict[int, str] = {}
        self.blobs: dict[int, Blobs] = {}

    def _env(self, name: str, reads: tuple[str, ...] = ()) -> dict[str, str]:
        return {**_git.ISOLATED_ENV, **_git.scratch_env(
            self.repo, self.scratch / name, tuple(self.scratch / r for r in reads))}

    def plan(self, base: Plan, tree_blobs: Blobs) -> Plan:
        self._replay()
        head = self._walk_back()
        ahead, first_merge = self._walk_forth(head)
        tree = next((n for n, blobs in self.blobs.items() if blobs == tree_blobs), None)
        diff_env = self._env("diff", ("replay", "back", "forth"))
        undo = {n: self._diff(diff_env, n, n - 1) for n in range(1, max(head, tree or 0) + 1)}
        start = head if tree is None else tree
        last = len(self.patchset.patches)
        finish = None
        if last in self.trees and (self.three_way or first_merge is None or first_merge <= start):
            finish = self._diff(diff_env, start, last)
        return replace(base, head=head, tree=tree, ahead=ahead, undo=undo, finish=finish)

    def _replay(self) -> None:
        """The release's post-images, from its own blobs when the repository has them."""
        env = self._env("replay")
        patches = self.patchset.patches
        first = self.patchset.positions()[0]
        wanted = [blob for blob in first.values() if blob]
        found = _git.run(self.repo, "cat-file", "--batch-check", env=env,
                         input="".join(f"{blob}\n" for blob in wanted)).stdout
        if "missing" in found:
            return
        modes = {path: next(p.changes[path].mode for p in patches if path in p.changes)
                 for path in first}
        entries = "".join(f"{modes[path]} {blob}\t{path}\n" for path, blob in first.items() if blob)
        _git.run(self.repo, "update-index", "--add", "--index-info", env=env, input=entries)
        _git.run(self.repo, "apply", "--cached", *(str(p.path) for p in patches), env=env,
                 check=False)

    def _state(self, env: dict[str, str]) -> Blobs | None:
        """The touched files' blobs in the scratch index; None while a merge conflicts."""
        listed = _git.run(self.repo, "ls-files", "-s", "-z", "--", *self.paths, env=env).stdout
        blobs: Blobs = dict.fromkeys(self.paths)
        for entry in filter(None, listed.split("\0")):
            info, path = entry.split("\t", 1)
            _mode, blob, stage = info.split()
            if stage != "0":
                return None
            blobs[path] = blob
        return blobs

    def _step(self, env: dict[str, str], patch: Patch, reverse: bool) -> tuple[bool, bool, str]:
        """Apply ``patch`` to the scratch index, plainly or else by a 3-way merge that
        changes something: (done, merged, git's reason the plain apply failed)."""
        direction = ("-R",) if reverse else ()
        plain = _git.run(self.repo, "apply", "--cached", *direction, str(patch.path), env=env,
                         check=False)
        if plain.returncode == 0:
            return True, False, ""
        reason = _git.reason(plain.stderr)
        before = self._state(env)
        merged = _git.run(self.repo, "apply", "--cached", "--3way", *direction, str(patch.path),
                          env=env, check=False)
        after = self._state(env)
        if merged.returncode == 0 and after is not None and after != before:
            return True, True, reason
        if after is None:  # conflicts left in the scratch index
            files = [line.split("'")[1] for line in merged.stderr.splitlines()
                     if "with conflicts" in line and "'" in line]
            reason += f"; a 3-way merge conflicts in {', '.join(files) or 'the files'}"
        elif merged.returncode == 0:
            reason += "; its changes are already there"
        return False, False, reason

    def _record(self, env: dict[str, str], position: int) -> None:
        self.blobs[position] = self._state(env) or {}
        self.trees[position] = _git.run(self.repo, "write-tree", env=env).stdout.strip()

    def _walk_back(self) -> int:
        """HEAD's position: the longest prefix whose patches reverse-apply, newest first."""
        env = self._env("back", ("replay",))
        patches = self.patchset.patches
        head_tree = _git.run(self.repo, "rev-parse", "HEAD^{tree}", env=env).stdout.strip()
        for count in range(len(patches), 0, -1):
            _git.run(self.repo, "read-tree", "HEAD", env=env)
            steps: dict[int, tuple[Blobs, str]] = {}
            for number in range(count, 0, -1):
                done, _merged, _reason = self._step(env, patches[number - 1], reverse=True)
                if not done:
                    break
                steps[number - 1] = (self._state(env) or {}, _git.run(
                    self.repo, "write-tree", env=env).stdout.strip())
            else:
                self.trees[count] = head_tree
                self.blobs[count] = self.head_blobs
                for position, (blobs, tree) in steps.items():
                    self.blobs[position], self.trees[position] = blobs, tree
                return count
        return 0

    def _walk_forth(self, head: int) -> tuple[dict[int, tuple[State, str]], int | None]:
        """From HEAD's position, each later patch in order: applicable (plainly or by a
        3-way merge) or the first conflict, everything after it waiting for it. Positions
        reached by a merge are recorded even without ``--3way``, so that a work tree there
        is recognized. Returns the states and the first patch that needed a merge."""
        env = self._env("forth")
        patches = self.patchset.patches
        _git.run(self.repo, "read-tree", "HEAD", env=env)
        self._record(env, head)
        ahead: dict[int, tuple[State, str]] = {}
        first_merge: int | None = None
        for number in range(head + 1, len(patches) + 1):
            patch = patches[number - 1]
            done, merged, reason = self._step(env, patch, reverse=False)
            blocked = first_merge is not None and not self.three_way
            if not done:
                blocker = patches[first_merge - 1] if blocked else patch
                ahead[number] = ((State.CONFLICT, f"needs {blocker.fix.id} first") if blocked
                                 else (State.CONFLICT, reason))
                for later in range(number + 1, len(patches) + 1):
                    ahead[later] = (State.CONFLICT, f"needs {blocker.fix.id} first")
                break
            self._record(env, number)
            if blocked:
                ahead[number] = (State.CONFLICT, f"needs {patches[first_merge - 1].fix.id} first")
            elif merged and not self.three_way:
                first_merge = number
                ahead[number] = (State.CONFLICT, f"{reason}; it merges with --3way")
            else:
                first_merge = number if merged and first_merge is None else first_merge
                detail = f"{patch.path.name}, by a 3-way merge" if merged else patch.path.name
                ahead[number] = (State.APPLICABLE, detail)
        return ahead, first_merge

    def _diff(self, env: dict[str, str], start: int, end: int) -> Change:
        text = _git.run(self.repo, "diff", "--full-index", "--binary", "--no-renames",
                        "--no-ext-diff", "--no-textconv", self.trees[start], self.trees[end],
                        "--", *self.paths, env=env).stdout
        return Change(("-",), text)


# ------------------------------------------------------------------ which release


def resolve_release(checkout: Checkout, series: Series, given: Version | None,
                    verb: str) -> Version:
    """The covered release ``checkout`` is; else one line that names the covered release
    it resembles most and the command to run with it.

    ``given`` (``--release``) is for a checkout that does not say its release, or says
    one the series does not cover (a newer release: `--release v0.33.0 --3way`). A
    checkout that says a covered release is that release: a ``given`` other than it is
    refused, naming what the checkout says, rather than planning another release's
    patches on it."""
    identified = _releases.identify(checkout.path)
    said = identified.release
    if given is not None and said is not None and said != given and said in series.covered:
        covered = "" if given in series.covered else (
            f", which is not a release the series covers ({series.describe_covered()})")
        raise UserError(f"{checkout.path}: it is vLLM v{said} ({identified.source} says so), "
                        f"not --release v{given}{covered}; drop --release (it is for a "
                        f"checkout that does not say its release)")
    if given is not None:
        if given in series.covered:
            return given
        raise _uncovered(checkout, series, f"vLLM v{given} is not a release the series "
                         f"covers ({series.describe_covered()})", given, verb)
    if said in series.covered:
        return said
    if said is not None:
        raise _uncovered(checkout, series, f"vLLM v{said} is not a release the "
                         f"series covers ({series.describe_covered()})", said, verb)
    raise _uncovered(checkout, series, identified.why, identified.hint, verb)


def _uncovered(checkout: Checkout, series: Series, why: str, hint: Version | None,
               verb: str) -> UserError:
    """``--3way`` is advised only where the checkout's files differ from the release's."""
    nearest, evidence, exact = nearest_release(checkout, series, hint)
    three_way = "" if exact else " --3way"
    return UserError(f"{checkout.path}: {why}; it resembles v{nearest} ({evidence}): run "
                     f"`vllm-patches {verb} --release v{nearest}{three_way} {checkout.path}`")


def nearest_release(checkout: Checkout, series: Series,
                    hint: Version | None) -> tuple[Version, str, bool]:
    """The covered release whose files the checkout shares most (any position of its
    series counts), ties and no shared file going to the newest release at or before
    ``hint`` (a version or release tag the checkout carries); with the evidence, in words,
    and whether every file its patches change is as in that release."""
    patchsets = []
    for release in series.covered:
        try:
            patchsets.append(PatchSet.load(series, release))
        except UserError:
            continue
    paths = sorted({path for ps in patchsets for path in ps.paths()})
    head = checkout.head_blobs(paths)

    def shared(patchset: PatchSet) -> int:
        return max((sum(head[path] == blob for path, blob in blobs.items() if blob)
                    for blobs in patchset.positions()), default=0)

    scores = {ps.release: (shared(ps), len(ps.paths())) for ps in patchsets}
    before = [r for r in series.covered if hint is None or r <= hint] or [series.covered[0]]
    preferred = before[-1]
    best = max(series.covered, key=lambda r: (scores.get(r, (0, 0))[0], r == preferred, r))
    count, total = scores.get(best, (0, 0))
    if count:
        return (best, f"{count} of the {total} files its patches change are as in v{best}",
                count == total)
    if hint is not None:
        return preferred, (f"no file its patches change is as in a covered release; "
                           f"v{preferred} is the newest covered release at or before "
                           f"{hint}"), False
    return preferred, ("no file its patches change is as in a covered release; the newest "
                       "one"), False
