#!/usr/bin/env bash
# Set up everything the tests need (idempotent) and run them all:
#   1. patches/ is what the overlays generate today (regen --check);
#   2. the tool's own tests (tests/tool);
#   3. the lanes: every fix test fails on stock vLLM and passes patched, and
#      upstream's suites pass patched, for each pinned release (tools/lanes.py);
#   4. beside them, what `export` sends upstream, each fix on its newest lane: upstream's
#      pre-commit passes on it, its tests fail on stock and pass exported
#      (tools/export_check.py);
#   5. the real-engine lane: the fixes in running vLLM engines, stock against fixed
#      (tools/engine_lane.py; VLLM_PATCHES_ENGINE_LANE=0 skips it).
# Arguments go to tools/lanes.py and tools/export_check.py (e.g. --release v0.21.0).
# Needs python3.11+, git, and root for the real-engine lane (its engines run in a
# private network namespace).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# uv installs (tools/venvs.py: itself first, by pip, then the rest from pip's indexes).
.venv/bin/python tools/venvs.py -e '.[dev]' >.venv/pip.log 2>&1 \
    || { cat .venv/pip.log; exit 1; }

echo "== the covered releases' sources, four downloads at a time"
# Downloads wait on the network, not on the cores; regen --check then renders from the
# cache. patches/ has a directory per covered release (regen --check fails otherwise).
ls -d patches/v*/ | xargs -n1 basename | xargs -n1 -P4 .venv/bin/vllm-patches fetch >/dev/null
# The lanes' and the engines' venvs (downloads of several GB) build while the cores run
# regen and the tool tests; the lanes and the engines take each venv's lock and wait
# for a build in progress (lanes.cached_venv).
mkdir -p build
{ .venv/bin/python tools/lanes.py --venvs-only "$@" \
    && if [ "${VLLM_PATCHES_ENGINE_LANE:-1}" != 0 ]; then
           .venv/bin/python tools/engine_lane.py --venvs-only; fi; } \
    >build/venvs.log 2>&1 &
venvs=$!
# A background job of a script ignores Ctrl-C: stop it with the script.
trap 'kill $venvs 2>/dev/null || true' EXIT
echo "== regen --check"
.venv/bin/vllm-patches regen --check
echo "== tool tests"
# Their checkouts (a vLLM tree each, cloned per test) on tmpfs where there is one:
# a clone there costs a third of one on disk (docs/ci.md, "What keeps it in budget").
tool_tmp=$(mktemp -d -p /dev/shm vllm-patches-tool-tests.XXXXXX 2>/dev/null || mktemp -d)
TMPDIR=$tool_tmp .venv/bin/python -m pytest -q -p no:cacheprovider -n auto tests/tool \
    || { rm -rf "$tool_tmp"; exit 1; }
rm -rf "$tool_tmp"
echo "== lanes and exported series, side by side (the export check's lines: [export])"
# Every stage below runs even when an earlier one failed (each is long, and each
# failure is worth seeing in one CI run); the exit status says whether any failed.
# Both mostly wait on subprocesses: side by side they saved about 6 minutes
# (a clean-clone run of d5fda4c).
status=0
.venv/bin/python tools/export_check.py "$@" > >(sed -u 's/^/[export] /') 2>&1 &
export_check=$!
trap 'kill $venvs $export_check 2>/dev/null || true' EXIT
.venv/bin/python tools/lanes.py "$@" || status=1
wait $export_check || status=1
# A venv the background build could not make, the lanes and the engines make (or fail
# on) themselves: its log is shown, and only their verdict counts.
wait $venvs || { echo "== the background venv build failed:"; cat build/venvs.log; }
if [ "${VLLM_PATCHES_ENGINE_LANE:-1}" != 0 ]; then
    echo "== real-engine lane"
    .venv/bin/python tools/engine_lane.py || status=1
fi
exit $status
