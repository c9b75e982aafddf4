"""One vllm-patches run at a time per repository: the lock every verb takes on a
checkout before it reads the state its plan is made of.

Two `apply` runs on one checkout used to interleave: one run's ``git am`` met the
other's ``rebase-apply``, its rollback (``git reset --merge``) removed the commits the
other had just reported done, and the loser blamed the user ("a git am is in progress")
or printed git's own errors. Holding the lock from before the plan is computed until
the verb has printed its result makes overlapping runs happen one after the other: the
second one plans on what the first one left.

Decisions:

- **What is locked: the repository's common git directory**, by ``fcntl.flock`` on a
  file descriptor of the directory itself (Linux allows flock on a directory opened
  read-only). The kernel drops the lock when the process ends, ``kill -9`` included,
  so nothing is created in the user's repository and a dead run never blocks. The
  common directory, not a worktree's own: worktrees of one repository share its
  branches, and a run in one worktree rolling back a branch another worktree also has
  checked out (``git worktree add --force``) would undo the other's commits; runs on
  different worktrees are short, so serializing them costs little.
- **Writers exclusive, readers shared.** `apply`, `revert` and `export --onto` take
  the lock exclusively. `status` and every ``--check`` only read, but a plan read while
  another run's ``git am`` is half done shows that half state (F1 applied, F2 not), or
  the other run's ``rebase-apply`` as the user's git am "in progress": they take it
  shared, so readers run together and none of them reads a state a writer is making.
- **Wait, then refuse.** A run that finds the lock held waits up to ``WAIT_SECONDS``
  (the other run usually ends within seconds; on a terminal the wait is shown, naming
  the other run) and then plans on what it finds; if the other run still holds it, it
  refuses (exit 1) in one line naming that run: pid, verb, since when. It has changed
  nothing.
- **Who holds it** is told by a small description file per holder (pid, command,
  start time) outside the repository, in a per-user directory under ``$XDG_RUNTIME_DIR``
  or the temporary directory. The flock alone decides; a description whose process is
  gone (left by ``kill -9``) is ignored and removed by the next run that reads it, so
  it never blocks and never names a dead run.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_patches import _progress
from vllm_patches._errors import Refused

WAIT_SECONDS = 60.0  # how long a run waits for another one before it refuses
_POLL_SECONDS = 0.05


def _descriptions_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("TMPDIR") or "/tmp"
    return Path(base) / f"vllm-patches-{os.getuid()}-locks"


def _key(fd: int) -> str:
    """The locked directory's identity (device and inode): the same for every path to it."""
    info = os.fstat(fd)
    return f"{info.st_dev}-{info.st_ino}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def holders(fd: int) -> list[str]:
    """The live runs that described themselves as holding this lock, as words
    (``pid 123, `vllm-patches apply`, since 2026-11-23 23:40:01``); stale descriptions
    are removed on the way."""
    directory = _descriptions_dir()
    found = []
    for path in sorted(directory.glob(f"{_key(fd)}-*")):
        pid = int(path.name.rsplit("-", 1)[1])
        if pid == os.getpid():
            continue
        if not _alive(pid):
            path.unlink(missing_ok=True)
            continue
        try:
            verb, since = path.read_text().split("\n")[:2]
        except (OSError, ValueError):
            continue  # being written or removed right now
        found.append(f"pid {pid}, `vllm-patches {verb}`, since {since}")
    return found


def _describe(fd: int, verb: str) -> Path | None:
    """Write this run's description (None when the directory cannot be written: the lock
    still holds, others then cannot say who holds it)."""
    directory = _descriptions_dir()
    path = directory / f"{_key(fd)}-{os.getpid()}"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        path.write_text(f"{verb}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    except OSError:
        return None
    return path


def _refusal(repository: Path, fd: int) -> Refused:
    who = "; ".join(holders(fd)) or "a run that did not say who it is"
    return Refused(f"{repository}: another vllm-patches run is using this repository "
                   f"({who}) and did not finish within {WAIT_SECONDS:g} s; nothing was "
                   "changed, run again when it has finished")


def _take(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _acquire(fd: int, operation: int, repository: Path) -> None:
    """Take the lock, waiting up to ``WAIT_SECONDS`` for the run that holds it."""
    if _take(fd, operation):
        return
    who = "; ".join(holders(fd)) or "another vllm-patches run"
    with _progress.step(f"waiting for {who} to finish with {repository}"):
        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            if _take(fd, operation):
                return
    raise _refusal(repository, fd)


@contextmanager
def hold(git_dir: Path, repository: Path, verb: str, *, shared: bool) -> Iterator[None]:
    """Hold the lock of the repository whose common git directory is ``git_dir`` while
    the block runs (``shared`` for a reader); ``repository`` and ``verb`` are what others
    are told. Waits for another run up to ``WAIT_SECONDS``, then refuses."""
    fd = os.open(git_dir, os.O_RDONLY | os.O_DIRECTORY)
    description = None
    try:
        _acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, repository)
        description = _describe(fd, verb)
        yield
    finally:
        if description is not None:
            description.unlink(missing_ok=True)
        os.close(fd)  # releases the lock
