# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Model-based test of the NIXL producer release path (vllm PR 43509).

Hypothesis interleaves what the scheduler and the decoders do to a producer
worker: requests scheduled, finished and aborted; pull-complete notifications
from 1, 2 or 4 decode workers, early (before registration), late (after
expiry) or repeated (after the pull completed); parallel-sampling siblings of
which a decode engine reads one, once per child (``n`` children, as a real
decoder does); heartbeats (from v0.22) and the clock passing expiry/lease
deadlines. A small reference model says what must be released at each
``get_finished``; afterwards the run is drained. Checked throughout: every
request is released exactly once, never while aborted or before its KV was
pulled (or it expired, or a sibling was pulled), a read sibling and its
siblings never before every decode child read it (when they all registered
before the first read), staged notifications stay within their limit, and
after the drain nothing is left in ``_reqs_to_send``, ``_reqs_to_process`` or
staging.
"""

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from . import nixl_harness

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


dist_world = nixl_harness.dist_world
make_producer = nixl_harness.make_producer


TTL = 40.0
PARENTS = {"cmpl-0000000a": 2, "cmpl-0000000b": 3}
# Not siblings: a client-chosen id, and a lone id of the sibling shape.
PLAIN = ["req-0", "req-1", "req-2", "1_job", "0_cmpl-deadbeef"]


def sibling_ids(parent: str) -> list[str]:
    return [f"{i}_{parent}" for i in range(PARENTS[parent])]


def parent_of(req_id: str) -> str | None:
    index, _, parent = req_id.partition("_")
    return parent if parent in PARENTS and index.isdecimal() else None


ALL = PLAIN + [s for parent in PARENTS for s in sibling_ids(parent)]
# What the worker remembers of releases by pull (EarlyPullNotifications).
REPEAT_REPORTS = 128
# Decoders pull the plain requests and one sibling (the last) of each parent.
EXPOSED = PLAIN + [sibling_ids(parent)[-1] for parent in PARENTS]


@dataclass
class Request:
    consumers: int = 1
    readers: int = 1  # decode requests reading it: n for the exposed sibling
    state: str = "new"  # new -> batch -> send | aborted | released
    expiry: float = 0.0
    counted: int = 0  # notifications counted since registration
    sent: int = 0  # notifications the decoders sent
    # Notifications held back for the other readers of a parallel-sampling sibling,
    # from the first counted; None before. ``all_readers``: every sibling was
    # registered by then.
    hold: int | None = None
    all_readers: bool = False

    @property
    def total(self) -> int:
        return self.readers * self.consumers


@dataclass
class Model:
    """What the patched producer must do (sibling release and early-notification
    staging), independent of its code."""

    limit: int
    lease_extension: float
    now: float
    reqs: dict[str, Request] = field(default_factory=dict)
    staged: OrderedDict = field(default_factory=OrderedDict)  # req -> count
    complete: set = field(default_factory=set)  # registered, fully pulled early
    # The last ``limit`` requests released (or aborted) other than by their own
    # pull: a notification for one is late.
    released_without_pull: OrderedDict = field(default_factory=OrderedDict)
    pulled_now: set = field(default_factory=set)  # released by their own pull
    # The requests released by their own pull, one set per report that released
    # any: the last REPEAT_REPORTS of them, at most ``limit`` requests.
    released_by_pull: deque = field(default_factory=deque)
    pulled_ever: set = field(default_factory=set)
    pulled_parents: set = field(default_factory=set)
    pending: set = field(default_factory=set)  # released by start_load_kv

    def remember_released_by_pull(self, req_ids: set) -> None:
        if not req_ids:
            return
        self.released_by_pull.append(set(req_ids))
        while (
            sum(map(len, self.released_by_pull)) > self.limit
            or len(self.released_by_pull) > REPEAT_REPORTS
        ):
            self.released_by_pull.popleft()

    def counts(self, req_id: str, notifications: int) -> int:
        """Of ``notifications`` for a held request, how many count toward its
        release: a sibling holds back ``consumers`` per other sibling registered
        when its first notification counted (each is a decode child reading it)."""
        req = self.reqs[req_id]
        if req.hold is None:
            parent = parent_of(req_id)
            others = (
                [s for s in sibling_ids(parent) if s != req_id and self.held(s)]
                if parent
                else []
            )
            req.hold = len(others) * req.consumers
            req.all_readers = len(others) + 1 == req.readers
            if others:
                event("reads of a sibling held back")
        holding = min(req.hold, notifications)
        req.hold -= holding
        return notifications - holding

    def remember_released_without_pull(self, req_ids) -> None:
        for req_id in sorted(req_ids):
            self.released_without_pull[req_id] = None
        while len(self.released_without_pull) > self.limit:
            self.released_without_pull.popitem(last=False)

    def held(self, req_id: str) -> bool:
        return self.reqs[req_id].state in ("batch", "send")

    def release(self, req_id: str, pulled: bool) -> set[str]:
        """Release ``req_id``; a pull also releases its finished siblings."""
        req = self.reqs[req_id]
        if pulled and req.all_readers:
            assert req.sent == req.total, f"{req_id} released while decoders read it"
        req.state = "released"
        released = {req_id}
        parent = parent_of(req_id)
        if not pulled or parent is None:
            return released
        others = [s for s in sibling_ids(parent) if s != req_id and self.held(s)]
        if others:
            event("siblings fanned out")
            self.pulled_parents.add(parent)
            for sibling in others:
                if self.reqs[sibling].state == "send":
                    self.reqs[sibling].state = "released"
                    released.add(sibling)
        return released

    def step(self, in_batch=(), to_send=(), aborted=()) -> None:
        """One start_load_kv, in the worker's order."""
        for req_id in in_batch:
            if self.reqs[req_id].state == "new":
                self.reqs[req_id].state = "batch"
        for req_id in aborted:
            if self.reqs[req_id].state in ("new", "batch"):
                self.reqs[req_id].state = "aborted"
        finished = []
        for req_id in to_send:
            req = self.reqs[req_id]
            if req.state == "batch":
                req.state = "send"
                req.expiry = self.now + TTL
                finished.append(req_id)
        # Early notifications move to the counters at registration...
        self.remember_released_without_pull(aborted)
        for req_id in aborted:
            self.staged.pop(req_id, None)
            self.complete.discard(req_id)
        for req_id in in_batch:
            early = self.staged.pop(req_id, None)
            req = self.reqs[req_id]
            if early is not None and self.held(req_id):
                counted = self.counts(req_id, early)
                req.counted += counted
                if counted >= req.consumers:
                    self.complete.add(req_id)
        # ... and complete ones are released when they register to send.
        for req_id in to_send:
            if req_id in self.complete:
                self.complete.discard(req_id)
                if req_id in finished:
                    event("early notifications settled at registration")
                    self.pulled_now.add(req_id)
                    self.pulled_ever.add(req_id)
                    self.pending |= self.release(req_id, pulled=True)
        for req_id in finished:
            parent = parent_of(req_id)
            if self.reqs[req_id].state == "send" and parent in self.pulled_parents:
                event("late sibling released at registration")
                self.pending |= self.release(req_id, pulled=False)

    def notify(self, req_id: str) -> set[str]:
        req = self.reqs[req_id]
        if req.state in ("batch", "send"):
            req.counted += self.counts(req_id, 1)
            if req.counted == req.consumers:
                self.pulled_now.add(req_id)
                self.pulled_ever.add(req_id)
                return self.release(req_id, pulled=True)
        elif req_id in self.pulled_now or any(
            req_id in report for report in self.released_by_pull
        ):
            event("repeated pull ignored")
        elif req_id not in self.released_without_pull:
            # Not held and not released without its pull (always true for a new
            # request; with a small limit also for one released so long ago).
            if req_id not in self.staged and len(self.staged) >= self.limit:
                event("staged notifications evicted")
                self.staged.popitem(last=False)
            self.staged[req_id] = self.staged.get(req_id, 0) + 1
        return set()

    def heartbeat(self, req_id: str) -> None:
        req = self.reqs[req_id]
        if req.state == "send":
            event("lease extended")
            req.expiry = max(req.expiry, self.now + self.lease_extension)


_schedule = st.tuples(st.just("schedule"), st.sampled_from(PLAIN + list(PARENTS)))
_finish = st.tuples(st.just("finish"), st.sampled_from(ALL))
_notify = st.tuples(st.just("notify"), st.sampled_from(EXPOSED), st.integers(1, 4))
# A pull that races the registration: only sent while the request is new.
_early = st.tuples(st.just("early"), st.sampled_from(EXPOSED), st.integers(1, 4))
# A decoder reading a request once more after its pull completed.
_repeat = st.tuples(st.just("repeat"), st.sampled_from(EXPOSED))
_heartbeat = st.tuples(
    st.just("heartbeat"), st.lists(st.sampled_from(ALL), min_size=1, unique=True)
)
# Weighted by repetition: scheduling and notifications drive the interesting
# interleavings (early notifications, siblings pulled while others run).
ops = st.one_of(
    _schedule,
    _schedule,
    _finish,
    _finish,
    _finish,
    _notify,
    _notify,
    _early,
    _early,
    _repeat,
    st.tuples(st.just("schedule_finish"), st.sampled_from(PLAIN)),
    st.tuples(st.just("abort"), st.sampled_from(ALL)),
    _heartbeat,
    _heartbeat,
    st.tuples(st.just("tick"), st.sampled_from([5.0, 30.0, 50.0])),
)


def run(producer, model: Model, program) -> None:
    released: set[str] = set()

    def poll(expected: set[str]) -> None:
        got = producer.finished_sending()
        assert not got & released, f"released twice: {got & released}"
        expected |= model.pending
        model.pending = set()
        expired = got - expected
        for req_id in expired:
            req = model.reqs[req_id]
            assert req.state == "send" and req.expiry <= model.now, (
                f"{req_id} released early: {req}"
            )
            req.state = "released"
            event("released at expiry")
        assert expected <= got, f"not released: {expected - got}"
        released.update(got)
        model.remember_released_by_pull(model.pulled_now)
        model.remember_released_without_pull(got - model.pulled_now)
        model.pulled_now = set()
        early = getattr(producer.worker, "_early_notifs", None)
        if early is not None:
            assert len(early.staged) <= model.limit
            staged = [(r, count) for r, (_, count) in early.staged.items()]
            assert staged == list(model.staged.items())
            assert early._staged_ids == set(early.staged), "the lookup set drifted"

    def send_notifications(req_id: str, times: int) -> None:
        req = model.reqs[req_id]
        times = min(times, req.total - req.sent)
        if times <= 0 or req.state == "aborted":
            return
        req.sent += times
        producer.notify(req_id, req.consumers, times=times)
        expected: set[str] = set()
        for _ in range(times):
            expected |= model.notify(req_id)
        poll(expected)

    for op in program:
        kind = op[0]
        # Scheduler operations apply to requests in a state that allows them:
        # a request id is scheduled, finished and aborted at most once.
        if kind == "schedule":
            ids = sibling_ids(op[1]) if op[1] in PARENTS else [op[1]]
            ids = [r for r in ids if model.reqs[r].state == "new"]
            producer.step(in_batch=ids, ttl=TTL)
            model.step(in_batch=ids)
        elif kind == "finish" and model.reqs[op[1]].state == "batch":
            producer.step(to_send=[op[1]], ttl=TTL)
            model.step(to_send=[op[1]])
        elif kind == "schedule_finish" and model.reqs[op[1]].state == "new":
            producer.step(in_batch=[op[1]], to_send=[op[1]], ttl=TTL)
            model.step(in_batch=[op[1]], to_send=[op[1]])
        elif kind == "abort" and model.reqs[op[1]].state in ("new", "batch"):
            producer.step(not_processed=[op[1]], ttl=TTL)
            model.step(aborted=[op[1]])
        elif kind == "notify" or (kind == "early" and model.reqs[op[1]].state == "new"):
            send_notifications(op[1], op[2])
        elif kind == "repeat" and op[1] in model.pulled_ever:
            producer.notify(op[1], model.reqs[op[1]].consumers)
            assert not model.notify(op[1])
            poll(set())
        elif kind == "heartbeat" and producer.has_heartbeats:
            producer.heartbeat(*op[1])
            for req_id in op[1]:
                model.heartbeat(req_id)
            poll(set())
        elif kind == "tick":
            producer.advance(op[1])
            model.now += op[1]
            poll(set())

    # Drain: everything left is scheduled, decoders pull what they pull, the
    # rest finishes, then every lease runs out.
    left = [r for r in ALL if model.reqs[r].state == "new"]
    producer.step(in_batch=left, ttl=TTL)
    model.step(in_batch=left)
    for req_id in EXPOSED:
        send_notifications(req_id, model.reqs[req_id].total)
    batch = [r for r in ALL if model.reqs[r].state == "batch"]
    producer.step(to_send=batch, ttl=TTL)
    model.step(to_send=batch)
    poll(set())
    producer.advance(10 * TTL)
    model.now += 10 * TTL
    poll(set())

    aborted = {r for r in ALL if model.reqs[r].state == "aborted"}
    assert released == set(ALL) - aborted
    assert producer.held() == set()
    early = getattr(producer.worker, "_early_notifs", None)
    if early is not None and model.limit >= len(ALL):
        assert not early.staged


@pytest.mark.parametrize("limit", [8192, 2])
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    consumers=st.fixed_dictionaries({r: st.sampled_from([1, 2, 4]) for r in EXPOSED}),
    program=st.lists(ops, max_size=40),
)
def test_release_model(make_producer, limit, consumers, program):
    producer = make_producer(early_notifications_limit=limit)
    lease_extension = producer.lease_extension if producer.has_heartbeats else 0.0
    model = Model(limit=limit, lease_extension=lease_extension, now=producer.clock.now)
    model.reqs = {r: Request(consumers=consumers.get(r, 1)) for r in ALL}
    for parent, n in PARENTS.items():
        # The decode engine splits the request into n children, each reading
        # the sibling the prefill response named.
        model.reqs[sibling_ids(parent)[-1]].readers = n
    run(producer, model, program)
