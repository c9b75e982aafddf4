"""Two runs on one checkout at once: every verb that writes takes the
repository's lock before it computes its plan, so runs that overlap happen one after
the other. Before the lock, one `apply` printed `done: F1, F2, F3, F4` while the other
one's rollback removed its commits, or the loser blamed the user (a `git am` "in
progress", "uncommitted changes") or printed git's own errors."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import git, snapshot
from packaging.version import Version

from vllm_patches._catalog import series as _series
from vllm_patches._checkout import lock as _lock
from vllm_patches._cli import main
from vllm_patches._errors import EXIT_OK, EXIT_REFUSED

ENV = {**os.environ, "PYTHONPATH": str(_series.REPO_DIR)}
ROUNDS = 20  # two applies: on unlocked code 19 or 20 of 20 rounds went wrong
MIXED_ROUNDS = 12  # apply and revert: 6 of 20 went wrong
SERIES = _series.load()
# What apply commits on the v0.21.0 checkout: the fixes that release needs.
TITLES = [fix.title for fix in SERIES.applicable(Version("0.21.0"))]
DONE = "done: " + ", ".join(fix.id for fix in SERIES.applicable(Version("0.21.0")))


def start(verb: str, checkout: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vllm_patches", verb, str(checkout)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def race(*runs: tuple[str, Path]) -> list[tuple[str, int, str, str]]:
    """Start every run at once; (verb, exit code, stdout, stderr) of each."""
    procs = [(verb, start(verb, checkout)) for verb, checkout in runs]
    results = []
    for verb, proc in procs:
        out, err = proc.communicate(timeout=120)
        results.append((verb, proc.returncode, out, err))
    return results


def reset(checkout: Path, base: str) -> None:
    """Back to the pristine clone, whatever a round (on unlocked code) left behind."""
    git_dir = checkout / ".git"
    subprocess.run(["git", "-C", str(checkout), "am", "--abort"], capture_output=True,
                   check=False)
    shutil.rmtree(git_dir / "rebase-apply", ignore_errors=True)
    git(checkout, "reset", "-q", "--hard", base)
    git(checkout, "update-ref", "-d", "ORIG_HEAD")


def new_subjects(checkout: Path, base: str) -> list[str]:
    return git(checkout, "log", "--reverse", "--format=%s", f"{base}..HEAD").splitlines()


def check_loser(verb: str, code: int, out: str, err: str) -> None:
    """The run that did not change the checkout found nothing to do, or refused in one
    line naming the run that holds the repository (pid, verb, since when)."""
    if code == 0:
        assert f"nothing to {verb}" in out, (out, err)
        return
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, (code, out, err)
    assert "pid " in lines[0] and "since " in lines[0], lines


def check_one_line(code: int, err: str) -> None:
    assert code in (0, 1), err
    assert len(err.strip().splitlines()) <= 1, err
    assert "fatal:" not in err and "in progress" not in err and "uncommitted" not in err, err


def test_two_applies_at_once(checkout):
    base = git(checkout, "rev-parse", "HEAD").strip()
    git(checkout, "update-ref", "-d", "ORIG_HEAD")
    before = snapshot(checkout)
    failures = []
    for round_ in range(ROUNDS):
        reset(checkout, base)
        results = race(("apply", checkout), ("apply", checkout))
        subjects = new_subjects(checkout, base)
        try:
            for _verb, code, out, _err in results:
                if code == 0 and DONE in out:  # never "done" without every fix committed
                    assert subjects == TITLES, f"done reported, commits {subjects}"
            assert subjects in ([], TITLES), f"partial series {subjects}"
            for _verb, code, _out, err in results:
                check_one_line(code, err)
            if not subjects:
                assert snapshot(checkout) == before
            done = [r for r in results if r[1] == 0 and DONE in r[2]]
            assert len(done) <= 1, results
            for result in results:
                if result not in done:
                    check_loser(*result)
            assert git(checkout, "status", "--porcelain", "--untracked-files=no") == ""
        except AssertionError as exc:
            failures.append(f"round {round_}: {str(exc)[:300]}")
    assert not failures, f"{len(failures)} of {ROUNDS} rounds:\n" + "\n".join(failures)


def test_apply_and_revert_at_once(checkout):
    """Either order is fine; each report must be true of the checkout it leaves, and the
    series is never left half-applied."""
    base = git(checkout, "rev-parse", "HEAD").strip()
    reverts = [f'Revert "{title}"' for title in reversed(TITLES)]
    failures = []
    for round_ in range(MIXED_ROUNDS):
        reset(checkout, base)
        (_, a_code, a_out, a_err), (_, r_code, r_out, r_err) = race(("apply", checkout),
                                                                    ("revert", checkout))
        subjects = new_subjects(checkout, base)
        try:
            check_one_line(a_code, a_err)
            check_one_line(r_code, r_err)
            applied = a_code == 0 and DONE in a_out
            reverted = r_code == 0 and DONE in r_out
            if reverted:  # the revert ran after the apply and undid all of it
                assert applied and subjects == TITLES + reverts, (a_out, r_out, subjects)
            elif applied:
                assert subjects == TITLES, (a_out, r_out, subjects)
                check_loser("revert", r_code, r_out, r_err)
            else:
                assert subjects == [], subjects
                check_loser("apply", a_code, a_out, a_err)
            assert git(checkout, "status", "--porcelain", "--untracked-files=no") == ""
        except AssertionError as exc:
            failures.append(f"round {round_}: {str(exc)[:300]}")
    assert not failures, f"{len(failures)} of {MIXED_ROUNDS} rounds:\n" + "\n".join(failures)



# A run that holds the repository's lock until its stdin closes.
HOLDER = ("import sys\nfrom pathlib import Path\n"
          "from vllm_patches._checkout import checkout as _checkout\n"
          "with _checkout.opened(Path(sys.argv[1]), sys.argv[2], writes=sys.argv[3] == 'w'):\n"
          "    print('held', flush=True)\n    sys.stdin.read()\n")


def hold(checkout: Path, verb: str, writes: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(checkout), verb,
                             "w" if writes else "r"], env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


@pytest.fixture
def short_wait(monkeypatch):
    monkeypatch.setattr(_lock, "WAIT_SECONDS", 0.3)


def test_a_held_repository_is_refused_in_one_line_naming_the_holder(checkout, capsys,
                                                                     short_wait):
    holder = hold(checkout, "apply", writes=True)
    try:
        before = snapshot(checkout)
        for argv in (["apply", str(checkout)], ["revert", str(checkout)],
                     ["status", str(checkout)], ["apply", "--check", str(checkout)]):
            assert main(argv) == EXIT_REFUSED
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1, err
            assert f"pid {holder.pid}, `vllm-patches apply`, since 20" in err, err
            assert "nothing was changed" in err
        assert snapshot(checkout) == before
    finally:
        release(holder)
    assert main(["apply", str(checkout)]) == EXIT_OK


def test_readers_share_the_lock(checkout, capsys, short_wait):
    """`status` and `--check` only read: they run beside each other, not beside a writer."""
    reader = hold(checkout, "status", writes=False)
    try:
        assert main(["status", str(checkout)]) == EXIT_OK
        assert main(["apply", "--check", str(checkout)]) == EXIT_OK
        assert main(["apply", str(checkout)]) == EXIT_REFUSED
        assert f"pid {reader.pid}, `vllm-patches status`" in capsys.readouterr().err
    finally:
        release(reader)


def test_worktrees_of_one_repository_share_its_lock(checkout, tmp_path, capsys, short_wait):
    other = tmp_path / "other"
    git(checkout, "worktree", "add", "-q", "--detach", str(other))
    holder = hold(checkout, "revert", writes=True)
    try:
        assert main(["apply", str(other)]) == EXIT_REFUSED
        assert f"pid {holder.pid}, `vllm-patches revert`" in capsys.readouterr().err
    finally:
        release(holder)


def test_a_killed_run_leaves_nothing_behind_and_blocks_nothing(checkout, capsys):
    git_dir = checkout / ".git"
    files_before = sorted(p.relative_to(git_dir) for p in git_dir.rglob("*"))
    holder = hold(checkout, "apply", writes=True)
    described = list(_lock._descriptions_dir().glob(f"*-{holder.pid}"))
    assert len(described) == 1  # who holds it, outside the repository
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert sorted(p.relative_to(git_dir) for p in git_dir.rglob("*")) == files_before
    assert main(["apply", str(checkout)]) == EXIT_OK  # at once: the kernel dropped the lock
    assert "done: " in capsys.readouterr().out
    fd = os.open(git_dir, os.O_RDONLY)
    try:
        assert _lock.holders(fd) == []  # the dead run's description is ignored and removed
    finally:
        os.close(fd)
    assert not described[0].exists()
