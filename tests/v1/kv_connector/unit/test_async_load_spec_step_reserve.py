# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A decoder with speculative decoding and async KV loads under KV pressure: every
request finishes; no step leaves every request parked with nothing running.

Reproduces what PR 57104 fixed in v0.31: on v0.30 an async load was admitted into
blocks that a finished load needed for its first speculative step (its token, the
drafts and the lookahead). Once the loads in flight took them, the promoted request
could not be scheduled, nothing ran that could be preempted, and the loads behind it
were never promoted: a deadlock. The scheduler is driven with NIXL remote prefills
(each READ completes the step after it starts) and the model runner's outputs.
"""

import dataclasses
import random

import pytest

from vllm.config import SpeculativeConfig
from vllm.utils.math_utils import cdiv

from .utils import (
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
# Steps in a row in which nothing is scheduled, started or loaded: a deadlock.
STALLED_STEPS = 10
MAX_STEPS = 400


def draw(seed: int) -> dict:
    """1-8 draft tokens, EAGLE's branch or not, 2-6 remote prompts of one length
    (a whole number of blocks or not), a KV pool 1-3 blocks past what they fill."""
    rng = random.Random(seed)
    num_prompts = rng.randint(2, 6)
    prompt_len = rng.choice([BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE, 24, 31])
    prompt_blocks = cdiv(prompt_len, BLOCK_SIZE)
    return {
        "num_spec_tokens": rng.choice([1, 2, 4, 8]),
        "eagle": rng.random() < 0.5,
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        # The null block, the prompts' blocks, and 0-2 spare.
        "num_blocks": 1 + num_prompts * prompt_blocks + rng.randint(0, 2),
        "max_tokens": rng.randint(2, 12),
    }


def stalled_at(case: dict) -> str | None:
    """Run the case to its end; the scheduler's state when it stalled, else None."""
    vllm_config = create_vllm_config(
        block_size=BLOCK_SIZE, max_num_batched_tokens=1024, max_num_seqs=16
    )
    speculative_config = SpeculativeConfig(
        model="ngram",
        method="ngram",
        num_speculative_tokens=case["num_spec_tokens"],
        prompt_lookup_max=case["num_spec_tokens"],
    )
    vllm_config = dataclasses.replace(
        vllm_config, speculative_config=speculative_config
    )
    scheduler = create_scheduler(vllm_config, num_blocks=case["num_blocks"])
    # EAGLE's branch of the scheduler (an async load allocates no lookahead
    # slots) without a draft model to load.
    scheduler.use_eagle = case["eagle"]
    requests = [
        create_request(
            num_tokens=case["prompt_len"],
            do_remote_prefill=True,
            num_remote_blocks=cdiv(case["prompt_len"], BLOCK_SIZE),
            max_tokens=case["max_tokens"],
            block_size=BLOCK_SIZE,
        )
        for _ in range(case["num_prompts"])
    ]
    for request in requests:
        scheduler.add_request(request)
    loading: set[str] = set()
    stalled = 0
    for _ in range(MAX_STEPS):
        output = scheduler.schedule()
        started = set(output.kv_connector_metadata.reqs_to_recv)
        scheduled = [r for r in requests if r.request_id in output.num_scheduled_tokens]
        runner_output = create_model_runner_output(
            reqs=scheduled, finished_recving=loading or None
        )
        scheduler.update_from_output(output, runner_output)
        stalled = 0 if scheduled or started or loading else stalled + 1
        loading = started
        if all(request.is_finished() for request in requests):
            return None
        if stalled >= STALLED_STEPS:
            free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
            states = {r.request_id: r.status.name for r in requests}
            return f"{free} free blocks, {states}"
    return f"not finished after {MAX_STEPS} steps"


@pytest.mark.parametrize("seed", range(12))
def test_async_loads_with_speculative_decoding_never_deadlock(seed):
    """Seeded decoders with 1-8 draft tokens and 2-6 remote prompts in a KV pool
    0-2 blocks past their prompts: every request finishes."""
    case = draw(seed)
    stalled = stalled_at(case)
    assert stalled is None, f"seed {seed}, {case}: stalled with {stalled}"


def test_a_pool_with_room_for_every_step_finishes():
    """The same decoder with KV to spare: what the reservation must not change."""
    case = {
        "num_spec_tokens": 4,
        "eagle": True,
        "num_prompts": 4,
        "prompt_len": 2 * BLOCK_SIZE,
        "num_blocks": 64,
        "max_tokens": 8,
    }
    assert stalled_at(case) is None
