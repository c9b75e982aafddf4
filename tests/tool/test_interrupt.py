"""SIGINT and SIGTERM at any instant of a real `apply` or `revert`.

A user's `timeout -s INT 0.2 vllm-patches apply .` (or Ctrl-C on a terminal, which
signals the whole process group, git's children included) left a traceback and, by
timing, `.git/rebase-apply` with a stale `.git/index.lock` (the next `apply` refused and
`git am --abort` failed on the lock), or 4 of 5 commits with a `git am` in progress, or
one commit and a dirty file. Each trial here signals one run, at a point spread over
the verb's own duration, to the process alone or to its process group, and checks
that the checkout ends exactly as before the run or exactly as after it, with one line
on stderr and exit 130 (SIGINT) or 143 (SIGTERM), or 0 where the run ended first.

No timed assertion: the delays only choose where the signal lands; every outcome is
judged by what it is. A trial counts from the entry point's first statement, which holds
the signals back (seen in ``/proc/PID/status``; on code without it, from the handlers or
the first child).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import git, snapshot
from packaging.version import Version

from vllm_patches._catalog import series as _series

ENV = {**os.environ, "PYTHONPATH": str(_series.REPO_DIR)}
SERIES = _series.load()
# What apply commits on the v0.21.0 checkout: the fixes that release needs.
TITLES = [fix.title for fix in SERIES.applicable(Version("0.21.0"))]
REVERTS = [f'Revert "{title}"' for title in reversed(TITLES)]
# per verb; with CLONE_TRIALS, 52 signals a run. On unguarded code most of them went
# wrong (docs/internals.md).
TRIALS = 22
CLONE_TRIALS = 8
# (signal, to the whole process group as a terminal's Ctrl-C does, or to the run alone)
HOW = [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGINT, False),
       (signal.SIGTERM, True)]
_HANDLED = 1 << (signal.SIGTERM - 1)  # bit of SIGTERM in /proc/PID/status SigCgt


def _ready(pid: int) -> bool:
    """Whether the run's own code started: it holds SIGTERM back or handles it (Python's
    own handler is SIGINT's only), or, on code that does neither, started its first
    child."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return True  # gone: it ended
    masks = [int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigBlk:", "SigCgt:"))]
    return any(mask & _HANDLED for mask in masks) or bool(children.strip())


def start(*argv: str, cwd: Path | None = None, preexec_fn=None) -> tuple[subprocess.Popen,
                                                                           float]:
    """The verb running in a session of its own (so that signalling its group spares
    pytest), and when it became ready."""
    proc = subprocess.Popen([sys.executable, "-m", "vllm_patches", *argv], env=ENV, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # The test's one thread forks it: no lock to inherit held.
                            start_new_session=True, preexec_fn=preexec_fn)  # noqa: PLW1509
    while not _ready(proc.pid):
        time.sleep(0.001)
    return proc, time.monotonic()


def interrupt(argv: tuple[str, ...], trial: int, duration: float,
              cwd: Path | None = None) -> tuple[str, list[str]]:
    """Run ``argv`` and signal it as ``trial`` says, at a point spread over ``duration``
    and a little beyond it (there the run ends first); how it was signalled, and what is
    wrong with its exit code and stderr."""
    signum, group = HOW[trial % len(HOW)]
    delay = duration * 1.1 * ((trial * 0.618034) % 1)
    proc, ready = start(*argv, cwd=cwd)
    time.sleep(max(0.0, ready + delay - time.monotonic()))
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _out, err = proc.communicate(timeout=120)
    problems = []
    if proc.returncode not in (0, 128 + signum):
        problems.append(f"exit {proc.returncode}")
    lines = err.strip().splitlines()
    if "Traceback" in err or len(lines) > 1:
        problems.append(f"{len(lines)} lines on stderr, the last {lines[-1][:120]!r}")
    elif proc.returncode != 0 and not err.startswith("vllm-patches: interrupted ("):
        problems.append(f"not the interruption line: {err[:200]!r}")
    if proc.returncode == 0:
        problems.append("exit 0")  # the caller removes it where the run had ended
    how = f"{signal.Signals(signum).name} to the {'group' if group else 'process'}"
    return f"trial {trial} ({how} at {delay:.3f} s)", problems


class Checkout:
    """The user's checkout with work of their own the verbs must not touch: a stash, an
    untracked file and an unstaged change in a file the series does not change."""

    def __init__(self, path: Path):
        self.path = path
        self.git_dir = path / ".git"
        (path / "README.md").write_text("stashed by the user\n")
        git(path, "stash", "push", "-q", "-m", "the user's stash")
        (path / "notes.txt").write_text("the user's untracked file\n")
        self.base = git(path, "rev-parse", "HEAD").strip()
        self.readme = (path / "README.md").read_text() + "an unstaged change of the user's\n"

    def reset(self, commit: str) -> None:
        """Back to ``commit`` with the user's own work, whatever a trial left behind."""
        for lock in self.git_dir.rglob("*.lock"):  # index.lock, HEAD.lock, a branch's
            lock.unlink()
        subprocess.run(["git", "-C", str(self.path), "am", "--abort"], capture_output=True,
                       check=False)
        shutil.rmtree(self.git_dir / "rebase-apply", ignore_errors=True)
        git(self.path, "reset", "-q", "--hard", commit)
        (self.path / "README.md").write_text(self.readme)

    def state(self) -> dict[str, object]:
        return {
            "refs": git(self.path, "for-each-ref", "--format=%(refname) %(objectname)"),
            "HEAD": git(self.path, "rev-parse", "HEAD").strip(),
            "tree": git(self.path, "rev-parse", "HEAD^{tree}").strip(),
            "subjects": git(self.path, "log", "--format=%s", f"{self.base}..HEAD")
            .splitlines()[::-1],
            "status": git(self.path, "status", "--porcelain"),
            "stash": git(self.path, "stash", "list"),
            "in progress": sorted(
                [name for name in ("rebase-apply", "MERGE_HEAD") if (self.git_dir / name).exists()]
                + [str(lock.relative_to(self.git_dir)) for lock in self.git_dir.rglob("*.lock")]),
        }


def outcome(before: dict, after: dict, found: dict) -> str:
    """"before" or "after" when ``found`` is exactly one of them (the after state's
    commits are new ones each time: compared by subjects and tree), else what differs."""
    if found == before:
        return "before"
    same = ("tree", "subjects", "status", "stash", "in progress")
    if all(found[key] == after[key] for key in same) and \
            found["refs"].replace(found["HEAD"], "NEW") == after["refs"].replace(after["HEAD"],
                                                                                "NEW"):
        return "after"
    return "; ".join(f"{key}: {found[key]!r}"[:150] for key in found
                     if found[key] != before[key] and found[key] != after[key])


def trials(checkout: Checkout, verb: str, start_commit: str) -> tuple[str, list[str]]:
    """Run ``verb`` once to completion from ``start_commit``, then TRIALS times with a
    signal; the commit it reached, and what went wrong."""
    checkout.reset(start_commit)
    before = checkout.state()
    proc, ready = start(verb, str(checkout.path))
    out, err = proc.communicate(timeout=120)
    duration = time.monotonic() - ready
    assert proc.returncode == 0 and "done: " in out, (out, err)
    after = checkout.state()
    failures = []
    for trial in range(TRIALS):
        checkout.reset(start_commit)
        which, problems = interrupt((verb, str(checkout.path)), trial, duration)
        state = outcome(before, after, checkout.state())
        if state == "after" and "exit 0" in problems:
            problems.remove("exit 0")  # it ended before the signal
        elif state not in ("before", "after"):
            problems.append(f"checkout neither before nor after: {state}")
        if problems:
            failures.append(f"{verb} {which}: " + "; ".join(problems))
    checkout.reset(start_commit)
    return after["HEAD"], failures


def test_apply_and_revert_survive_sigint_and_sigterm_at_any_instant(checkout):
    user = Checkout(checkout)
    applied, failures = trials(user, "apply", user.base)
    assert user.state()["subjects"] == []
    _, reverted = trials(user, "revert", applied)
    failures += reverted
    assert not failures, f"{len(failures)} of {2 * TRIALS} trials:\n" + "\n".join(failures)


def test_apply_without_a_checkout_leaves_its_clone_whole_or_none(tmp_path):
    """`apply` with no checkout clones the default release into ./vllm-vX.Y.Z and applies
    the series there: interrupted, the directory is there with the series committed,
    or not there at all (never a clone without the series, which a second `apply`
    would take for the user's)."""
    target = tmp_path / f"vllm-v{SERIES.default_release}"
    proc, ready = start("apply", cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    duration = time.monotonic() - ready
    assert proc.returncode == 0 and "done: " in out, (out, err)
    failures = []
    for trial in range(CLONE_TRIALS):
        shutil.rmtree(target, ignore_errors=True)
        which, problems = interrupt(("apply",), trial, duration, cwd=tmp_path)
        if target.exists():
            log = subprocess.run(["git", "-C", str(target), "log", "--format=%s", "-n",
                                  str(len(TITLES))], capture_output=True, text=True, check=False)
            status = subprocess.run(["git", "-C", str(target), "status", "--porcelain"],
                                    capture_output=True, text=True, check=False)
            if log.stdout.splitlines()[::-1] != TITLES or status.stdout or status.returncode:
                problems.append(f"a clone without the whole series: {log.stdout!r} "
                                f"{(log.stderr + status.stderr)[:100]!r}")
            elif "exit 0" in problems:
                problems.remove("exit 0")  # it ended before the signal
        if problems:
            failures.append(f"{which}: " + "; ".join(problems))
    assert not failures, f"{len(failures)} of {CLONE_TRIALS} trials:\n" + "\n".join(failures)


# `apply --check` runs, each with a SIGINT to its group at an instant of its own.
CHECK_TRIALS = 50


def test_a_signal_at_any_instant_from_start_up_on_is_one_line_naming_the_checkout(checkout):
    """A SIGINT that came while the modules loaded was a traceback, and one before the
    checkout was opened a line that did not name it. `apply --check` with no CHECKOUT,
    in the checkout (which it then works on), signalled from its first statement on,
    ends either on its own or with the line, exit 130; it changes nothing."""
    before = snapshot(checkout)
    proc, ready = start("apply", "--check", cwd=checkout)
    out, err = proc.communicate(timeout=120)
    duration = time.monotonic() - ready
    assert proc.returncode == 0 and "check passed" in out, (out, err)
    line = f"vllm-patches: interrupted (SIGINT); nothing was changed in {checkout}\n"
    failures, stopped = [], 0
    for trial in range(CHECK_TRIALS):
        delay = duration * 1.1 * ((trial * 0.618034) % 1)
        proc, ready = start("apply", "--check", cwd=checkout)
        time.sleep(max(0.0, ready + delay - time.monotonic()))
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        stopped += proc.returncode == 130
        if "Traceback" in err or (proc.returncode, err) not in ((0, ""), (130, line)):
            failures.append(f"at {delay:.3f} s: exit {proc.returncode}, {err[-300:]!r}")
    assert not failures, f"{len(failures)} of {CHECK_TRIALS}:\n" + "\n".join(failures)
    assert stopped, "no trial was interrupted: the signals all came after the end"
    assert snapshot(checkout) == before


def _signal_pending_at_exec() -> None:
    """In the child before exec: a SIGINT that comes before the interpreter runs any of
    the package (held back, as the entry point holds it, so that it stays pending)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_held_back_at_start_up_is_raised_naming_the_checkout(checkout):
    before = snapshot(checkout)
    proc, _ = start("status", str(checkout), preexec_fn=_signal_pending_at_exec)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, out, err) == (
        130, "", f"vllm-patches: interrupted (SIGINT); nothing was changed in {checkout}\n")
    assert snapshot(checkout) == before


def test_a_signal_waits_for_a_change_and_then_says_it_is_complete(tmp_path):
    """In one process: the signal raised in a change is raised at its end, once, with
    the line that says the change is complete; a second signal changes nothing."""
    from vllm_patches import _interrupt

    steps = []
    try:
        with _interrupt.handled(restore=True), _interrupt.guard(tmp_path, "apply"):
            with _interrupt.change():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)  # only the first one counts
                steps.append("went on")
            steps.append("not reached")
    except _interrupt.Interrupted as exc:
        steps.append((exc.exit_code, str(exc)))
    line = f"interrupted (SIGTERM) after `apply` changed {tmp_path}; that change is complete"
    assert steps == ["went on", (143, line)]


def test_outside_a_change_a_signal_stops_at_once_and_changed_nothing(tmp_path):
    from vllm_patches import _interrupt

    before = signal.getsignal(signal.SIGINT)
    try:
        with _interrupt.handled(restore=True), _interrupt.guard(tmp_path, "revert"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises in the sleep
        raise AssertionError("not interrupted")
    except _interrupt.Interrupted as exc:
        assert (exc.exit_code, str(exc)) == (
            130, f"interrupted (SIGINT); nothing was changed in {tmp_path}")
    assert signal.getsignal(signal.SIGINT) is before  # a caller in this process goes on


class _CollectedWhenSignalled:
    """An object whose ``__del__`` is where the signal lands: Python drops what a
    ``__del__`` raises (a ``subprocess.Popen`` or a scratch directory collected at the
    wrong instant did that in CI)."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_that_lands_in_a_finalizer_is_not_lost(monkeypatch, capsys, tmp_path):
    """CI's run of 03caad5: a SIGTERM that landed in a finalizer became an 8-line "Exception
    ignored in" traceback, and `apply` went on to exit 0. Now: one line, exit 143, and
    the line says what became of the checkout."""
    from vllm_patches import _cli, _interrupt

    def verb(_argv):
        with _interrupt.guard(tmp_path, "apply"):
            with _interrupt.change():
                pass
            _CollectedWhenSignalled()
            print("done: applied")
        return 0

    monkeypatch.setattr(_cli, "_main", verb)
    assert _cli.main([]) == 143
    out, err = capsys.readouterr()
    line = (f"vllm-patches: interrupted (SIGTERM) after `apply` changed {tmp_path}; "
            "that change is complete\n")
    assert (out, err) == ("done: applied\n", line)


def test_a_signal_lost_outside_a_checkout_ends_the_verb_interrupted(monkeypatch, capsys):
    from vllm_patches import _cli

    def verb(_argv):
        _CollectedWhenSignalled()
        return 0

    monkeypatch.setattr(_cli, "_main", verb)
    assert _cli.main([]) == 143
    assert capsys.readouterr().err == "vllm-patches: interrupted (SIGTERM)\n"
