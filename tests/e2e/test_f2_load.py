"""F2 under sustained load in a real NIXL prefill/decode pair (vllm PR 43509's thread).

The seed's headline symptom, where an operator sees it: closed-loop clients send prompts
with n=8 through a prefill/decode pair whose producer has a bounded KV pool
(``scenarios.nixl_load``, ``LOAD_ARGS``). The decoder READs only the advertised sibling
of each prompt; stock holds the n-1 others until their lease runs out ("Releasing
expired KV blocks ... retrieved by 0 remote worker(s)"), so its pool fills with KV
nobody will read and its prefills queue for blocks, and it logs every READ after the
first as "Potentially invalid KV blocks". Fixed must show none of either over the whole
run, with the decoder queueing (its heartbeats renew the advertised sibling's lease, and
with F2 its registered siblings' too), and the producer's pool back to empty after the
drain. The figures (throughput, latency, KV usage over time) are
``benchmarks/bench_f2_load.py``'s, which renders them from this test's records.

The lane runs it on the newest layout only (``tools/engine_lane.py``, ``ENGINE_SETTINGS``):
it takes minutes per mode, and the lease-based release it exercises is that layout's.
It runs fixed only since 2026-11-28, and only with ``tools/engine_lane.py --full``
(marker ``full``) since 2026-11-30, for CI's budget: stock's expiries and invalid-KV
lines, which every stock run of it showed, also show in the fault matrix's waves
(``test_pd_faults.py``), and what fixed must keep here every generated CI seed keeps
(``generated.violations``: no invalid-KV line, no expiry of a prompt a child reads, KV
back to 0); ``bench_f2_load.py`` runs both modes.
"""

from __future__ import annotations

import functools

import analysis
import pytest
import scenarios
from harness import bug_expected, run_scenario

pytestmark = [pytest.mark.engine, pytest.mark.full]

MODES = ["fixed"]


@functools.cache
def load(mode: str) -> dict:
    record = run_scenario("nixl_load", mode, scenarios.LOAD_ARGS, label="f2-load")
    return analysis.load_summary(record)


@pytest.mark.parametrize("mode", MODES)
def test_load_is_reached(mode: str) -> None:
    """Every client finished prompts and the decoder READ KV: the scenario ran."""
    summary = load(mode)
    assert summary["prompts"] >= summary["clients"], summary
    assert summary["transfers"] >= summary["prompts"], summary


@pytest.mark.parametrize("mode", MODES)
def test_no_sibling_expires_under_load(mode: str) -> None:
    """Stock: the unread siblings run out their lease. Fixed: none does, even while the
    decoder queues children behind the advertised sibling's READ."""
    summary = load(mode)
    if bug_expected("F2", mode):
        assert summary["expired_lines"] > 0, summary
    else:
        assert summary["expired_lines"] == 0, summary


@pytest.mark.parametrize("mode", MODES)
def test_no_read_logged_as_invalid_kv(mode: str) -> None:
    summary = load(mode)
    if bug_expected("F2", mode):
        assert summary["invalid_kv_lines"] > 0, summary
    else:
        assert summary["invalid_kv_lines"] == 0, summary


def test_fixed_pool_is_empty_after_the_drain() -> None:
    summary = load("fixed")
    assert summary["usage_after"] == 0, summary
