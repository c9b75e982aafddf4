"""What the series is on one checkout, worked out once: the release, each fix's state,
the patch files, and which of the release's patches HEAD and the work tree hold.

`status` prints a plan; `apply` and `revert` carry it out (``apply_revert``). A tree holds a
*set* of the patches, applied in series order and undone newest first. The set is
recognized exactly from blob ids (``PatchSet.recognize``) when it can be, else git
tries the patches in scratch indexes (``_git.scratch_env``), plainly or with ``--3way``
as ``git am --3way`` in the checkout would; the checkout is only read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.version import Version

from vllm_patches import _git
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog.patchset import Blobs, Patch, PatchSet
from vllm_patches._catalog.series import Fix, Need, Series
from vllm_patches._checkout.checkout import Checkout
from vllm_patches._errors import UserError

# Patch numbers (1-based, series order) of the release's patches a tree holds.
Numbers = frozenset[int]
# Where a set was found: from HEAD's tree, or from the work tree's.
HEAD, WORK = "HEAD", "work"


class State(enum.Enum):
    """Where a needed fix's patch is on the checkout (a fix not needed has ``Fix.on``'s
    ``Need`` instead)."""

    APPLICABLE = "applicable"
    APPLIED = "applied"
    UNCOMMITTED = "applied, not committed"  # in the work tree, not in HEAD
    REVERTED_UNCOMMITTED = "reverted, not committed"  # in HEAD, not in the work tree
    CONFLICT = "conflict"
    BLOCKED = "blocked"  # requires a fix that conflicts, is blocked, or is not chosen


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


def combined(changes: list[Change]) -> Change:
    """One ``git apply`` of ``changes`` in order (git applies a file's diffs in turn)."""
    if all(change.text is None for change in changes):
        return Change(tuple(arg for change in changes for arg in change.args))
    return Change(("-",), "".join(change.text or "" for change in changes))


@dataclass(frozen=True)
class Plan:
    """The series on one checkout (see the module docstring), for the fixes chosen."""

    checkout: Checkout
    series: Series
    release: Version
    three_way: bool
    patches: tuple[Patch, ...]
    chosen: tuple[str, ...] | None  # the fix ids chosen (``--fix``); None: every fix
    head: Numbers  # the patches HEAD holds
    tree: Numbers | None  # those the work tree holds; None: touched files changed otherwise
    local_changes: tuple[str, ...]  # touched files whose work tree or index differs from HEAD
    staged_touched: tuple[str, ...]  # touched files with staged changes
    staged_elsewhere: tuple[str, ...]  # other files with staged changes (git am would commit them)
    # Patch number -> its state when chosen and in neither HEAD nor the work tree;
    # missing: applicable.
    ahead: dict[int, tuple[State, str]] = field(default_factory=dict)
    # From the work tree's set: the change that applies the applicable chosen patches.
    finish: Change | None = None
    # From HEAD's set and from the work tree's: the chosen patches it holds, newest
    # first, each with the change that undoes it.
    undo: dict[Numbers, tuple[tuple[int, Change], ...]] = field(default_factory=dict)

    def chooses(self, fix: Fix) -> bool:
        return self.chosen is None or fix.id in self.chosen

    @property
    def selected(self) -> Numbers:
        """The numbers of the chosen fixes' patches."""
        return frozenset(n for n, patch in enumerate(self.patches, start=1)
                         if self.chooses(patch.fix))

    @property
    def statuses(self) -> list[FixStatus]:
        """Every chosen fix of the series on this checkout, in series order."""
        numbered = {patch.fix.id: (number, patch)
                    for number, patch in enumerate(self.patches, start=1)}
        result = []
        for fix in filter(self.chooses, self.series.fixes):
            if fix.id in numbered:
                number, patch = numbered[fix.id]
                state, detail = self._patch_state(number, patch)
                result.append(FixStatus(fix, state, detail, patch))
            else:
                verdict = fix.on(self.release)
                result.append(FixStatus(fix, verdict.need, verdict.detail))
        return result

    def required(self, fix: Fix) -> list[int]:
        """The patches of this release whose fixes ``fix`` requires, directly or not (a
        requirement upstream or not needed here has none)."""
        ids = {f.id for f in self.series.with_requirements(fix, self.release) if f is not fix}
        return [n for n, patch in enumerate(self.patches, start=1) if patch.fix.id in ids]

    def stranded(self, numbers: Numbers) -> list[tuple[Fix, list[str]]]:
        """The fixes ``numbers`` holds that are not chosen but require chosen ones it
        holds (reverting those would leave them without what they are built on), each
        with the chosen fix ids it requires."""
        result = []
        for number in sorted(numbers):
            fix = self.patches[number - 1].fix
            required = [self.patches[n - 1].fix.id for n in self.required(fix)
                        if n in numbers and self.chooses(self.patches[n - 1].fix)]
            if required and not self.chooses(fix):
                result.append((fix, required))
        return result

    def _patch_state(self, number: int, patch: Patch) -> tuple[State, str]:
        tree = self.head if self.tree is None else self.tree
        if number in self.head and number in tree:
            return State.APPLIED, ""
        if number in tree:
            return State.UNCOMMITTED, ""
        if number in self.head:
            return State.REVERTED_UNCOMMITTED, ""
        return self.ahead.get(number, (State.APPLICABLE, patch.path.name))

    def after(self, head: Numbers, tree: Numbers) -> Plan:
        """The plan once an operation moved HEAD and the work tree to these sets."""
        return replace(self, head=head, tree=tree)

    def notes(self) -> list[str]:
        """What else a reader of the statuses must know: foreign local changes."""
        if self.tree is None:
            return ["local changes in files the series touches, not from the series: "
                    + ", ".join(self.local_changes)]
        return []


def make(checkout: Checkout, series: Series, release: Version, three_way: bool,
         chosen: tuple[str, ...] | None = None) -> Plan:
    """The plan of ``release``'s patches on ``checkout`` for the fixes ``chosen`` (every
    fix when None; see the module docstring)."""
    patchset = PatchSet.load(series, release)
    base = Plan(checkout, series, release, three_way, patchset.patches, chosen,
                head=frozenset(), tree=frozenset(), local_changes=(), staged_touched=(),
                staged_elsewhere=())
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
    head = patchset.recognize(head_blobs)
    if head is not None:
        tree = patchset.recognize(tree_blobs)
        try:
            return _Walks(base, _Exact(patchset)).plan(head, tree)
        except _NotExact:
            pass
    import tempfile  # only here: most checkouts are recognized without trying a patch

    with tempfile.TemporaryDirectory(prefix="vllm-patches-") as scratch:
        trial = _Trial(checkout, patchset, Path(scratch))
        head = trial.walk_back(trial.head_tree, HEAD)
        tree = head if not changed else trial.work_tree_set(changed, tree_blobs)
        return _Walks(base, trial).plan(head, tree)


class _NotExact(Exception):
    """A step the patch ids alone cannot vouch for: git must try it."""


class _Walks:
    """The walks a plan is made of, the same for both ways of stepping (``_Exact``,
    ``_Trial``): forward from HEAD's set over the chosen patches (their states), forward
    from the work tree's set (``finish``), and back from each set over the chosen
    patches it holds (``undo``)."""

    def __init__(self, base: Plan, walker: _Exact | _Trial):
        self.base = base
        self.walker = walker
        self.patches = base.patches
        self.selected = base.selected

    def plan(self, head: Numbers, tree: Numbers | None) -> Plan:
        ahead, changes = self._ahead(head, keep=tree == head)
        finish = None
        undo = {head: self._undo(head, HEAD)}
        if tree == head:  # the walk from HEAD was the work tree's too
            finish = combined([changes[n] for n in sorted(changes)])
        elif tree is not None:
            finish = self._finish(tree, head, ahead)
            undo[tree] = self._undo(tree, WORK)
        return replace(self.base, head=head, tree=tree, ahead=ahead, finish=finish, undo=undo)

    def _ahead(self, head: Numbers,
               keep: bool) -> tuple[dict[int, tuple[State, str]], dict[int, Change]]:
        """From HEAD's set, each chosen patch it lacks, in series order: applicable
        (plainly or by a 3-way merge), a conflict, or blocked by a requirement that is
        neither held, nor chosen, nor applicable; the next one is tried without it. With
        ``keep``, also the change each applicable one makes."""
        self.walker.begin(head, forward=True, start=HEAD)
        ahead: dict[int, tuple[State, str]] = {}
        changes: dict[int, Change] = {}
        for number in sorted(self.selected - head):
            patch = self.patches[number - 1]
            stuck = [n for n in self.base.required(patch.fix) if n not in head and (
                n not in self.selected or ahead.get(n, (State.APPLICABLE,))[0]
                is not State.APPLICABLE)]
            if stuck:
                ahead[number] = (State.BLOCKED, "; ".join(
                    self._why_blocked(n, ahead) for n in stuck))
                continue
            done, merged, reason, change = self.walker.step(
                number, reverse=False, merge=self.base.three_way, keep=keep)
            if done:
                detail = f"{patch.path.name}, by a 3-way merge" if merged else patch.path.name
                ahead[number] = (State.APPLICABLE, detail)
                if change is not None:
                    changes[number] = change
            else:
                ahead[number] = (State.CONFLICT, reason)
        return ahead, changes

    def _why_blocked(self, number: int, ahead: dict[int, tuple[State, str]]) -> str:
        """Why a fix that requires patch ``number`` cannot go on."""
        required = self.patches[number - 1].fix.id
        if number not in self.selected:
            return f"requires {required}, which is neither applied nor chosen"
        state = ahead[number][0]
        return f"requires {required}, which {'conflicts' if state is State.CONFLICT else 'is blocked'}"

    def _finish(self, tree: Numbers, head: Numbers,
                ahead: dict[int, tuple[State, str]]) -> Change | None:
        """The change that takes the work tree (at another set than HEAD) to it plus
        every chosen patch HEAD holds or that is applicable; None where git cannot make
        a step there."""
        todo = [n for n in sorted(self.selected - tree)
                if n in head or ahead[n][0] is State.APPLICABLE]
        self.walker.begin(tree, forward=True, start=WORK)
        changes = []
        for number in todo:
            done, _merged, _reason, change = self.walker.step(
                number, reverse=False, merge=self.base.three_way, keep=True)
            if not done:
                return None
            changes.append(change)
        return combined(changes)

    def _undo(self, numbers: Numbers, start: str) -> tuple[tuple[int, Change], ...]:
        """Each chosen patch ``numbers`` holds, newest first, with the change that undoes
        it (a merge allowed: the series may have been applied with --3way); none where
        a fix that stays requires one of them (`revert` refuses that)."""
        if self.base.stranded(numbers):
            return ()
        self.walker.begin(numbers, forward=False, start=start)
        steps = []
        for number in sorted(numbers & self.selected, reverse=True):
            done, _merged, _reason, change = self.walker.step(number, reverse=True, merge=True,
                                                               keep=True)
            if not done:
                return ()
            steps.append((number, change))
        return tuple(steps)


class _Exact:
    """Steps vouched for by the patch ids: a patch applies exactly where its files hold
    its pre-image ids (reversed: its post-image ids); anything else is ``_NotExact``."""

    def __init__(self, patchset: PatchSet):
        self.patchset = patchset
        self.blobs: Blobs = {}

    def begin(self, numbers: Numbers, forward: bool, start: str) -> None:
        blobs = self.patchset.blobs_of(numbers)
        if blobs is None:
            raise _NotExact
        self.blobs = blobs

    def step(self, number: int, reverse: bool, merge: bool,
             keep: bool) -> tuple[bool, bool, str, Change | None]:
        patch = self.patchset.patches[number - 1]
        for path, change in patch.changes.items():
            if self.blobs[path] != (change.after if reverse else change.before):
                raise _NotExact
        for path, change in patch.changes.items():
            self.blobs[path] = change.before if reverse else change.after
        return True, False, "", Change((*(("-R",) if reverse else ()), str(patch.path)))


class _Trial:
    """The patches tried by git in scratch stores (the "tried" way of the module docstring).

    Stores under ``scratch``: ``replay`` holds the release's post-images replayed onto its
    own blobs; ``work`` the work tree's touched files; ``back`` the reverse steps (reads
    ``replay`` and ``work``); ``forth`` the forward steps from HEAD (reads the checkout
    only, as ``git am`` would); ``finish`` those from the work tree (reads ``work`` too).
    """

    def __init__(self, checkout: Checkout, patchset: PatchSet, scratch: Path):
        self.repo = checkout.path
        self.patchset = patchset
        self.paths = patchset.paths()
        self.scratch = scratch
        self.trees: dict[tuple[str, Numbers], str] = {}  # (walk's start, set) -> tree id
        self.env: dict[str, str] = {}
        self.head_tree = _git.run(self.repo, "rev-parse", "HEAD^{tree}").stdout.strip()
        self._replay()

    def _env(self, name: str, reads: tuple[str, ...] = ()) -> dict[str, str]:
        return {**_git.ISOLATED_ENV, **_git.scratch_env(
            self.repo, self.scratch / name, tuple(self.scratch / r for r in reads))}

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

    def work_tree_set(self, changed: tuple[str, ...], tree_blobs: Blobs) -> Numbers | None:
        """The patches the work tree holds, found like HEAD's from its touched files
        (written into the ``work`` store); None when undoing them does not lead where
        undoing HEAD's does: the files carry other changes."""
        env = self._env("work")
        _git.run(self.repo, "read-tree", "HEAD", env=env)
        present = [path for path in changed if tree_blobs[path]]
        ids = _git.run(self.repo, "hash-object", "-w", "--stdin-paths", env=env,
                       input="".join(f"{path}\n" for path in present)).stdout.split()
        entries = "".join(f"100644 {blob}\t{path}\n" for path, blob in zip(present, ids))
        entries += "".join(f"0 {'0' * 40}\t{path}\n" for path in changed
                           if not tree_blobs[path])
        _git.run(self.repo, "update-index", "--add", "--index-info", env=env, input=entries)
        work_tree = _git.run(self.repo, "write-tree", env=env).stdout.strip()
        found = self.walk_back(work_tree, WORK)
        if self.trees[(WORK, frozenset())] != self.trees[(HEAD, frozenset())]:
            return None
        return found

    def walk_back(self, start_tree: str, start: str) -> Numbers:
        """The patches the tree ``start_tree`` holds: newest first, each one that
        reverse-applies (plainly, or by a 3-way merge that changes the tree). Records
        the tree of each set on the way down to the empty one, under ``start``."""
        self.env = self._env("back", ("replay", "work"))
        _git.run(self.repo, "read-tree", start_tree, env=self.env)
        undone: list[int] = []
        walked: list[tuple[Numbers, str]] = []
        for number in range(len(self.patchset.patches), 0, -1):
            before = self._tree()
            if self._try(number, reverse=True, merge=True, before=before)[0]:
                undone.append(number)
                walked.append((frozenset(undone), self._tree()))
        held = frozenset(undone)
        self.trees[(start, held)] = start_tree
        for gone, tree in walked:
            self.trees[(start, held - gone)] = tree
        return held

    def begin(self, numbers: Numbers, forward: bool, start: str) -> None:
        """Put the scratch index at the tree of ``numbers`` found from ``start`` (else
        from HEAD), for forward or reverse steps."""
        if (start, numbers) not in self.trees:
            start = HEAD
        if not forward:
            self.env = self._env("back", ("replay", "work"))
        else:  # the work tree's own files are read only when it is the start
            self.env = self._env("finish", ("work",)) if start == WORK else self._env("forth")
        _git.run(self.repo, "read-tree", self.trees[(start, numbers)], env=self.env)

    def step(self, number: int, reverse: bool, merge: bool,
             keep: bool) -> tuple[bool, bool, str, Change | None]:
        """``_try``, and with ``keep`` the change the step made, as a diff."""
        before = self._tree()
        done, merged, reason = self._try(number, reverse, merge, before)
        return done, merged, reason, self._diff(before, self._tree()) if keep and done else None

    def _tree(self) -> str:
        return _git.run(self.repo, "write-tree", env=self.env).stdout.strip()

    def _try(self, number: int, reverse: bool, merge: bool,
             before: str) -> tuple[bool, bool, str]:
        """Apply patch ``number`` to the scratch index (whose tree is ``before``),
        plainly or else by a 3-way merge that changes something (kept only with
        ``merge``): (done, merged, git's reason the plain apply failed). A failed step
        leaves the index as it was."""
        patch = self.patchset.patches[number - 1]
        direction = ("-R",) if reverse else ()
        plain = _git.run(self.repo, "apply", "--cached", *direction, str(patch.path),
                         env=self.env, check=False)
        if plain.returncode == 0:
            return True, False, ""
        reason = _git.reason(plain.stderr)
        merged = _git.run(self.repo, "apply", "--cached", "--3way", *direction,
                          str(patch.path), env=self.env, check=False)
        conflicted = self._conflicted()
        changed = not conflicted and self._tree() != before
        if merged.returncode == 0 and changed and merge:
            return True, True, reason
        if merged.returncode == 0 and changed:
            reason += "; it merges with --3way"
        elif conflicted:  # conflicts left in the scratch index
            files = [line.split("'")[1] for line in merged.stderr.splitlines()
                     if "with conflicts" in line and "'" in line]
            reason += f"; a 3-way merge conflicts in {', '.join(files) or 'the files'}"
        elif merged.returncode == 0:
            reason += "; its changes are already there"
        _git.run(self.repo, "read-tree", before, env=self.env)
        return False, False, reason

    def _conflicted(self) -> bool:
        """Whether a merge left conflicts (entries of stage 1 to 3) in the scratch index."""
        listed = _git.run(self.repo, "ls-files", "-s", "-z", "--", *self.paths,
                          env=self.env).stdout
        return any(entry.split("\t", 1)[0].split()[2] != "0"
                   for entry in filter(None, listed.split("\0")))

    def _diff(self, start: str, end: str) -> Change:
        text = _git.run(self.repo, "diff", "--full-index", "--binary", "--no-renames",
                        "--no-ext-diff", "--no-textconv", start, end, "--", *self.paths,
                        env=self.env).stdout
        return Change(("-",), text)


# ------------------------------------------------------------------ which release


def resolve_release(checkout: Checkout, series: Series, given: Version | None,
                    verb: str) -> Version:
    """The covered release ``checkout`` is; else one line that names the covered release it
    resembles most and the command to run with it. ``given`` (``--release``) never overrides a
    covered release the checkout says it is."""
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
