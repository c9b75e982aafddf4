"""SIGINT and SIGTERM: a run stops where stopping cannot leave the user's checkout half
changed, says so in one line, and exits 130 or 143 (128 + the signal, as a shell reports
a command the signal killed).

A user's `timeout -s INT 0.2 vllm-patches apply .`, or Ctrl-C on a terminal (which
signals the whole foreground process group, git's children included), used to print a
traceback and leave, by timing, a `git am` in progress with a stale `.git/index.lock`,
4 of 5 commits, or a commit and a dirty file. Decisions:

- **git's children cannot be signalled by the terminal**: ``_git.run`` starts each in a
  session of its own (``start_new_session``), so a Ctrl-C or a `timeout` that signals
  the group reaches this process alone, and no git command dies holding a lock or
  halfway through writing the index, the work tree or a ref.
- **A signal waits for the git command that runs** (``child``): the handler records it
  and ``Interrupted`` is raised when the command has ended. Elsewhere it is raised at
  once, where the signal lands, as ``KeyboardInterrupt`` would be: reading, planning,
  waiting for the repository's lock and downloading stop without delay, and their
  ``finally`` blocks (scratch directories, the lock) run as on any other error.
- **A change to the checkout is one step a signal waits for** (``change``): git am of
  the series, its revert commits, the ``git apply`` of `--no-commit`, with the rollback
  they do on a git failure. The step ends all or nothing (done, or rolled back to the
  start), then the signal is raised: the checkout is exactly as before the run or
  exactly as after it. The steps are short (a few git commands on the files the series
  touches), so the wait is too; a second signal meanwhile changes nothing.
  Rejected: building the commits in a scratch repository and moving the branch at the
  end. It would also survive ``kill -9`` of this process during git am (then git am
  goes on to its end in its own session anyway), but git am would run without the
  repository's own configuration (identity, hooks) and the verb would pay several
  git commands more, for no difference under SIGINT and SIGTERM.
- **One line, true of the checkout**: a verb on a checkout (``_checkout.checkout.opened``,
  ``guard``) says whether it was changed: "nothing was changed", or, when the signal
  came after the step, that the change is complete. Verbs on no checkout (regen, fetch,
  matrix) say only that they were interrupted.
- **Only the first signal counts**: once ``Interrupted`` is raised, further signals are
  ignored, so the cleanup on its way out is not cut short; so is a signal after the
  verb has ended (``stop``): its exit code and output stand.
- **No signal is lost where Python ignores exceptions**: a handler that runs in a
  ``__del__`` or a finalizer (a ``subprocess.Popen`` or a scratch directory collected
  at the wrong instant) raises ``Interrupted`` into code whose exceptions Python prints
  as "Exception ignored in" and drops. CI's run of 03caad5 saw it: a SIGTERM became an
  8-line traceback and `apply` went on to exit 0. ``handled`` puts a
  ``sys.unraisablehook`` in place that keeps such an ``Interrupted`` quiet, and it is
  raised again when the verb's work on the checkout has ended (``guard``), or the verb
  has (``_cli.main``), with the line true then (``raise_lost``).

- **Start-up holds a signal back**: the entry point's first statement (``__main__``)
  blocks both signals; one that comes while the modules load or the arguments are read
  waits in the kernel and is raised once the verb knows its checkout (``about``), with
  the line that names it (a ``KeyboardInterrupt`` in an import was a traceback).

The window this cannot cover: the interpreter's own start-up, before the entry point's
first statement (Python's SIGINT handler raises ``KeyboardInterrupt`` there; SIGTERM
kills). Nothing of the checkout has been read then.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A SIGINT or SIGTERM ended the run; ``exit_code`` is 128 + the signal. A
    ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` (nor
    ``except UserError``, which turns refusals into their line) stops it on its way to
    ``_cli.main``."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


class _Run:
    """What this run's handlers know: the first signal, whether one may be raised, how many
    steps that a signal waits for are running, and the checkout a writing verb guards."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.silent = False  # raised, or the verb has ended: nothing more is raised
        self.waiting = 0
        self.checkout: tuple[Path, str] | None = None  # (path, verb)
        self.changed = False
        self.lost = False  # raised where Python drops exceptions (sys.unraisablehook)

    def message(self) -> str:
        assert self.signum is not None
        text = f"interrupted ({signal.Signals(self.signum).name})"
        if self.checkout is None:
            return text
        path, verb = self.checkout
        if self.changed:
            return f"{text} after `{verb}` changed {path}; that change is complete"
        return f"{text}; nothing was changed in {path}"

    def raise_pending(self) -> None:
        """Raise the recorded signal, unless a step it waits for runs or it was raised."""
        if self.signum is not None and not self.waiting and not self.silent:
            self.silent = True
            raise Interrupted(self.signum, self.message())


_run = _Run()


def _record(signum: int, _frame) -> None:
    if _run.signum is None:
        _run.signum = signum
    _run.raise_pending()


def _keeping_lost_interruptions(hook):
    """``hook`` (a ``sys.unraisablehook``) save for an ``Interrupted``, which is kept for
    ``raise_lost`` instead of printed."""

    def unraisable(what) -> None:
        if isinstance(what.exc_value, Interrupted):
            _run.lost = True
        else:
            hook(what)

    return unraisable


@contextmanager
def handled(restore: bool) -> Iterator[None]:
    """SIGINT and SIGTERM handled as the module docstring says from here (the start of a
    verb); after the block, the handlers before are put back where ``restore`` (a caller
    in this process goes on), else the signals are blocked until the process exits (the
    interpreter's finalization puts the default handlers back, and a signal then would
    kill the process after the verb ended). Outside the main thread, where Python allows
    no handler, nothing changes."""
    global _run
    _run = _Run()
    hook, sys.unraisablehook = sys.unraisablehook, _keeping_lost_interruptions(
        sys.unraisablehook)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # as it is: blocked by the entry?
    before = {}
    try:
        try:
            for signum in SIGNALS:  # a signal may land between two: put back what was set
                before[signum] = signal.signal(signum, _record)
        except ValueError:  # not the main thread
            pass
        yield
    finally:
        _run.silent = True
        sys.unraisablehook = hook
        if restore:
            for signum, handler in before.items():
                signal.signal(signum, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        elif before:
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def about(path: Path | None, verb: str) -> None:
    """The verb is known, and the checkout it works on (None: none): from here a signal
    is raised where it lands, with a line that names the checkout; one held back since
    the entry point's first statement is raised now."""
    _run.checkout, _run.changed = (path, verb) if path is not None else None, False
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def changed() -> bool:
    """Whether a step of this run changed the checkout (``change``)."""
    return _run.changed


def stop() -> None:
    """The verb has ended: a signal from now on is ignored (its exit code stands)."""
    _run.silent = True


def raise_lost() -> None:
    """Raise, again, an ``Interrupted`` that Python dropped (raised in a ``__del__`` or a
    finalizer) on its way to ``_cli.main``, with the line true now that the verb ended."""
    if _run.lost:
        assert _run.signum is not None
        _run.lost = False
        raise Interrupted(_run.signum, _run.message())


@contextmanager
def child() -> Iterator[None]:
    """A child process runs in the block: a signal waits for the block's end."""
    _run.waiting += 1
    try:
        yield
    finally:
        _run.waiting -= 1
        _run.raise_pending()


@contextmanager
def change() -> Iterator[None]:
    """The block changes the guarded checkout, all or nothing (it rolls back what it did
    on a failure): a signal waits for its end. Ended without an exception, the change
    counts as made, before any signal can be raised."""
    _run.waiting += 1
    try:
        yield
        _run.changed = True
    finally:
        _run.waiting -= 1
        _run.raise_pending()


@contextmanager
def guard(path: Path, verb: str) -> Iterator[None]:
    """The block is a writing verb on the checkout at ``path``: an interruption says
    whether the checkout was changed."""
    before = _run.checkout
    _run.checkout, _run.changed = (path, verb), False
    try:
        yield
    finally:
        try:
            raise_lost()  # here, where its line can say what became of the checkout
        finally:
            _run.checkout = before
