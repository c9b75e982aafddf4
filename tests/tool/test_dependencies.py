"""``requires`` is true for every fix: a fix's committed patch applies on the release
without the fixes it does not require, and does not apply without one it requires.

`apply --fix` applies any set of the release's patches that holds each one's
requirements, in series order, and a conflicting fix leaves the fixes that do not
require it applicable (``_checkout.plan``). Both rest on this: patch k is generated on top of
patches 1..k-1, so a patch could depend on an earlier one's lines without the
metadata saying so. Checked on the lanes (the newest covered release among them), in a
scratch index and object store: the cached release is only read.
"""

import itertools
from pathlib import Path

import pytest

from vllm_patches import _git
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.patchset import FileChange, Patch, PatchSet

SERIES = _series.load()
RELEASES = sorted(set(SERIES.lanes))


def applies(tree: Path, scratch: Path, patches: list[Patch]) -> str | None:
    """None when ``patches`` apply plainly, in this order, on ``tree``'s HEAD; else
    git's reason for the first that does not."""
    env = {**_git.ISOLATED_ENV, **_git.scratch_env(tree, scratch)}
    _git.run(tree, "read-tree", "HEAD", env=env)
    for patch in patches:
        proc = _git.run(tree, "apply", "--cached", str(patch.path), env=env, check=False)
        if proc.returncode != 0:
            return f"{patch.fix.id}: {_git.reason(proc.stderr)}"
    return None


def requirements(patchset: PatchSet, patch: Patch) -> set[str]:
    """The fixes with a patch on this release that ``patch``'s fix requires there,
    directly or not."""
    ids = {p.fix.id for p in patchset.patches}
    wanted = SERIES.with_requirements(patch.fix, patchset.release)
    return {f.id for f in wanted if f is not patch.fix} & ids


def independent_groups(patchset: PatchSet) -> list[list[Patch]]:
    """The patches in groups, each in series order, that share no file and no
    requirement with another group: git applies each file on its own, so a set applies
    when its part in every group does."""
    groups: list[tuple[set[str], list[Patch]]] = []
    for patch in patchset.patches:
        keys = {*patch.changes, patch.fix.id, *requirements(patchset, patch)}
        joined = [group for group in groups if group[0] & keys]
        groups = [group for group in groups if not group[0] & keys]
        members = [p for _, group in joined for p in group] + [patch]
        groups.append((keys.union(*(group_keys for group_keys, _ in joined)),
                       sorted(members, key=patchset.patches.index)))
    return [members for _, members in groups]


@pytest.mark.parametrize("release", RELEASES, ids=str)
def test_every_set_that_holds_its_requirements_applies_in_series_order(release, tmp_path):
    """Every fix alone with what it requires applies on the release (so each fix is
    independent of every fix it does not require), and so does every union of such
    sets: what `apply --fix` and a conflict that blocks one fix leave to apply. The
    unions are tried within each of ``independent_groups`` (all of them at once took
    minutes as the series grew)."""
    tree = _releases.fetch(release)
    patchset = PatchSet.load(SERIES, release)
    tried = 0
    for group in independent_groups(patchset):
        for size in range(1, len(group) + 1):
            for chosen in itertools.combinations(group, size):
                ids = {p.fix.id for p in chosen}
                if any(not requirements(patchset, p) <= ids for p in chosen):
                    continue
                tried += 1
                assert applies(tree, tmp_path / f"set{tried}", list(chosen)) is None, (
                    f"v{release}: {', '.join(sorted(ids))} do not apply in series order "
                    "on the release; declare the requirement in the fix's `requires`")
    assert tried >= len(patchset.patches)


def test_independent_groups_join_patches_through_a_shared_file():
    """Two patches that share no file fall apart; a third that shares a file with each
    joins them, in series order."""
    fixes = [next(f for f in SERIES.fixes if f.id == fid) for fid in ("F2", "F4", "F5")]
    change = FileChange(None, None, "100644")
    a, b, c = (Patch(fix, Path(f"{fix.id}.patch"), dict.fromkeys(files, change))
               for fix, files in zip(fixes, (["x.py"], ["y.py"], ["x.py", "y.py"])))
    two = PatchSet(SERIES.newest, (a, b))
    assert [[p.fix.id for p in g] for g in independent_groups(two)] == [["F2"], ["F4"]]
    three = PatchSet(SERIES.newest, (a, b, c))
    assert [[p.fix.id for p in g] for g in independent_groups(three)] == [["F2", "F4", "F5"]]


@pytest.mark.parametrize("release", RELEASES, ids=str)
def test_a_fix_does_not_apply_without_a_fix_it_requires(release, tmp_path):
    """Each declared requirement is one of the patch: the fix's patch fails on the
    release with every other patch but the required one (and the fixes built on it).
    F3's hooks are F2's: its patch changes lines F2's adds. A requirement the fix names
    in ``requires_at_run_time`` is not of this kind (F12 needs F11's release when it
    runs, not for its patch to apply): its own tests prove it, failing without it."""
    tree = _releases.fetch(release)
    patchset = PatchSet.load(SERIES, release)
    checked = 0
    for patch in patchset.patches:
        for required in requirements(patchset, patch) - set(patch.fix.requires_at_run_time):
            others = [p for p in patchset.patches if p is not patch
                      and p.fix.id != required and required not in requirements(patchset, p)]
            reason = applies(tree, tmp_path / f"without{checked}", [*others, patch])
            assert reason is not None and reason.startswith(f"{patch.fix.id}: "), (
                f"v{release}: {patch.fix.id} applies without {required}, which its "
                f"`requires` names")
            checked += 1
    needed = [f for f in SERIES.applicable(release) if f.requires_on(release)]
    assert checked >= len(needed)

