# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stateful test of the NIXL pull-mode release protocol with KV leases (v0.22+).

Reproduces the parallel-sampling release bugs of the lease protocol that PR 41383
introduced (and that PR 43509's sibling release touches): a prefill with ``n > 1``
finishes ``n`` siblings ``f"{i}_{parent}"`` on the producer, the prefill response
names one of them, and the decode engine splits the request into ``n`` children
that all carry that remote request id. The producer released the read sibling at
the first child's notifications while other children still read it, and the
decoder's heartbeats stopped renewing the prompt's lease when the first child
stopped (its KV arrived or it was aborted), so the producer released the prompt by
lease while other children still waited to read it.

Hypothesis interleaves, against the real producer worker (fake NIXL agent, fake
clock) and the real decoder-side scheduler connector (its heartbeat bookkeeping:
``on_new_request``, ``update_connector_output``, ``request_finished`` and
``build_connector_meta``, whose ``heartbeat_by_engine`` the decode workers send as
"HB:id1,id2" notifications): prefills registered with the producer (some siblings
registering late), the children of a prompt admitted together, READs started and
completed on each of 1 or 2 decode ranks (decoder TP 2 over producer TP 1: two
notifications per READ, each from its rank's own NIXL agent, which the producer reads
agent by agent; each rank marks the READ it posts in a heartbeat, as a decode worker
does), bare notifications of children that hit the decoder's
prefix cache after a sibling child's READ, children finished and aborted, decoder
steps (each shorter than the heartbeat interval: a live decoder) and a clock jump
past the lease while no child needs a held prompt. Checked throughout: no READ
starts on, or is outstanding over, a released request for a child that is not
aborted; every request is released within one lease of its last reader finishing;
staged notifications stay within their limit; and after a drain nothing is held by
the producer nor heartbeated by the decoder.
"""

import contextlib
import functools
import importlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from . import nixl_harness
from .nixl_harness import FakeClock, Producer, connector_module
from .utils import create_request, create_vllm_config, make_kv_cache_config

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
# Decoder-side modules that read the clock for heartbeats (v0.22 - v0.23, v0.24+).
_SCHEDULER_MODULES = (f"{_V1}.nixl.scheduler", f"{_V1}.nixl.base_scheduler")

# kv_lease_duration of both engines: the producer's first lease, and from it the
# decoder's heartbeat interval (LEASE // 6) and the producer's extension per
# heartbeat (LEASE * 2 // 3).
LEASE = 30
LEASE_CONFIG = {"kv_lease_duration": LEASE}
# A live decoder steps at least once per heartbeat interval.
MAX_STEP = LEASE // 6
# The prefill response reaches the decoder within this many seconds of the
# producer's registration.
ADMISSION_WINDOW = 2 * MAX_STEP
MAX_PROMPTS = 3
# The heartbeat entry a decode worker sends after posting a READ.
READ_POSTED_MARK = "read-posted/"


dist_world = nixl_harness.dist_world
make_producer = nixl_harness.make_producer


def _patch_decoder_clock(monkeypatch, clock: FakeClock) -> None:
    for name in _SCHEDULER_MODULES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if getattr(module, "time", None) in (time, clock):
                monkeypatch.setattr(module, "time", clock)


@functools.cache
def decoder_config() -> Any:
    return create_vllm_config(kv_connector_extra_config=LEASE_CONFIG)


def make_decoder() -> Any:
    """The decode engine's scheduler-side NIXL connector."""
    vllm_config = decoder_config()
    with set_current_vllm_config(vllm_config):
        return connector_module().NixlConnector(
            vllm_config,
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(block_size=vllm_config.cache_config.block_size),
        )


@dataclass
class Child:
    """A decode child; ``state``: waiting -> reading -> arrived -> finished,
    waiting -> notified -> finished (a prefix-cache hit after a sibling child's
    READ), or aborted while waiting (its bare notification leaves with the next
    decoder step) or while reading (its READ still completes)."""

    request: Request
    state: str = "waiting"
    aborted: bool = False
    ranks_done: set[int] = field(default_factory=set)
    done_at: float | None = None  # when it stopped needing the prompt


@dataclass
class Prompt:
    parent: str
    siblings: list[str]
    registered_at: dict[str, float]  # sibling -> its registration to send
    admitted_at: float | None = None
    children: list[Child] = field(default_factory=list)

    @property
    def read(self) -> str:
        """The sibling the prefill response names: the last one to finish."""
        return self.siblings[-1]

    def done_at(self) -> float | None:
        """When its last child stopped needing it (None while one needs it)."""
        done = [c.done_at for c in self.children if c.done_at is not None]
        if self.admitted_at is None or len(done) < len(self.children):
            return None
        return max(done)


def parent_id(k: int) -> str:
    """A parent id with the -xxxxxxxx suffix of vLLM's request-id randomization."""
    return f"cmpl-prompt{k}-{(0x9E3779B1 * (k + 1)) % 2**32:08x}"


class ReleaseProtocol(RuleBasedStateMachine):
    """One producer (TP 1) and one decoder (TP 1 or 2), sharing a fake clock."""

    def __init__(self, make_producer, monkeypatch) -> None:
        super().__init__()
        self.producer: Producer = make_producer(**LEASE_CONFIG)
        self.clock = self.producer.clock
        _patch_decoder_clock(monkeypatch, self.clock)
        self.decoder = make_decoder()
        self.ranks = 1
        self.prompts: list[Prompt] = []
        self.released: dict[str, float] = {}
        self.next_request = 0

    # -- helpers ---------------------------------------------------------------
    def poll(self) -> None:
        """A producer step: what its worker reports done sending is freed."""
        for req_id in self.producer.finished_sending():
            self.released.setdefault(req_id, self.clock.now)
            for prompt in self.prompts:
                if req_id == prompt.read:
                    readers = [
                        c.request.request_id
                        for c in prompt.children
                        if c.state == "reading" and not c.aborted
                    ]
                    assert not readers, (
                        f"{req_id} released while {readers} still READ it"
                    )

    def notify(self, prompt: Prompt, ranks: range | list[int]) -> None:
        """A pull-complete notification from each of ``ranks``, as its worker
        sends them (the count it puts in the message: the decoder's TP over the
        producer's 1). Each decode rank is a NIXL agent of its own: the producer
        reads one agent's notifications, then the next's."""
        for rank in ranks:
            self.producer.notify(prompt.read, self.ranks, agent=f"decode-{rank}")

    def heartbeat(self, *req_ids: str) -> None:
        """The same heartbeat from every decode rank (each sends what the
        scheduler's metadata names)."""
        for rank in range(self.ranks):
            self.producer.heartbeat(*req_ids, agent=f"decode-{rank}")

    def children(self, *states: str, aborted: bool | None = False) -> list:
        """(prompt, child) pairs of children in ``states``."""
        return [
            (prompt, child)
            for prompt in self.prompts
            for child in prompt.children
            if child.state in states and (aborted is None or child.aborted is aborted)
        ]

    def draw_child(self, data, pairs: list) -> tuple[Prompt, Child]:
        """One of ``pairs``, drawn by the child's request id."""
        by_id = {child.request.request_id: (p, child) for p, child in pairs}
        return by_id[data.draw(st.sampled_from(sorted(by_id)))]

    def finish(self, child: Child, status: RequestStatus) -> None:
        child.request.status = status
        self.decoder.request_finished(child.request, ([],))

    def decoder_step(self, seconds: float) -> None:
        """``seconds`` pass (the producer steps meanwhile), then the decoder
        schedules a step: its connector metadata goes to each decode worker,
        which sends the heartbeats and the bare notifications of requests it has
        no blocks to read for. A sibling registers at most one producer step
        late: before any time passes."""
        self.register_late_siblings()
        self.clock.now += seconds
        self.poll()
        output = _empty_scheduler_output()
        metadata = self.decoder.build_connector_meta(output)
        for engine_info in (metadata.heartbeat_by_engine or {}).values():
            self.heartbeat(*engine_info.req_ids)
        for prompt, child in self.children("aborted_waiting", aborted=True):
            if child.request.request_id in metadata.reqs_to_recv:
                self.notify(prompt, range(self.ranks))
                child.state = "aborted"
                child.done_at = self.clock.now
        self.poll()

    # -- rules -----------------------------------------------------------------
    @initialize(ranks=st.sampled_from([1, 2]))
    def decode_ranks(self, ranks: int) -> None:
        self.ranks = ranks

    @precondition(lambda self: len(self.prompts) < MAX_PROMPTS)
    @rule(n=st.integers(2, 4), data=st.data())
    def register_prefill(self, n: int, data) -> None:
        """The producer finished a prefill of ``n`` siblings; those not ``late``
        register to send in this step, the others in a later one."""
        parent = parent_id(len(self.prompts))
        siblings = [f"{i}_{parent}" for i in range(n)]
        late = data.draw(st.sets(st.sampled_from(siblings), max_size=n - 1), "late")
        self.register(siblings, late)

    def register(self, siblings: list[str], late: set[str]) -> Prompt:
        on_time = [s for s in siblings if s not in late]
        self.producer.step(in_batch=siblings, to_send=on_time, ttl=LEASE)
        parent = siblings[0].partition("_")[2]
        prompt = Prompt(parent, siblings, {s: self.clock.now for s in on_time})
        self.prompts.append(prompt)
        self.poll()
        return prompt

    def register_late_siblings(self) -> None:
        for prompt, sibling in self._late():
            self.register_late(prompt, sibling)

    def register_late(self, prompt: Prompt, sibling: str) -> None:
        self.producer.step(to_send=[sibling], ttl=LEASE)
        prompt.registered_at[sibling] = self.clock.now
        self.poll()

    def _late(self) -> list[tuple[Prompt, str]]:
        return [
            (p, s) for p in self.prompts for s in p.siblings if s not in p.registered_at
        ]

    @precondition(lambda self: self._late())
    @rule(data=st.data())
    def late_sibling(self, data) -> None:
        late = {s: p for p, s in self._late()}
        sibling = data.draw(st.sampled_from(sorted(late)))
        self.register_late(late[sibling], sibling)

    def _admissible(self) -> list[Prompt]:
        return [
            p
            for p in self.prompts
            if p.admitted_at is None
            and self.clock.now - min(p.registered_at.values(), default=self.clock.now)
            <= ADMISSION_WINDOW
            and p.read not in self.released
        ]

    @precondition(lambda self: self._admissible())
    @rule(data=st.data())
    def admit_children(self, data) -> None:
        """The decode engine splits the request into n children, each with its
        own copy of the prefill response's kv_transfer_params."""
        admissible = {p.parent: p for p in self._admissible()}
        self.admit(admissible[data.draw(st.sampled_from(sorted(admissible)))])

    def admit(self, prompt: Prompt) -> None:
        prompt.admitted_at = self.clock.now
        for _ in prompt.siblings:
            self.next_request += 1
            request = create_request(
                request_id=self.next_request, do_remote_prefill=True
            )
            params = dict(request.kv_transfer_params or {})
            params["remote_request_id"] = prompt.read
            request.kv_transfer_params = params
            self.decoder.on_new_request(request)
            prompt.children.append(Child(request))

    @precondition(lambda self: self.children("waiting"))
    @rule(data=st.data())
    def read_start(self, data) -> None:
        self._start_read(*self.draw_child(data, self.children("waiting")))

    def _start_read(self, prompt: Prompt, child: Child) -> None:
        assert prompt.read not in self.released, (
            f"{child.request.request_id} starts a READ of {prompt.read}, released "
            f"at {self.released[prompt.read]:.0f} (now {self.clock.now:.0f})"
        )
        child.state = "reading"
        # Each decode rank, once it posted its READ, marks it in a heartbeat: the
        # producer holds the prompt until the READ's notification.
        self.heartbeat(prompt.read, f"{READ_POSTED_MARK}{prompt.read}")
        # What update_state_after_alloc does once the READ is scheduled.
        assert child.request.kv_transfer_params is not None
        child.request.kv_transfer_params["do_remote_prefill"] = False

    def _rank_reads(self) -> list[tuple[Prompt, Child, int]]:
        return [
            (p, c, rank)
            for p, c in self.children("reading", aborted=None)
            for rank in range(self.ranks)
            if rank not in c.ranks_done
        ]

    @precondition(lambda self: self._rank_reads())
    @rule(data=st.data())
    def read_complete(self, data) -> None:
        """One decode rank's READ completes: its notification goes out; the
        scheduler hears finished_recving once every rank's READ completed."""
        reads = {
            f"{c.request.request_id}@{r}": (p, c, r) for p, c, r in self._rank_reads()
        }
        self._complete_read(*reads[data.draw(st.sampled_from(sorted(reads)))])

    def _complete_read(self, prompt: Prompt, child: Child, rank: int) -> None:
        child.ranks_done.add(rank)
        self.notify(prompt, [rank])
        if len(child.ranks_done) == self.ranks:
            child.state = "aborted" if child.aborted else "arrived"
            child.done_at = self.clock.now
            self.decoder.update_connector_output(
                KVConnectorOutput(finished_recving={child.request.request_id})
            )
        self.poll()

    def _cache_hits(self) -> list[tuple[Prompt, Child]]:
        return [
            (p, c)
            for p, c in self.children("waiting")
            if any(other.state in ("arrived", "finished") for other in p.children)
        ]

    @precondition(lambda self: self._cache_hits())
    @rule(data=st.data())
    def bare_notification(self, data) -> None:
        """A child whose prompt the decoder's prefix cache holds after a sibling
        child's READ: no READ, one notification per decode rank. Its heartbeat
        stays until it finishes, as upstream's does."""
        prompt, child = self.draw_child(data, self._cache_hits())
        child.state = "notified"
        child.done_at = self.clock.now
        assert child.request.kv_transfer_params is not None
        child.request.kv_transfer_params["do_remote_prefill"] = False
        self.notify(prompt, range(self.ranks))
        self.poll()

    @precondition(lambda self: self.children("arrived", "notified"))
    @rule(data=st.data())
    def finish_child(self, data) -> None:
        _, child = self.draw_child(data, self.children("arrived", "notified"))
        self.finish(child, RequestStatus.FINISHED_LENGTH_CAPPED)
        child.state = "finished"

    @precondition(lambda self: self.children("waiting", "reading"))
    @rule(data=st.data())
    def abort_child(self, data) -> None:
        """A client abort: a waiting child's bare notification leaves with the
        next decoder step; a reading child's READ still completes."""
        _, child = self.draw_child(data, self.children("waiting", "reading"))
        child.aborted = True
        if child.state == "waiting":
            child.state = "aborted_waiting"
        self.finish(child, RequestStatus.FINISHED_ABORTED)

    @rule(seconds=st.integers(1, MAX_STEP))
    def step(self, seconds: int) -> None:
        self.decoder_step(seconds)

    @rule()
    def wait_a_lease(self) -> None:
        """The decoder steps on for longer than a lease while its children wait
        (for KV-cache room, or for a sibling child's READ)."""
        self.wait(LEASE + MAX_STEP)

    def wait(self, seconds: int) -> None:
        for _ in range(seconds // MAX_STEP):
            self.decoder_step(MAX_STEP)

    def _needed(self) -> bool:
        return bool(self.children("waiting", "reading"))

    @precondition(lambda self: not self._needed())
    @rule()
    def lease_expiry(self) -> None:
        """No child needs a prompt: the decoder idles past every lease."""
        self.decoder_step(LEASE + 1)

    # -- invariants --------------------------------------------------------------
    @invariant()
    def released_within_a_lease_of_the_last_reader(self) -> None:
        for prompt in self.prompts:
            done_at = prompt.done_at()
            if done_at is None:
                continue
            for sibling, registered_at in prompt.registered_at.items():
                deadline = max(done_at, registered_at) + LEASE
                assert sibling in self.released or self.clock.now <= deadline, (
                    f"{sibling} held at {self.clock.now:.0f}, its last reader was "
                    f"done at {done_at:.0f}"
                )

    @invariant()
    def staging_bounded(self) -> None:
        early = getattr(self.producer.worker, "_early_notifs", None)
        if early is not None:
            assert len(early.staged) <= early.limit

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a failure is being reported: no drain
        self.drain()

    def drain(self) -> None:
        """The decoder steps on for a lease, then
        every waiting child READs, every READ completes, every child finishes;
        then the decoder steps past every lease. Nothing may be left held or
        heartbeated."""
        self.register_late_siblings()
        self.wait(LEASE + MAX_STEP)
        for prompt, child in self.children("waiting"):
            self._start_read(prompt, child)
        while self._rank_reads():
            self._complete_read(*self._rank_reads()[0])
        for _, child in self.children("arrived", "notified"):
            self.finish(child, RequestStatus.FINISHED_LENGTH_CAPPED)
            child.state = "finished"
        self.wait(2 * LEASE)
        assert self.producer.held() == set()
        scheduler = self.decoder.connector_scheduler
        assert not scheduler._heartbeat_by_engine
        assert not scheduler._heartbeat_req_engine
        early = getattr(self.producer.worker, "_early_notifs", None)
        assert early is None or not early.staged


def _empty_scheduler_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def test_release_protocol(make_producer, monkeypatch):
    if not make_producer().has_heartbeats:
        pytest.skip("KV leases and heartbeats exist from v0.22")
    run_state_machine_as_test(
        lambda: ReleaseProtocol(make_producer, monkeypatch),
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            database=None,
            report_multiple_bugs=False,
            # No explain phase: it reruns the failing case many times over.
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_decoder_step_longer_than_the_lease(make_producer, monkeypatch):
    """A live decoder (it steps and heartbeats) whose step stalls for a lease
    while one child's READ is in flight: no heartbeat renews the lease, and the
    producer holds the prompt because the READ was marked as posted."""
    machine = ReleaseProtocol(make_producer, monkeypatch)
    if not machine.producer.has_heartbeats:
        pytest.skip("KV leases and heartbeats exist from v0.22")
    prompt = machine.register([f"{i}_{parent_id(0)}" for i in range(2)], set())
    machine.admit(prompt)
    machine.decoder_step(MAX_STEP)
    machine._start_read(prompt, prompt.children[0])
    machine.decoder_step(LEASE)
    machine._complete_read(prompt, prompt.children[0], 0)
    machine.drain()


@pytest.mark.xfail(
    strict=True,
    reason="open: heartbeats ride the decoder's steps (vllm PR 41383), so the "
    "producer cannot tell this decoder from one killed after its READ "
    "(test_decoder_killed_after_its_read)",
)
def test_decoder_step_longer_than_the_lease_after_a_read(make_producer, monkeypatch):
    """Decoder TP 2 over producer TP 1: the READ of an n = 4 prompt completes on
    both ranks during a step that outlasts the lease extension, so the other
    children's full-hit notifications leave only with the next step (a TP-2 CPU
    decoder's first forward pass took 13 s against an 8 s extension in a real
    v0.32.0 pair; F5 sends them before the pass of the step that carries them, but
    not before the pass during which the READ completes). The producer must not
    release the prompt before those notifications."""
    machine = ReleaseProtocol(make_producer, monkeypatch)
    if not machine.producer.has_heartbeats:
        pytest.skip("KV leases and heartbeats exist from v0.22")
    machine.ranks = 2
    prompt = machine.register([f"{i}_{parent_id(0)}" for i in range(4)], set())
    machine.admit(prompt)
    machine.decoder_step(MAX_STEP)
    machine._start_read(prompt, prompt.children[0])
    for rank in range(machine.ranks):
        machine._complete_read(prompt, prompt.children[0], rank)
    machine.clock.now += LEASE  # one decoder step; the producer steps on
    machine.poll()
    released = sorted(set(prompt.siblings) & machine.released.keys())
    assert not released, f"{released} released by lease while 3 children still wait"


def test_decoder_killed_after_its_read(make_producer, monkeypatch):
    """The real-engine fault matrix's decoder-killed case (d): the
    decoder is killed after the READ of an n = 2 prompt, while its other child
    still waits. Before that it heartbeated the prompt for the waiting child,
    repeating the READ's mark. Nothing comes from it again, and the producer
    frees the prompt within a lease (the READ's hold ends with its notification),
    not after ``read_hold_limit``."""
    machine = ReleaseProtocol(make_producer, monkeypatch)
    if not machine.producer.has_heartbeats:
        pytest.skip("KV leases and heartbeats exist from v0.22")
    siblings = [f"{i}_{parent_id(0)}" for i in range(2)]
    prompt = machine.register(siblings, set())
    machine.admit(prompt)
    machine.decoder_step(MAX_STEP)
    machine._start_read(prompt, prompt.children[0])
    for rank in range(machine.ranks):
        machine._complete_read(prompt, prompt.children[0], rank)
    machine.decoder_step(MAX_STEP)
    killed_at = machine.clock.now
    machine.clock.now += LEASE + 1  # the producer steps on alone
    machine.poll()
    held = sorted(set(siblings) - machine.released.keys())
    assert not held, (
        f"{held} held {LEASE + 1} s after the decoder was killed at {killed_at:.0f}: "
        "the READ's hold outlived its notification"
    )
