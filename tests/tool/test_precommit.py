"""tools/precommit.py: upstream's pre-commit config made runnable without GitHub.

Running the hooks needs pre-commit's environments (minutes the first time): CI does that
on the exported series (tools/export_check.py). Here, only how a config is rewritten.
"""

import sys

from vllm_patches._catalog import series as _series

sys.path.insert(0, str(_series.REPO_DIR / "tools"))  # tools/ is not a package
import precommit

RUFF = precommit.RUFF
CONFIG = {
    "default_stages": ["pre-commit", "manual"],
    "exclude": "vllm/third_party/.*",
    "repos": [
        {"repo": RUFF, "rev": "v0.14.0", "hooks": [
            {"id": "ruff-check", "args": ["--output-format", "github", "--fix"]},
            {"id": "ruff-format"}]},
        {"repo": "https://github.com/crate-ci/typos", "rev": "v1.43.5",
         "hooks": [{"id": "typos", "args": ["--force-exclude"]}]},
        {"repo": "https://github.com/DavidAnson/markdownlint-cli2", "rev": "v0.21.0",
         "hooks": [{"id": "markdownlint-cli2", "language_version": "lts",
                    "args": ["--fix"], "exclude": "docs/.*"}]},
        {"repo": "https://github.com/example/new-linter", "rev": "v1",
         "hooks": [{"id": "new-linter"}]},
        {"repo": "local", "hooks": [
            {"id": "mypy", "entry": "python tools/pre_commit/mypy.py 3.11",
             "language": "python", "additional_dependencies": ["mypy==1.20.2"]}]},
    ],
}


def hooks_by_id() -> tuple[dict[str, dict], dict, list[str]]:
    config, notes = precommit.offline_config(CONFIG)
    assert all(repo["repo"] == "local" for repo in config["repos"])
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    return hooks, config, notes


def test_ruff_and_typos_come_from_the_index_at_the_configs_rev_with_its_args():
    hooks, config, notes = hooks_by_id()
    check = hooks["ruff-check"]
    assert check["language"] == "python" and check["additional_dependencies"] == ["ruff==0.14.0"]
    assert check["entry"] == "ruff check --force-exclude"
    assert check["args"] == ["--output-format", "github", "--fix"]  # the config's, not --no-fix
    assert hooks["ruff-format"]["types_or"] == ["python", "pyi", "jupyter"]
    assert hooks["typos"]["additional_dependencies"] == ["typos==1.43.5"]
    assert hooks["typos"]["args"] == ["--force-exclude"] and hooks["typos"]["types"] == ["text"]
    assert config["exclude"] == CONFIG["exclude"] and config["default_stages"] == ["pre-commit",
                                                                                  "manual"]
    assert "ruff-check: ruff==0.14.0 from the package index" in notes


def test_hooks_that_cannot_run_fail_for_the_files_they_check_and_only_those():
    hooks, _, notes = hooks_by_id()
    markdown = hooks["markdownlint-cli2"]
    assert markdown["language"] == "fail" and "node" in markdown["entry"]
    assert markdown["types"] == ["markdown"] and markdown["exclude"] == "docs/.*"
    assert "args" not in markdown and "language_version" not in markdown
    unknown = hooks["new-linter"]
    assert unknown["language"] == "fail" and "REMOTE_HOOKS" in unknown["entry"]
    assert not {"files", "types", "types_or"} & unknown.keys(), "an unknown hook checks every file"
    assert any(note.startswith("new-linter: cannot run here") for note in notes)


def test_local_hooks_are_kept_as_they_are():
    hooks, _, _ = hooks_by_id()
    assert hooks["mypy"] == CONFIG["repos"][-1]["hooks"][0]


def test_a_mypy_cache_is_shared_by_runs_of_one_config_but_never_at_once(tmp_path, monkeypatch):
    """Two runs at once get caches of their own; a run after them takes the first again;
    another config, another cache."""
    monkeypatch.setattr(precommit, "HOME", tmp_path / "precommit")
    one, other = tmp_path / "one", tmp_path / "other"
    for tree, text in ((one, "repos: []\n"), (other, "repos: [{repo: local}]\n")):
        tree.mkdir()
        (tree / ".pre-commit-config.yaml").write_text(text)
    with precommit.mypy_cache(one) as first, precommit.mypy_cache(one) as second:
        assert first != second and first.parent == second.parent
    with precommit.mypy_cache(one) as again, precommit.mypy_cache(other) as elsewhere:
        assert again == first and elsewhere.parent != first.parent
