"""One conflicting fix blocks only the fixes that require it, and
`status`, `apply` and `revert` take a subset of the fixes (``--fix``), all or nothing
for that subset. On real release checkouts (v0.21.0: every fix but F3 and F23 stands
alone; v0.18.1: F2, F3 and F5 change one file)."""

from pathlib import Path

import pytest
from conftest import clone, git, run, snapshot

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._checkout import plan as _plan
from vllm_patches._errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED

SERIES = _series.load()
COORDINATOR = "vllm/v1/core/kv_cache_coordinator.py"


def states(out: str) -> dict[str, str]:
    """Fix id -> its state as a status line prints it (after the slug)."""
    return {line.split()[0]: " ".join(line.split()[2:]) for line in out.splitlines()
            if line.startswith("  F")}


def subjects(checkout: Path, base: str) -> list[str]:
    return git(checkout, "log", "--reverse", "--format=%s", f"{base}..HEAD").splitlines()


def title(fix_id: str) -> str:
    return SERIES.fix(fix_id).title


@pytest.fixture
def exact_only(monkeypatch):
    """Fails a plan that has to try a patch: the patch ids must say it all."""
    def tried(*args, **kwargs):
        raise AssertionError("the plan tried patches with git")
    monkeypatch.setattr(_plan, "_Trial", tried)


def test_a_conflict_blocks_only_the_fixes_that_require_it(checkout, capsys):
    """On main, F1 conflicting made status and apply report F2 .. F5 "conflict (needs
    F1 first)", though none of them requires F1."""
    path = checkout / COORDINATOR
    path.write_text(path.read_text().replace(
        "for i, manager in enumerate(self.single_type_managers):",
        "for i, manager in enumerate(list(self.single_type_managers)):"))
    git(checkout, "commit", "-qam", "local change")
    base = git(checkout, "rev-parse", "HEAD").strip()
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_REFUSED
    found = states(out)
    assert found["F1"].startswith("conflict (") and COORDINATOR in found["F1"]
    assert all(found[f].startswith("applicable (") for f in ("F2", "F3", "F4", "F5")), out

    before = snapshot(checkout)
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and len(err.strip().splitlines()) == 1, err
    again = f"vllm-patches apply --fix F2,F3,F4,F5,F7,F20,F22,F23,F25 {checkout}"
    assert err.startswith("vllm-patches: refused: F1 conflicts: ") and f"`{again}`" in err
    assert snapshot(checkout) == before
    code, _, err = run(capsys, "apply", "--no-commit", "--check", str(checkout))
    assert code == EXIT_REFUSED
    assert "apply --no-commit --check --fix F2,F3,F4,F5,F7,F20,F22,F23,F25" in err

    code, out, _ = run(capsys, *again.split()[1:])
    assert code == EXIT_OK and "done: F2, F3, F4, F5, F7, F20, F22, F23, F25" in out
    applied = ("F2", "F3", "F4", "F5", "F7", "F20", "F22", "F23", "F25")
    assert subjects(checkout, base) == [title(f) for f in applied]
    code, out, _ = run(capsys, "status", str(checkout))
    found = states(out)
    assert code == EXIT_REFUSED and found["F1"].startswith("conflict (")
    assert [found[f] for f in applied] == ["applied"] * 9
    code, out, _ = run(capsys, "revert", str(checkout))
    assert code == EXIT_OK and "done: F2, F3, F4, F5, F7, F20, F22, F23, F25" in out
    assert git(checkout, "diff", base, "HEAD") == ""


def test_a_fix_whose_requirement_conflicts_is_blocked(checkout, capsys):
    """F3 requires F2: with F2 conflicting, F3 is blocked and named in the refusal,
    and the command offered applies the others only."""
    worker = checkout / SERIES_F2_FILE
    text = worker.read_text()
    line = next(line for line in _f2_removed_lines() if line in text)
    worker.write_text(text.replace(line, line + "  # edited", 1))
    git(checkout, "commit", "-qam", "edit a line F2 changes")
    code, out, _ = run(capsys, "status", str(checkout))
    found = states(out)
    assert code == EXIT_REFUSED and found["F2"].startswith("conflict (")
    assert found["F3"] == "blocked (requires F2, which conflicts)"
    assert all(found[f].startswith("applicable (") for f in ("F1", "F4", "F5")), out
    code, _, err = run(capsys, "apply", str(checkout))
    assert code == EXIT_REFUSED and "F2 conflicts: " in err
    assert "F3 is blocked: requires F2, which conflicts" in err
    others = f"`vllm-patches apply --fix F1,F4,F5,F7,F20,F22,F25 {checkout}`"
    assert f"{others} applies F1, F4, F5, F7, F20, F22, F25" in err


SERIES_F2_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py"


def _f2_removed_lines() -> list[str]:
    """The lines F2's v0.21.0 patch replaces (each changes one upstream line)."""
    patch = next((_series.PATCHES_DIR / "v0.21.0").glob("0002-F2-*.patch")).read_text()
    return [line[1:] for line in patch.splitlines()
            if line.startswith("-") and not line.startswith("---") and line[1:].strip()]


def test_a_subset_is_applied_reverted_and_recognized_from_the_patch_ids(checkout, capsys,
                                                                         exact_only):
    base = git(checkout, "rev-parse", "HEAD").strip()
    code, out, _ = run(capsys, "apply", "--fix", "F2", "--fix", "F4", str(checkout))
    assert code == EXIT_OK and "done: F2, F4" in out
    assert subjects(checkout, base) == [title("F2"), title("F4")]
    code, out, _ = run(capsys, "status", str(checkout))
    assert code == EXIT_OK
    assert states(out) == {"F1": "applicable (0001-F1-two-phase-computed-block-allocation.patch)",
                           "F2": "applied",
                           "F3": "applicable (0003-F3-nixl-early-notification-staging.patch)",
                           "F4": "applied",
                           "F5": "applicable (0005-F5-nixl-one-read-per-prompt.patch)",
                           "F6": "not applicable (needed on vLLM >=0.22.0, not on v0.21.0)",
                           "F7": "applicable (0006-F7-nixl-recompute-after-lapsed-lease.patch)",
                           "F8": "not applicable (needed on vLLM >=0.22.0, not on v0.21.0)",
                           "F17": "not applicable (needed on vLLM >=0.22.0,<0.31.0, not on "
                                  "v0.21.0)",
                           "F15": "not applicable (needed on vLLM >=0.24.0,<0.26.0, not on "
                                  "v0.21.0)",
                           "F16": "not applicable (needed on vLLM >=0.24.0,<0.30.0, not on "
                                  "v0.21.0)",
                           "F9": "not applicable (needed on vLLM >=0.24.0, not on v0.21.0)",
                           "F10": "not applicable (needed on vLLM >=0.24.0, not on v0.21.0)",
                           "F11": "not applicable (needed on vLLM >=0.24.0, not on v0.21.0)",
                           "F12": "not applicable (needed on vLLM >=0.28.0, not on v0.21.0)",
                           "F13": "not applicable (needed on vLLM >=0.24.0, not on v0.21.0)",
                           "F14": "not applicable (needed on vLLM >=0.24.0, not on v0.21.0)",
                           "F19": "not applicable (needed on vLLM >=0.24.0,<0.28.0, not on "
                                  "v0.21.0)",
                           "F18": "not applicable (needed on vLLM >=0.30.0,<0.31.0, not on "
                                  "v0.21.0)",
                           "F20": "applicable (0007-F20-idle-engine-steps-for-held-kv.patch)",
                           "F21": "not applicable (needed on vLLM >=0.24.0,<0.26.0, not on "
                                  "v0.21.0)",
                           "F22": "applicable (0008-F22-cpu-offload-store-after-compute.patch)",
                           "F23": "applicable (0009-F23-nixl-failed-read-after-its-siblings"
                                  ".patch)",
                           "F24": "not applicable (needed on vLLM >=0.30.0,<0.31.0, not on "
                                  "v0.21.0)",
                           "F25": "applicable (0010-F25-async-load-reserve-in-flight.patch)",
                           "F26": "upstream (since v0.21.0)"}
    code, out, _ = run(capsys, "status", "--fix", "F3,F4", str(checkout))
    assert code == EXIT_OK and list(states(out)) == ["F3", "F4"]
    code, out, _ = run(capsys, "apply", "--fix", "F5,F3", "--check", str(checkout))
    assert code == EXIT_OK and "check passed: F3, F5 applies cleanly" in out
    assert run(capsys, "apply", "--fix", "F3,F5", str(checkout))[0] == EXIT_OK

    # F3 requires F2: F2 alone is not reverted under it.
    before = snapshot(checkout)
    code, _, err = run(capsys, "revert", "--fix", "F2", str(checkout))
    assert code == EXIT_REFUSED and len(err.strip().splitlines()) == 1
    assert "F3 requires F2 and stays applied: revert it too (add --fix F3)" in err
    assert snapshot(checkout) == before
    # F5 changes the scheduler after F4 (before v0.22): the newest of a file's patches
    # reverts by the ids alone.
    code, out, _ = run(capsys, "revert", "--fix", "F5", str(checkout))
    assert code == EXIT_OK and "done: F5" in out
    found = states(run(capsys, "status", str(checkout))[1])
    assert [found[f] for f in ("F2", "F3", "F4", "F5")] == [
        "applied", "applied", "applied",
        "applicable (0005-F5-nixl-one-read-per-prompt.patch)"]
    code, out, _ = run(capsys, "revert", "--fix", "F2,F3", "--fix", "F4", str(checkout))
    assert code == EXIT_OK and "done: F2, F3, F4" in out
    assert git(checkout, "diff", base, "HEAD") == ""


def test_a_fix_without_what_it_requires_is_refused(checkout, capsys):
    before = snapshot(checkout)
    code, out, _ = run(capsys, "status", "--fix", "F3", str(checkout))
    assert code == EXIT_REFUSED
    assert states(out) == {"F3": "blocked (requires F2, which is neither applied nor chosen)"}
    code, _, err = run(capsys, "apply", "--fix", "F3", str(checkout))
    assert code == EXIT_REFUSED and len(err.strip().splitlines()) == 1
    assert "F3 requires F2, which is neither applied nor chosen: add --fix F2" in err
    # F20's patch meets F4's from v0.20.0 on (F20.toml, requires_from).
    code, _, err = run(capsys, "apply", "--fix", "F20", str(checkout))
    assert code == EXIT_REFUSED
    assert "F20 requires F4, which is neither applied nor chosen: add --fix F4" in err
    assert snapshot(checkout) == before


def test_a_requirement_binds_only_from_its_release(tmp_path, capsys):
    """v0.18.1 has no F4: F20, which requires it from v0.20.0, applies alone."""
    checkout = clone(_releases.fetch(_series.Version("0.18.1")), tmp_path / "vllm")
    code, out, _ = run(capsys, "apply", "--fix", "F20", str(checkout))
    assert code == EXIT_OK and "done: F20" in out
    found = states(run(capsys, "status", str(checkout))[1])
    assert found["F20"] == "applied" and found["F4"].startswith("not applicable")


@pytest.mark.parametrize("given", ["F99", "F2,f4", "F2,,F99"])
def test_unknown_fix_ids_are_bad_input(checkout, capsys, given):
    before = snapshot(checkout)
    for verb in ("status", "apply", "revert"):
        code, _, err = run(capsys, verb, "--fix", given, str(checkout))
        assert code == EXIT_BAD_INPUT and len(err.strip().splitlines()) == 1, err
        assert f"(the series has {', '.join(SERIES.ids)})" in err and "unknown fix " in err
    assert snapshot(checkout) == before


def test_a_subset_in_the_work_tree(checkout, capsys):
    code, out, _ = run(capsys, "apply", "--no-commit", "--fix", "F4", str(checkout))
    assert code == EXIT_OK and "done: F4" in out
    found = states(run(capsys, "status", str(checkout))[1])
    assert found["F4"] == "applied, not committed" and found["F1"].startswith("applicable")
    code, out, _ = run(capsys, "apply", "--no-commit", "--fix", "F1", str(checkout))
    assert code == EXIT_OK and "done: F1" in out
    code, out, _ = run(capsys, "revert", "--no-commit", "--fix", "F4", str(checkout))
    assert code == EXIT_OK and "done: F4" in out
    found = states(run(capsys, "status", str(checkout))[1])
    assert found["F1"] == "applied, not committed" and found["F4"].startswith("applicable")
    assert run(capsys, "revert", "--no-commit", str(checkout))[0] == EXIT_OK
    assert git(checkout, "status", "--porcelain") == ""


def test_fixes_sharing_a_file_apply_in_any_order(tmp_path, capsys):
    """v0.18.1: F2, F3 and F5 change nixl_connector.py, and F5's patch was generated on
    top of F2's and F3's: F5 alone is not a state the patch ids name, so git tries it;
    F2 and F3 then go on top of it, and revert takes F5 out under them."""
    release = _series.Version("0.18.1")
    checkout = clone(_releases.fetch(release), tmp_path / "vllm")
    base = git(checkout, "rev-parse", "HEAD").strip()
    code, out, _ = run(capsys, "apply", "--fix", "F5", str(checkout))
    assert code == EXIT_OK and "done: F5" in out
    found = states(run(capsys, "status", str(checkout))[1])
    assert found["F5"] == "applied" and found["F2"].startswith("applicable")
    code, out, _ = run(capsys, "apply", str(checkout))
    assert code == EXIT_OK and "done: F1, F2, F3" in out
    code, out, _ = run(capsys, "status", str(checkout))
    found = states(out)
    assert code == EXIT_OK and [found[f] for f in ("F1", "F2", "F3", "F5")] == ["applied"] * 4
    assert found["F4"].startswith("not applicable (needed on vLLM >=0.19.0")
    code, out, _ = run(capsys, "revert", "--fix", "F5", str(checkout))
    assert code == EXIT_OK and "done: F5" in out
    code, out, _ = run(capsys, "revert", str(checkout))
    assert code == EXIT_OK and "done: F1, F2, F3" in out
    assert git(checkout, "diff", base, "HEAD") == ""
