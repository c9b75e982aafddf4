"""The command starts fast and ends cleanly: verbs import only
what they use, a plan is computed once with few git calls, a closed pipe is no error.
Times are measured in benchmarks/bench_cli_startup.py; tests never assert on time."""

import ast
import os
import subprocess
import sys

import pytest

from vllm_patches import _git
from vllm_patches._catalog import series as _series
from vllm_patches._cli import main
from vllm_patches._errors import EXIT_OK, EXIT_REFUSED

# Modules only regen/matrix (libcst) or fetch (the network, archives) need. (pathlib
# imports urllib.parse, argparse shutil.) packaging.specifiers is allowed: `status` says
# why a fix is not applicable by its range (F6 on the v0.21.0 checkout), and the import
# costs 2.6-3.4 ms (python -X importtime, 2026-11-25).
HEAVY = ("libcst", "urllib.request", "http", "tarfile", "json", "ssl", "email", "tempfile")
ENV = {**os.environ, "PYTHONPATH": str(_series.REPO_DIR)}


def imported_by(*argv: str) -> list[str]:
    code = ("import sys\nfrom vllm_patches._cli import main\n"
            f"try:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass\n"
            "print('MODULES', sorted(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                         check=True).stdout
    modules = ast.literal_eval(out.split("MODULES ", 1)[1])
    return [name for name in modules if name.startswith(HEAVY)]


@pytest.mark.parametrize("argv", [["--help"], ["list", "-v"], ["status", "{checkout}"],
                                  ["apply", "--check", "{checkout}"]], ids=" ".join)
def test_quick_verbs_import_neither_libcst_nor_the_network(argv, checkout):
    """Every command imported libcst (0.7 s on a loaded machine)."""
    assert imported_by(*(arg.format(checkout=checkout) for arg in argv)) == []


def count_git_calls(monkeypatch) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []
    real = _git.subprocess.run

    def counting(args, *rest, **kwargs):
        if args[:1] == ["git"]:
            calls.append(tuple(args[3:]))
        return real(args, *rest, **kwargs)

    monkeypatch.setattr(_git.subprocess, "run", counting)
    return calls


def test_status_and_apply_of_a_release_run_few_git_commands(checkout, monkeypatch, capsys):
    """The plan is computed once, from the committed blob ids: status is three
    git commands (and HEAD read again once the repository's lock is held),
    apply adds git am (and the identity lookup) and nothing else."""
    calls = count_git_calls(monkeypatch)
    assert main(["status", str(checkout)]) == EXIT_OK
    assert [c[0] for c in calls] == ["rev-parse", "rev-parse", "ls-tree", "status"]
    calls.clear()
    assert main(["apply", str(checkout)]) == EXIT_OK
    assert [c[0] for c in calls] == ["rev-parse", "rev-parse", "ls-tree", "status", "config",
                                     "am"]
    assert "done: F1, F2, F3, F4, F5" in capsys.readouterr().out


def closed_pipe_run(*argv: str, read_lines: int) -> tuple[int, str]:
    """Run the command with a reader that reads ``read_lines`` lines of stdout and leaves."""
    proc = subprocess.Popen([sys.executable, "-m", "vllm_patches", *argv], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for _ in range(read_lines):
        proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(), err


@pytest.mark.parametrize("read_lines", [0, 1])
def test_a_reader_that_leaves_changes_no_exit_code(read_lines):
    """`vllm-patches list -v | head` ended in a BrokenPipeError
    traceback. README promised 141, but `list -v` fits the pipe's
    buffer and exited 0 unless the reader left before the first write: the code told
    when the reader left. It is now the verb's own, whenever the reader leaves."""
    assert closed_pipe_run("list", "-v", read_lines=read_lines) == (EXIT_OK, "")


def test_a_cut_short_refusal_keeps_its_exit_code(checkout):
    coordinator = checkout / "vllm/v1/core/kv_cache_coordinator.py"
    line = "            num_local_computed_tokens: The number of local computed tokens."
    coordinator.write_text(coordinator.read_text().replace(line, line + " "))
    subprocess.run(["git", "-C", str(checkout), "commit", "-qam", "a context line"],
                   check=True)
    assert closed_pipe_run("status", str(checkout), read_lines=0) == (EXIT_REFUSED, "")


def test_bad_arguments_are_one_line(capsys):
    """A bad --release printed argparse's usage block."""
    for argv in (["status", "--release", "v0.x", "."], ["apply", "--bogus"], ["nosuchverb"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
        assert err.startswith("vllm-patches") and "error: " in err
