"""tests/e2e/generated.py without engines: ``draw`` runs upgrades in progress, and
``violations`` holds each run to what its engines' fix sets promise (made-up records)."""

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_patches._catalog import series as _series

E2E = _series.REPO_DIR / "tests" / "e2e"
sys.path[:0] = [str(E2E), str(E2E / "engine_plugins")]  # the e2e harness is not a package
import generated

PROMPT = "cmpl-gen-0"
# The producer's lines for the sibling the children read (the advertised one), and for
# one that no child reads.
READ_SIBLING, UNREAD_SIBLING = f"1_{PROMPT}", f"0_{PROMPT}"
EXPIRED = f"Releasing expired KV blocks for request {READ_SIBLING} which were retrieved"
UNREAD_EXPIRED = f"Releasing expired KV blocks for request {UNREAD_SIBLING} which were"
INVALID = f"Potentially invalid KV blocks for unrecognized request {READ_SIBLING} were"
BOTH = {"producer": "all", "decoder": "all"}
STOCK_DECODER = {"producer": "all", "decoder": "none"}
STOCK_PRODUCER = {"producer": "none", "decoder": "all"}
DECODER_BUT_F5 = {"producer": "all", "decoder": "F2,F3,F4,F6,F7,F8"}


def record(tmp_path: Path, mode: str, fix_sets: dict[str, str], expired: list[str],
           invalid: list[str], usage: float = 0) -> dict[str, Any]:
    """A run of one prompt, its decode leg in time and served, no fault (decoder TP 2:
    no prompt KV compared)."""
    flow = {"index": 0, "key": PROMPT, "remote_request_id": READ_SIBLING, "n": 2, "t_prefilled": 0.0, "t_decode_start": 1.0,
            "t_end": 5.0, "decode": {"status": 200, "choices": 2}}
    params = {"mode": mode, "lease": 20, "decoder_tp": 2, "fault": {"kind": "none"}}
    return {"params": params, "release": "0.32.0", "fix_sets": fix_sets,
            "run_dir": str(tmp_path),
            "flows": [flow], "step_errors": [], "client_limit_s": 150,
            "final": {"producer": {"kv_cache_usage_perc": usage},
                      "decoder": {"kv_cache_usage_perc": 0}},
            "producer_lines": {generated.EXPIRED: expired, generated.INVALID: invalid},
            "decoder_lines": {generated.EXPIRED: [], generated.INVALID: []}}


@pytest.mark.parametrize(("mode", "fix_sets", "broken"), [
    ("pull", BOTH, True), ("push", BOTH, True),
    # A fixed pull producer frees a prompt under a READ only by lease (F2, F8).
    ("pull", STOCK_DECODER, True), ("pull", DECODER_BUT_F5, True),
    ("pull", STOCK_PRODUCER, False), ("push", STOCK_DECODER, False),
])
def test_an_invalid_line_without_a_lease_release(tmp_path: Path, mode: str,
                                                  fix_sets: dict[str, str],
                                                  broken: bool) -> None:
    found = generated.violations(record(tmp_path, mode, fix_sets, [], [INVALID]))
    assert bool(found) is broken, found


@pytest.mark.parametrize(("mode", "fix_sets", "broken"), [
    ("pull", BOTH, True), ("pull", STOCK_DECODER, False), ("pull", DECODER_BUT_F5, False),
])
def test_an_invalid_line_after_a_lease_release(tmp_path: Path, mode: str,
                                               fix_sets: dict[str, str],
                                               broken: bool) -> None:
    found = generated.violations(record(tmp_path, mode, fix_sets, [EXPIRED], [INVALID]))
    assert any("invalid-KV" in problem for problem in found) is broken, found


@pytest.mark.parametrize(("mode", "fix_sets", "broken"), [
    ("pull", BOTH, True), ("push", BOTH, True),
    # A fixed pull decoder renews its prompts through upstream's heartbeats (F6).
    ("pull", STOCK_PRODUCER, True), ("pull", DECODER_BUT_F5, True),
    ("push", STOCK_PRODUCER, False), ("pull", {"producer": "all", "decoder": "F5"}, False),
])
def test_a_prompt_released_by_lease_while_its_leg_ran(tmp_path: Path, mode: str,
                                                      fix_sets: dict[str, str],
                                                      broken: bool) -> None:
    found = generated.violations(record(tmp_path, mode, fix_sets, [EXPIRED], []))
    assert bool(found) is broken, found


@pytest.mark.parametrize(("fix_sets", "broken"), [
    (BOTH, True), ({"producer": "F2,F8", "decoder": "all"}, True),
    # A producer without F2 lets the siblings no child reads expire (F2's bug).
    (STOCK_PRODUCER, False),
])
def test_a_sibling_no_child_reads_released_by_lease(tmp_path: Path,
                                                    fix_sets: dict[str, str],
                                                    broken: bool) -> None:
    found = generated.violations(record(tmp_path, "pull", fix_sets, [UNREAD_EXPIRED], []))
    assert bool(found) is broken, found


@pytest.mark.parametrize("fix_sets", [BOTH, STOCK_DECODER, STOCK_PRODUCER, DECODER_BUT_F5])
def test_kv_held_a_lease_after_breaks_every_fix_set(tmp_path: Path,
                                                    fix_sets: dict[str, str]) -> None:
    found = generated.violations(record(tmp_path, "pull", fix_sets, [], [], usage=0.5))
    assert found == ["producer KV usage 0.5 a lease after the last call"]


@pytest.mark.parametrize(("mode", "fix_sets", "broken"), [
    ("push", BOTH, True), ("pull", STOCK_DECODER, True),
    # A push decoder without F9 leaves an unserved registration waiting (F9's bug).
    ("push", STOCK_DECODER, False),
])
def test_a_decode_call_that_hung(tmp_path: Path, mode: str, fix_sets: dict[str, str],
                                 broken: bool) -> None:
    hung = record(tmp_path, mode, fix_sets, [], [])
    hung["flows"][0]["decode"]["hung"] = True
    hung["final"]["decoder"]["kv_cache_usage_perc"] = 0.5
    found = generated.violations(hung)
    assert bool(found) is broken, found


def test_draws_run_every_upgrade_in_progress() -> None:
    """Of seeds 0-299, most run every fix on both engines, and each engine is drawn
    behind on each earlier fix set; the same seed draws the same pair."""
    drawn = [generated.draw(seed)["fix_sets"] for seed in range(300)]
    assert generated.draw(7) == generated.draw(7)
    behind = {(role, fix_set) for fix_sets in drawn for role, fix_set in fix_sets.items()
              if fix_set != "all"}
    assert behind == {(role, fix_set) for role in generated.ROLES
                      for fix_set in generated.BEHIND}
    assert drawn.count(BOTH) > len(drawn) / 2


def test_a_release_without_push_mode_draws_the_same_prompts_pulled() -> None:
    """Before v0.24 a push draw runs as a pull pair; the seed keeps every other dimension."""
    for seed in range(40):
        newest, old = generated.draw(seed), generated.draw(seed, "0.21.0")
        assert old["mode"] == "pull"
        assert {**newest, "mode": "pull"} == old


@pytest.mark.parametrize(("read_at", "fix_sets", "broken"), [
    (1.0, BOTH, True), (1.0, STOCK_DECODER, True),
    # A READ past the timeout: F7 on the decoder computes such a prompt instead.
    (19.0, BOTH, True),
    # A decoder without F7 READs it; no heartbeat before v0.22 told the producer.
    (19.0, STOCK_DECODER, False),
    # A producer without F2 frees the read sibling at the first child's notification.
    (1.0, STOCK_PRODUCER, False),
])
def test_an_invalid_line_before_heartbeats(tmp_path: Path, read_at: float,
                                           fix_sets: dict[str, str], broken: bool) -> None:
    """On v0.21 (no heartbeats, a timeout of 20 s, prefilled at 0 s) a producer with F2
    frees only prompts a READ reached late, and none beside a decoder with F7."""
    (tmp_path / "decoder.probe.jsonl").write_text(json.dumps(
        {"t": read_at, "event": "read", "op": "READ", "notif": f"{READ_SIBLING}:1"}) + "\n")
    old = {**record(tmp_path, "pull", fix_sets, [EXPIRED], [INVALID]), "release": "0.21.0"}
    found = generated.violations(old)
    assert bool(found) is broken, found
