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

from collections.abc import Iterator
from typing import Any

import pytest

from . import nixl_harness
from .test_nixl_connector import FakeNixlWrapper

# The distributed world is set up once for the module (dist_world).
pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

dist_world = nixl_harness.dist_world


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
    with nixl_harness.push_producer_handshaken(monkeypatch, WriteRecorder) as worker:
        yield worker


def push(worker: Any, prompt: list[int], decoder: list[int]) -> tuple[list, list]:
    """Pair the producer's finished prompt blocks with a decoder registration of
    ``decoder`` blocks and return the one WRITE posted: (local, remote) blocks."""
    registration = nixl_harness.push_registration(worker, decoder)
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
