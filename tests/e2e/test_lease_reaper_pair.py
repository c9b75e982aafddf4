"""Expired leases behind one that heartbeats renew, in a real NIXL pull pair (vllm issue
58222, PR 50789; F17 on v0.22 - v0.30), stock and fixed: ``reaper.py``.

Prompt A waits for a decoder seat while the decoder's heartbeats renew its lease; prompts
B and C, registered after it, are read by no one. Stock's reaper stops at A, so B and C
stay held until A's READ; fixed releases them as their leases run out, A still waiting.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from harness import bug_expected, run_scenario

pytestmark = pytest.mark.engine

MODES = pytest.mark.parametrize("mode", ["stock", "fixed"])


@functools.cache
def pair(mode: str) -> dict[str, Any]:
    return run_scenario("lease_reaper", mode)


def check_reached(run: dict[str, Any]) -> None:
    """A was the renewed head: still registered, unread and unexpired when the busy
    client left, and served after it."""
    head = run["head"]
    assert head["decode"]["status"] == 200, head
    assert head["expired_lines"] == [], head
    assert head["t_read"] is None or head["t_read"] > run["t_busy_leaves"], head
    assert head["t_released"] is None or head["t_released"] > run["t_busy_leaves"], head


@MODES
def test_expired_leases_behind_a_renewed_one_are_released(mode: str) -> None:
    """The bug: B and C are released only after A (stock); fixed releases both by lease
    while A is still held."""
    run = pair(mode)
    check_reached(run)
    released = [orphan["t_released"] for orphan in run["orphans"]]
    assert all(t is not None for t in released), run["orphans"]
    assert all(orphan["expired_lines"] for orphan in run["orphans"]), run["orphans"]
    if bug_expected("F17", mode):
        assert all(t > run["t_busy_leaves"] for t in released), (run["t_busy_leaves"], released)
    else:
        assert all(t < run["t_busy_leaves"] for t in released), (run["t_busy_leaves"], released)


@MODES
def test_the_pair_ends_with_no_kv_held_and_no_invalid_read(mode: str) -> None:
    run = pair(mode)
    assert run["invalid_lines"] == []
    assert run["final_producer"]["kv_cache_usage_perc"] == 0.0, run["final_producer"]
    assert run["final_decoder"]["kv_cache_usage_perc"] == 0.0, run["final_decoder"]
