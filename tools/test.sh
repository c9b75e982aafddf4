#!/usr/bin/env bash
# Set up everything the tests need (idempotent) and run them all:
#   1. patches/ is what the overlays generate today (regen --check);
#   2. the tool's own tests (tests/tool);
#   3. the lanes: every fix test fails on stock vLLM and passes patched, and
#      upstream's suites pass patched, for each pinned release (tools/lanes.py);
#   4. what `export` sends upstream, each fix on its newest lane: upstream's pre-commit
#      passes on it, its tests fail on stock and pass exported (tools/export_check.py).
# Arguments go to tools/lanes.py and tools/export_check.py (e.g. --release v0.21.0).
# Needs python3.11+ and git.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' 2>.venv/pip.log \
    || { cat .venv/pip.log; exit 1; }

echo "== regen --check"
.venv/bin/vllm-patches regen --check
echo "== tool tests"
.venv/bin/python -m pytest -q -p no:cacheprovider tests/tool
echo "== lanes"
.venv/bin/python tools/lanes.py "$@"
echo "== exported series"
.venv/bin/python tools/export_check.py "$@"
