"""One vllm-patches run at a time per repository: ``fcntl.flock`` on the common git
directory, taken before a verb reads the state its plan is made of and held until it
printed its result. Writers hold it exclusively, readers (`status`, ``--check``) shared,
so none reads a half-applied series; the kernel drops it with the process, so a dead run
never blocks. A waiting run refuses after ``WAIT_SECONDS``, naming the holder.
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
