"""A user's vLLM checkout and what the series is on it: status, apply, revert.

Every verb first works out the state of each patch in a scratch index (the user's
index and work tree are not touched), and changes the checkout only when the whole
series can go; a failure midway is rolled back, so a refused or failed operation
leaves the checkout as it was.
"""

from __future__ import annotations

import enum
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from vllm_patches import _git, _patches, _releases
from vllm_patches._errors import Refused, UserError
from vllm_patches._git import GitError
from vllm_patches._series import Fix, Series


class State(enum.Enum):
    APPLICABLE = "applicable"
    APPLIED = "applied"
    UPSTREAM = "upstream"
    NOT_APPLICABLE = "not applicable"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class FixStatus:
    fix: Fix
    state: State
    detail: str = ""
    patch: Path | None = None

    def line(self) -> str:
        text = f"{self.fix.id:<4} {self.fix.slug:<40} {self.state.value}"
        return f"{text} ({self.detail})" if self.detail else text


class Checkout:
    """A vLLM source tree under git, at a known release."""

    def __init__(self, path: Path, release: Version | None, series: Series):
        self.path = path.resolve()
        if not self.path.is_dir():
            raise UserError(f"{path}: no such directory")
        if not _git.is_repo(self.path):
            raise UserError(f"{path}: not a git repository (git init && git add -A && git commit it first)")
        if _git.run(self.path, "rev-parse", "--show-toplevel").stdout.strip() != str(self.path):
            raise UserError(f"{path}: not the top of its git repository")
        if not (self.path / "vllm" / "v1").is_dir():
            raise UserError(f"{path}: not a vLLM source tree (no vllm/v1/)")
        if not _git.has_ref(self.path, "HEAD"):
            raise UserError(f"{path}: the repository has no commit yet")
        self.release = release or _releases.detect_release(self.path)
        series.require_supported(self.release)
        self.series = series

    def statuses(self) -> list[FixStatus]:
        """The state of every fix of the series on this checkout, in series order."""
        patches = dict(zip(self._applicable_ids(), _patches.series_patches(self.release)))
        states = self._patch_states(list(patches.values()))
        result = []
        for fix in self.series.fixes:
            if fix.id in patches:
                state, detail = states[fix.id]
                result.append(FixStatus(fix, state, detail, patches[fix.id]))
            elif fix.is_upstream(self.release):
                result.append(FixStatus(fix, State.UPSTREAM, f"since v{fix.upstream_since}"))
            else:
                result.append(FixStatus(fix, State.NOT_APPLICABLE, fix.verdict(self.release)
                                        .removeprefix("not applicable: ")))
        return result

    def _applicable_ids(self) -> list[str]:
        ids = [fix.id for fix in self.series.applicable(self.release)]
        committed = _patches.series_patches(self.release)
        if len(committed) != len(ids):
            raise UserError(
                f"patches/v{self.release} does not match the series; run `vllm-patches regen`"
            )
        return ids

    def _patch_states(self, patches: list[Path]) -> dict[str, tuple[State, str]]:
        """Per fix id: applicable / applied / conflict, judged on HEAD's tree.

        Applied patches can only form a prefix of the series (git am stops at the
        first failure): the longest prefix that reverse-applies, newest first, is
        applied; the rest are forward-checked on top of HEAD, in order.
        """
        ids = self._applicable_ids()
        with _ScratchIndex(self.path) as scratch:
            applied = 0
            for count in range(len(patches), 0, -1):
                scratch.reset()
                if all(scratch.apply(p, reverse=True) is None for p in reversed(patches[:count])):
                    applied = count
                    break
            states = {fix_id: (State.APPLIED, "") for fix_id in ids[:applied]}
            scratch.reset()
            blocked = None
            for fix_id, patch in zip(ids[applied:], patches[applied:]):
                error = None if blocked else scratch.apply(patch)
                if blocked:
                    states[fix_id] = (State.CONFLICT, f"needs {blocked} first")
                elif error is None:
                    states[fix_id] = (State.APPLICABLE, patch.name)
                else:
                    states[fix_id] = (State.CONFLICT, error)
                    blocked = fix_id
        return states

    def _touched_paths(self) -> list[str]:
        return sorted({Fix.upstream_path(o) for f in self.series.applicable(self.release)
                       for o in f.overlays})

    def _require_clean(self) -> None:
        dirty = _git.run(self.path, "status", "--porcelain", "--", *self._touched_paths()).stdout
        if dirty.strip():
            files = ", ".join(line[3:] for line in dirty.splitlines())
            raise Refused(f"{self.path}: uncommitted changes in files the series touches: {files}")

    def _plan(self, want: State) -> list[FixStatus]:
        """The patches to move out of state ``want``; [] when none is in it.

        Refuses when a patch conflicts or the series is half-applied: only a
        whole series is ever applied or reverted.
        """
        statuses = [s for s in self.statuses() if s.patch is not None]
        conflicts = [s for s in statuses if s.state is State.CONFLICT]
        if conflicts:
            raise Refused("; ".join(f"{s.fix.id} conflicts: {s.detail}" for s in conflicts))
        if len({s.state for s in statuses}) > 1:
            applied = ", ".join(s.fix.id for s in statuses if s.state is State.APPLIED)
            raise Refused(
                f"{self.path}: half-applied series ({applied} applied, the rest not); "
                "revert the applied fixes or finish them by hand first"
            )
        return [s for s in statuses if s.state is want]

    def apply(self, commit: bool, three_way: bool, check: bool) -> list[FixStatus]:
        """Apply every applicable patch, all or nothing; returns what was (or would be) applied."""
        self._require_clean()
        statuses = self._plan(State.APPLICABLE)
        patches = [str(s.patch) for s in statuses]
        if check or not patches:
            return statuses
        if commit:
            if _git.run(self.path, "diff", "--cached", "--quiet", check=False).returncode != 0:
                raise Refused(f"{self.path}: the index has staged changes; git am needs it clean")
            args = ["am", "--quiet", "--keep-non-patch", *(["--3way"] if three_way else []), *patches]
            self._all_or_nothing(args, undo=("am", "--abort"))
        else:
            args = ["apply", *(["--3way"] if three_way else []), *patches]
            _git.run(self.path, *args)  # git apply is atomic over all the patches it is given
        return statuses

    def revert(self, commit: bool, check: bool) -> list[FixStatus]:
        """Undo every applied patch (newest first), all or nothing."""
        self._require_clean()
        statuses = self._plan(State.APPLIED)
        if check or not statuses:
            return statuses
        patches = [str(s.patch) for s in reversed(statuses)]
        if not commit:
            _git.run(self.path, "apply", "--reverse", *patches)
            return statuses
        start = _git.head(self.path)
        try:
            for status in reversed(statuses):
                _git.run(self.path, "apply", "--reverse", "--index", str(status.patch))
                _git.run(self.path, "commit", "--quiet", "--no-verify", "-m",
                         f'Revert "{status.fix.title}"\n\nVllm-Patches-Fix: {status.fix.id}',
                         env=_identity_env(self.path))
        except GitError:
            _git.run(self.path, "reset", "--quiet", "--keep", start)
            raise
        return statuses

    def _all_or_nothing(self, args: list[str], undo: tuple[str, ...]) -> None:
        start = _git.head(self.path)
        try:
            _git.run(self.path, *args, env=_identity_env(self.path))
        except GitError:
            _git.run(self.path, *undo, check=False)
            if _git.head(self.path) != start:
                _git.run(self.path, "reset", "--quiet", "--keep", start)
            raise


def _identity_env(repo: Path) -> dict[str, str]:
    """A committer identity for git am/commit where the user has none configured."""
    if _git.run(repo, "config", "user.email", check=False).returncode == 0:
        return {}
    return {"GIT_COMMITTER_NAME": _patches.PATCH_AUTHOR_NAME,
            "GIT_COMMITTER_EMAIL": _patches.PATCH_AUTHOR_EMAIL,
            "GIT_AUTHOR_NAME": _patches.PATCH_AUTHOR_NAME,
            "GIT_AUTHOR_EMAIL": _patches.PATCH_AUTHOR_EMAIL}


class _ScratchIndex:
    """A throwaway index holding HEAD's tree, to try patches without touching the checkout."""

    def __init__(self, repo: Path):
        self.repo = repo

    def __enter__(self) -> _ScratchIndex:
        self._dir = tempfile.TemporaryDirectory()
        self.env = {"GIT_INDEX_FILE": os.path.join(self._dir.name, "index")}
        return self

    def __exit__(self, *exc: object) -> None:
        self._dir.cleanup()

    def reset(self) -> None:
        _git.run(self.repo, "read-tree", "HEAD", env=self.env)

    def apply(self, patch: Path, reverse: bool = False) -> str | None:
        """Apply ``patch`` to the scratch index; None, or git's reason it does not apply."""
        args = ["apply", "--cached", *(["--reverse"] if reverse else []), str(patch)]
        proc = _git.run(self.repo, *args, env=self.env, check=False)
        if proc.returncode == 0:
            return None
        reasons = [line.removeprefix("error: ") for line in proc.stderr.splitlines()
                   if line.startswith("error:")]
        return "; ".join(reasons) or proc.stderr.strip()
