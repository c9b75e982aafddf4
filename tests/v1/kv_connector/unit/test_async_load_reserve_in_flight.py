# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Async KV loads of a prompt's prefix under KV pressure: every request finishes; no
step leaves every request parked with nothing running.

Reproduces what PR 44560 fixed in v0.23 (upstream issue 45388): an async load was
admitted into blocks that a load already in flight needed for the rest of its prompt
once loaded. The first loaded request then could not be scheduled, nothing ran that
could be preempted, and the scheduler stopped at it: a deadlock. v0.19 - v0.22 admit
by the full sequence (scheduler_reserve_full_isl, on by default), which keeps the
last admitted load schedulable; with it off, or on v0.18, they deadlock too. The
scheduler is driven with NIXL remote prefills that load only part of each prompt (as
a CPU offload or a shared prefix store does), each READ completing two steps after
it starts, and the model runner's outputs.
"""

import random

import pytest

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
# Steps a READ takes, from the step that starts it.
READ_STEPS = 2
# Steps in a row in which nothing is scheduled, started or loaded: a deadlock.
STALLED_STEPS = 10
MAX_STEPS = 600


def draw(seed: int) -> dict:
    """2-4 prompts of 3-6 blocks, each loading 1 block to all but one, arriving
    together or 1-3 steps apart, in a KV pool smaller than they fill together."""
    rng = random.Random(seed)
    num_prompts = rng.randint(2, 4)
    prompt_blocks = rng.randint(3, 6)
    return {
        "num_prompts": num_prompts,
        "prompt_blocks": prompt_blocks,
        "loaded_blocks": rng.randint(1, prompt_blocks - 1),
        # The null block, room for one prompt and its output, up to all of them.
        "num_blocks": 1 + rng.randint(prompt_blocks + 1, num_prompts * prompt_blocks),
        "max_num_batched_tokens": rng.choice([2 * BLOCK_SIZE, 16 * BLOCK_SIZE]),
        "arrival_gap": rng.choice([0, 1, 3]),
        "full_sequence_must_fit": rng.random() < 0.5,
        "max_tokens": rng.randint(2, 8),
    }


def stalled_at(case: dict) -> str | None:
    """Run the case to its end; the scheduler's state when it stalled, else None."""
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=case["max_num_batched_tokens"],
        max_num_seqs=16,
    )
    # v0.18 has no such option: it admits by the allocation alone.
    vllm_config.scheduler_config.scheduler_reserve_full_isl = case[
        "full_sequence_must_fit"
    ]
    scheduler = create_scheduler(vllm_config, num_blocks=case["num_blocks"])
    remote_matches = scheduler.connector.get_num_new_matched_tokens
    loaded_tokens = case["loaded_blocks"] * BLOCK_SIZE

    def prefix_matches(request, num_computed_tokens):
        count, load_async = remote_matches(request, num_computed_tokens)
        if count and load_async:
            return max(0, loaded_tokens - num_computed_tokens), True
        return count, load_async

    scheduler.connector.get_num_new_matched_tokens = prefix_matches
    requests = [
        create_request(
            num_tokens=case["prompt_blocks"] * BLOCK_SIZE,
            do_remote_prefill=True,
            num_remote_blocks=case["loaded_blocks"],
            max_tokens=case["max_tokens"],
            block_size=BLOCK_SIZE,
        )
        for _ in range(case["num_prompts"])
    ]
    last_arrival = (len(requests) - 1) * case["arrival_gap"]
    reads: dict[str, int] = {}
    stalled = 0
    for step in range(MAX_STEPS):
        for i, request in enumerate(requests):
            if i * case["arrival_gap"] == step:
                scheduler.add_request(request)
        output = scheduler.schedule()
        started = set(output.kv_connector_metadata.reqs_to_recv)
        reads.update(dict.fromkeys(started, step + READ_STEPS))
        loaded = {req_id for req_id, done in reads.items() if done <= step}
        for req_id in loaded:
            del reads[req_id]
        scheduled = [r for r in requests if r.request_id in output.num_scheduled_tokens]
        runner_output = create_model_runner_output(
            reqs=scheduled, finished_recving=loaded or None
        )
        scheduler.update_from_output(output, runner_output)
        busy = scheduled or started or reads or loaded or step < last_arrival
        stalled = 0 if busy else stalled + 1
        if all(request.is_finished() for request in requests):
            return None
        if stalled >= STALLED_STEPS:
            free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            states = {r.request_id: r.status.name for r in requests}
            return f"{free} free blocks, {states}"
    return f"not finished after {MAX_STEPS} steps"


@pytest.mark.parametrize("seed", range(30))
def test_async_prefix_loads_under_kv_pressure_never_deadlock(seed):
    """Seeded async loads of 1 block to all but one of each prompt, in a KV pool
    that cannot hold every prompt at once: every request finishes."""
    case = draw(seed)
    stalled = stalled_at(case)
    assert stalled is None, f"seed {seed}, {case}: stalled with {stalled}"


def test_a_pool_with_room_for_every_prompt_finishes():
    """The same loads with KV to spare: what the reservation must not change."""
    case = {
        "num_prompts": 4,
        "prompt_blocks": 4,
        "loaded_blocks": 2,
        "num_blocks": 64,
        "max_num_batched_tokens": 2 * BLOCK_SIZE,
        "arrival_gap": 0,
        "full_sequence_must_fit": False,
        "max_tokens": 8,
    }
    assert stalled_at(case) is None
