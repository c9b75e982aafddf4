"""A completed push reported done at once, in a real NIXL push pair (vllm PR 58188;
F18 on v0.30.0), stock and fixed: ``push.py``'s warm-up and ``writes`` cases.

v0.30.0's push producer reports a finished WRITE done only for requests it receives
into, which it never does for what it pushes: stock holds every pushed prompt until its
lease ("retrieved by 0 remote worker(s)"); fixed releases it once its WRITE completed.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from analysis import released_at
from harness import bug_expected, probe_events, run_scenario

pytestmark = pytest.mark.engine

MODES = pytest.mark.parametrize("mode", ["stock", "fixed"])


@functools.cache
def pair(mode: str) -> dict[str, Any]:
    return run_scenario("nixl_push", mode, {"cases": ["writes"]}, label="push-done")


def releases(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per pushed prompt: its WRITEs, whether the producer released it, its expiry lines."""
    events = probe_events(Path(run["run_dir"]), "producer.probe.jsonl")
    expired = run["producer_lines"]["Releasing expired KV blocks"]
    return [{"rid": flow["rid"], "writes": len(flow["writes"]),
             "released": released_at(events, flow["rid"]) is not None,
             "expired_lines": [line for line in expired if flow["rid"] in line]}
            for flow in [run["warmup"], *run["cases"]["writes"]["prompts"]]]


@MODES
def test_a_pushed_prompt_is_released_when_its_write_completed(mode: str) -> None:
    """Fixed: every pushed prompt written, then released, never by its lease. Stock: each
    prompt it wrote is released by its lease only, the warm-up first (its legs wait up to
    150 s); a later prompt may never be written, waiting behind the held ones past the
    decoder's watchdog (F9; in a clean-clone CI run of 2026-11-28, the n = 4 one)."""
    prompts = releases(pair(mode))
    if bug_expected("F18", mode):
        written = [p for p in prompts if p["writes"]]
        assert written and written[0]["rid"] == "push-warmup", prompts
        assert all(p["released"] and p["expired_lines"] for p in written), prompts
    else:
        assert all(p["writes"] and p["released"] and not p["expired_lines"]
                   for p in prompts), prompts


@MODES
def test_every_push_is_answered_and_the_producer_ends_empty(mode: str) -> None:
    """The producer's KV empty at the end. Fixed: both legs of every prompt answered.
    Stock: the warm-up's prefill; a later prefill or decode leg may wait past the
    watchdog, whose stock client then hangs (F9)."""
    run = pair(mode)
    flows = [run["warmup"], *run["cases"]["writes"]["prompts"]]
    if bug_expected("F18", mode):
        assert run["warmup"]["prefill"]["status"] == 200, run["warmup"]
    else:
        for flow in flows:
            assert flow["prefill"]["status"] == 200 and flow["decode"]["status"] == 200, flow
    assert run["final_producer"]["kv_cache_usage_perc"] == 0.0, run["final_producer"]
