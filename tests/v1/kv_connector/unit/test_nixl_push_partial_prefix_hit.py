# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a decoder with a partial prefix hit gets the tail of the prompt.

A push decoder registers with the producer only its blocks after its cached prefix;
the producer holds the whole prompt. vllm-project/vllm#48633 (case C3): the
producer's _xfer_blocks kept its *first* blocks, as many as the decoder registered,
so the decoder's uncached blocks got the start of the prompt's KV and it decoded
from it without an error. PR 48758 (v0.28.0) WRITEs the producer's last blocks.

These tests drive the release's push producer worker on upstream's fake NIXL agent,
after upstream's fake handshake with a twin decoder (same TP size, block size and
layout), and read the block pairs off the WRITE it posts (one region: a block's
descriptor is its id).
"""

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPushConnector,
)

from . import nixl_harness
from .test_nixl_connector import FakeNixlConnectorWorker, FakeNixlWrapper
from .utils import create_vllm_config, make_kv_cache_config

# The distributed world is set up once for the module (dist_world).
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

dist_world = nixl_harness.dist_world

DECODER = FakeNixlConnectorWorker.REMOTE_ENGINE_ID


class WriteRecorder(FakeNixlWrapper):
    """Upstream's fake NIXL agent, recording each WRITE's (local, remote) descs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[list[int], list[int]]] = []

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> int:
        # ("WRITE", local handle, local descs, remote handle, remote descs, ...)
        local, remote = args[2], args[4]
        self.writes.append(([int(d) for d in local], [int(d) for d in remote]))
        return super().make_prepped_xfer(*args, **kwargs)


@pytest.fixture
def producer(dist_world, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A push producer's worker whose handshake with the decoder is done."""
    monkeypatch.setattr(base_worker, "NixlWrapper", WriteRecorder)
    vllm_config = create_vllm_config(kv_connector="NixlPushConnector")
    kv_cache_config = make_kv_cache_config(
        block_size=vllm_config.cache_config.block_size
    )
    with set_current_vllm_config(vllm_config):
        connector = NixlPushConnector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        worker: Any = connector.connector_worker
        # What upstream's fake worker sets in place of register_kv_caches.
        fake = FakeNixlConnectorWorker(
            vllm_config,
            worker.engine_id,
            hand_shake_latency=0,
            kv_cache_config=kv_cache_config,
        )
    for name in ("transfer_topo", "src_xfer_handles_by_block_size", "kv_cache_layout"):
        setattr(worker, name, getattr(fake, name))
    if hasattr(fake, "src_blocks_data"):
        worker.src_blocks_data = fake.src_blocks_data
    worker.num_regions = 1
    worker.REMOTE_ENGINE_ID = DECODER
    worker._hand_shake_latency = 0
    agents = FakeNixlConnectorWorker._nixl_handshake(worker, "", 0, 1, DECODER)
    worker._remote_agents[DECODER] = agents if isinstance(agents, dict) else agents[0]
    worker._engine_last_active[DECODER] = time.perf_counter()
    yield worker
    with contextlib.suppress(Exception):
        fake.shutdown()
        connector.shutdown()


def push(worker: Any, prompt: list[int], decoder: list[int]) -> tuple[list, list]:
    """Pair the producer's finished prompt blocks with a decoder registration of
    ``decoder`` blocks and return the one WRITE posted: (local, remote) blocks."""
    registration = {
        "request_id": "cmpl-decode-0",
        "decode_engine_id": DECODER,
        "decode_host": "localhost",
        "decode_port": 0,
        "decode_tp_size": 1,
        "local_block_ids": (decoder,),
        "remote_engine_id": worker.engine_id,
        "remote_host": "localhost",
        "remote_port": 0,
        "remote_tp_size": 1,
    }
    worker._do_start_push_kv("cmpl-prefill-0", (prompt,), registration)
    writes = worker.nixl_wrapper.writes
    assert len(writes) == 1, f"WRITEs posted: {writes}"
    return writes[0]


def test_partial_prefix_hit_gets_the_tail_of_the_prompt(producer):
    """The decoder holds the first 3 of 5 prompt blocks in its prefix cache and
    registers 2 blocks: they get the producer's blocks 4 and 5, not 1 and 2.
    Stock before v0.28.0: local [10, 11] into [51, 52]."""
    local, remote = push(producer, prompt=[10, 11, 12, 13, 14], decoder=[51, 52])
    assert list(zip(local, remote)) == [(13, 51), (14, 52)]


def test_without_a_prefix_hit_the_whole_prompt_is_written(producer):
    """No prefix hit: block i of the prompt goes to decoder block i, as before."""
    local, remote = push(producer, prompt=[10, 11, 12], decoder=[50, 51, 52])
    assert list(zip(local, remote)) == [(10, 50), (11, 51), (12, 52)]
