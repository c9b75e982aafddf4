"""Runtime activation on small fake upstream packages built here (no vLLM needed)."""

import ast
import asyncio
import dataclasses
import dis
import functools
import importlib
import inspect
import logging
import os
import subprocess
import sys
import textwrap
import tomllib
from collections import OrderedDict
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_patches._catalog import series as _series
from vllm_patches._catalog.series import Fix, Series
from vllm_patches._engine import install as _install
from vllm_patches._engine import runtime as _runtime
from vllm_patches._engine.runtime import ActivationError

PACKAGE = "fakevllm"
INSTALLED = _install.INSTALLED_ATTR
LANES = (Version("0.21.0"), Version("0.18.1"), Version("0.33.0"))

WORKER = '''\
import os


class Base:
    def hello(self):
        return "base"


class Worker(Base):
    """Upstream docstring."""

    LIMIT = 3

    def __init__(self):
        self.x = 1

    def step(self):
        return self.x

    @classmethod
    def make(cls):
        return cls()


def helper(a):
    return a
'''

USER = '''\
from fakevllm.core.worker import Worker, helper
'''

OVERLAY = '''\
from collections import OrderedDict

from vllm_patches._overlay import add, amend, call_at_end_of


@amend("F1", ">=0.18.0,<0.24.0")
class Worker:
    """Overlay docstring: not installed."""

    def step(self):
        return OrderedDict(x=self.x + self.LIMIT)

    @call_at_end_of("__init__")
    def _init_extra(self):
        self.extra = os.sep
        self.inits = getattr(self, "inits", 0) + 1

    def hello(self):
        return "patched " + super().hello()

    @classmethod
    def make(cls):
        made = cls()
        made.x = 10
        return made

    @property
    def doubled(self):
        return self.x * 2

    @staticmethod
    def tag():
        return helper("tag")


@amend("F1", ">=0.18.0,<0.20.0")
def helper(a):
    return ("old", a)


@amend("F1", ">=0.20.0,<0.24.0")
def helper(a):
    return ("new", a)


@add("F1", ">=0.18.0,<0.24.0")
def new_helper():
    return helper(1)
'''


def make_fix(fix_id: str, overlays: list[str], releases: str = ">=0.18.0",
             upstream_since: str | None = "0.24.0") -> Fix:
    return Fix(id=fix_id, slug=f"fake-{fix_id.lower()}", title="[Test] fake", what="w", why="w",
               how="h", bug="", pr="", releases_text=releases,
               upstream_since=Version(upstream_since) if upstream_since else None,
               future="f", overlays=tuple(overlays), tests=(), stock_fails=(), upstream_tests=(),
               deselect=())


class Fake:
    """A fake upstream package (``fakevllm``) and an overlay root, under tmp_path."""

    def __init__(self, tmp_path: Path):
        self.upstream = tmp_path / "upstream"
        self.overlays = tmp_path / "overlays"

    def module(self, dotted: str, source: str) -> None:
        path = self.upstream / PACKAGE / (dotted.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(self.upstream).parents:
            if parent.name:
                (self.upstream / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(source))

    def overlay(self, relative: str, source: str) -> None:
        path = self.overlays / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))

    def install(self, fixes: list[Fix], release: str = "0.21.0", ids=None):
        series = Series(tuple(fixes), LANES)
        ids = [f.id for f in fixes] if ids is None else ids
        return _runtime.install(series, Version(release), ids, root=self.overlays,
                                package=PACKAGE)

    def get(self, dotted: str):
        return importlib.import_module(f"{PACKAGE}.{dotted}")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "upstream"))
    yield Fake(tmp_path)
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    _install._source_tree.cache_clear()


@pytest.fixture
def worker(fake):
    fake.module("core.worker", WORKER)
    fake.module("user", USER)
    fake.overlay("core/worker.py", OVERLAY)
    return fake


def test_installs_members_calls_and_functions_with_upstream_globals(worker):
    user = worker.get("user")  # imports the function before the fix replaces it
    states = worker.install([make_fix("F1", ["core/worker.py"])])
    assert [(s.fix.id, s.state) for s in states] == [("F1", _runtime.ACTIVE)]
    module = worker.get("core.worker")
    made = module.Worker()
    assert made.step() == OrderedDict(x=4)
    assert made.extra == os.sep, "the overlay's code sees the upstream module's globals (os)"
    assert made.hello() == "patched base", "zero-argument super() resolves to the live class"
    assert module.Worker.make().x == 10 and made.doubled == 2
    assert module.Worker.tag() == ("new", "tag")
    assert module.new_helper() == ("new", 1)
    assert module.Worker.__doc__ == "Upstream docstring."
    assert module.Worker.step.__globals__ is module.__dict__
    assert module.Worker.step.__qualname__ == "Worker.step"
    assert module.OrderedDict is OrderedDict, "the import the splice would add"
    # A module that imported the amended function before sees the fix too.
    assert user.helper(2) == ("new", 2)
    assert user.Worker is module.Worker
    recorded = module.__vllm_patches_installed__["F1"]
    assert {i.label for i in recorded} >= {"fakevllm.core.worker.Worker.step",
                                           "fakevllm.core.worker.helper",
                                           "fakevllm.core.worker.new_helper",
                                           "fakevllm.core.worker.Worker.__init__ (calls _init_extra)"}
    assert {i.label for i in states[0].installed} == {i.label for i in recorded}


HOOKED = '''\
class Worker:
    def start(self, metadata, step=0):
        if step:
            return
        self.started = metadata

    def notifs(self):
        return {"a"}
'''

HOOKS_OVERLAY = '''\
from vllm_patches._overlay import amend, call_at_end_of, filter_result_of


@amend("F1", ">=0.18")
class Worker:
    @call_at_end_of("start")
    def _settle(self, metadata):
        self.settled = getattr(self, "settled", []) + [metadata]

    @filter_result_of("notifs")
    def _with_more(self, found):
        return found | {"b"}


@amend("F2", ">=0.18")
class Worker:
    def notifs(self):
        return self._with_more({"c"})
'''


def test_hooks_run_where_the_spliced_calls_would(fake):
    fake.module("core.worker", HOOKED)
    fake.overlay("core/worker.py", HOOKS_OVERLAY)
    fake.install([make_fix("F1", ["core/worker.py"])])
    worker = fake.get("core.worker").Worker()
    worker.start("m1")
    worker.start(metadata="m2", step=1)  # the early return calls it too
    assert worker.settled == ["m1", "m2"]
    assert worker.notifs() == {"a", "b"}


def test_a_later_fix_that_replaces_a_hooked_method_keeps_the_hook(fake):
    fake.module("core.worker", HOOKED)
    fake.overlay("core/worker.py", HOOKS_OVERLAY)
    states = fake.install([make_fix("F1", ["core/worker.py"]), make_fix("F2", ["core/worker.py"])])
    assert [s.state for s in states] == [_runtime.ACTIVE, _runtime.ACTIVE]
    assert fake.get("core.worker").Worker().notifs() == {"b", "c"}


ANSWERING = '''\
class Scheduler:
    def answer(self, request, computed=0):
        if request:
            return len(request) - computed, True
        return 0, False
'''

ANSWERING_OVERLAY = '''\
from vllm_patches._overlay import amend, filter_result_of


@amend("F1", ">=0.18")
class Scheduler:
    @filter_result_of("answer")
    def _checked(self, answer, request, computed):
        self.seen = (answer, request, computed)
        return answer if request != "lapsed" else (0, False)
'''


def test_a_result_filter_receives_the_arguments_its_parameters_name(fake):
    fake.module("core.scheduler", ANSWERING)
    fake.overlay("core/scheduler.py", ANSWERING_OVERLAY)
    fake.install([make_fix("F1", ["core/scheduler.py"])])
    scheduler = fake.get("core.scheduler").Scheduler()
    assert scheduler.answer("abc", computed=1) == (2, True)
    assert scheduler.seen == ((2, True), "abc", 1)
    assert scheduler.answer("lapsed") == (0, False)
    assert scheduler.seen == ((6, True), "lapsed", 0), "defaults are passed too"
    assert scheduler.answer(computed=2, request="abcd") == (2, True)
    assert scheduler.seen == ((2, True), "abcd", 2), "keywords in any order"


SERVING = '''\
class Serving:
    async def create(self, request):
        if not request:
            return "error"
        self.created = request
        return "response"
'''

SERVING_OVERLAY = '''\
from vllm_patches._overlay import amend, call_at_end_of, filter_result_of


@amend("F1", ">=0.18")
class Serving:
    @filter_result_of("create")
    def _noted(self, result, request):
        self.noted = (result, request)
        return result.upper()

    @call_at_end_of("create")
    def _ended(self, request):
        self.ended = request
'''


def test_hooks_of_a_coroutine_method_see_its_awaited_result(fake):
    """As the spliced ``return self.<hook>(value)`` inside ``async def`` does: the hook
    runs when the coroutine returns, on its value, and the method stays a coroutine
    function."""
    fake.module("core.serving", SERVING)
    fake.overlay("core/serving.py", SERVING_OVERLAY)
    fake.install([make_fix("F1", ["core/serving.py"])])
    serving = fake.get("core.serving").Serving()
    assert inspect.iscoroutinefunction(serving.create)
    assert asyncio.run(serving.create("")) == "ERROR"
    assert serving.noted == ("error", "")
    assert asyncio.run(serving.create(request="r")) == "RESPONSE"
    assert (serving.noted, serving.ended, serving.created) == (("response", "r"), "r", "r")


POLLING = '''\
class Worker:
    def __init__(self):
        self.agent = Agent()

    def notifs(self, extra=()):
        found = set(extra)
        for messages in self.agent.poll().values():
            found |= set(messages)
        return found


class Agent:
    def poll(self):
        return {"decode": ["a", "b"]}
'''

POLLING_OVERLAY = '''\
from vllm_patches._overlay import amend, filter_call_in, filter_result_of


@amend("F1", ">=0.18")
class Worker:
    @filter_call_in("notifs", "self.agent.poll")
    def _drop_b(self, notifs):
        return {agent: [m for m in messages if m != "b"] for agent, messages in notifs.items()}

    @filter_result_of("notifs")
    def _with_z(self, found):
        return found | {"z"}
'''


def test_a_call_filter_recompiles_the_upstream_method_where_it_is(fake):
    fake.module("core.worker", POLLING)
    fake.overlay("core/worker.py", POLLING_OVERLAY)
    fake.install([make_fix("F1", ["core/worker.py"])])
    module = fake.get("core.worker")
    assert module.Worker().notifs(extra=["x"]) == {"a", "x", "z"}
    code = inspect.unwrap(module.Worker.notifs).__code__
    assert code.co_filename == module.__file__, "tracebacks point at upstream's file"
    assert code.co_firstlineno == POLLING.splitlines().index("    def notifs(self, extra=()):") + 1
    assert "notifs" not in vars(module), "recompiled into the class, not the module"


CALL_FILTER_OF_A_SECOND_FIX = '''


@amend("F2", ">=0.18")
class Worker:
    @filter_call_in("notifs", "self.agent.poll")
    def _drop_a(self, notifs):
        self.seen = notifs
        return {agent: [m for m in messages if m != "a"] for agent, messages in notifs.items()}
'''


def test_call_filters_of_two_fixes_compose_in_one_recompile(fake):
    fake.module("core.worker", POLLING)
    fake.overlay("core/worker.py", POLLING_OVERLAY + CALL_FILTER_OF_A_SECOND_FIX)
    states = fake.install([make_fix("F1", ["core/worker.py"]), make_fix("F2", ["core/worker.py"])])
    assert [s.state for s in states] == [_runtime.ACTIVE, _runtime.ACTIVE]
    module = fake.get("core.worker")
    worker = module.Worker()
    assert worker.notifs(extra=["x"]) == {"x", "z"}, "both filters and F1's result filter"
    assert worker.seen == {"decode": ["a"]}, "F2's filter sees what F1's returned"
    recompiled = inspect.unwrap(module.Worker.notifs)
    assert {"_drop_b", "_drop_a"} <= set(recompiled.__code__.co_names)
    assert module.Worker.notifs.__wrapped__ is recompiled, "one recompile, under F1's wrapper"


RESULT_FILTER_THEN_CALL_FILTER = '''\
from vllm_patches._overlay import amend, filter_call_in, filter_result_of


@amend("F1", ">=0.18")
class Worker:
    @filter_result_of("notifs")
    def _with_z(self, found):
        return found | {"z"}


@amend("F2", ">=0.18")
class Worker:
    @filter_call_in("notifs", "self.agent.poll")
    def _drop_b(self, notifs):
        return {agent: [m for m in messages if m != "b"] for agent, messages in notifs.items()}
'''


def test_a_later_fix_filters_calls_in_a_method_an_earlier_fix_wrapped(fake):
    """The recompile goes in under the earlier fix's wrapper (the lease expiry of
    NIXL's get_finished: an early fix filters its result, a later one its clock)."""
    fake.module("core.worker", POLLING)
    fake.overlay("core/worker.py", RESULT_FILTER_THEN_CALL_FILTER)
    states = fake.install([make_fix("F1", ["core/worker.py"]), make_fix("F2", ["core/worker.py"])])
    assert [s.state for s in states] == [_runtime.ACTIVE, _runtime.ACTIVE]
    module = fake.get("core.worker")
    assert module.Worker().notifs(extra=["x"]) == {"a", "x", "z"}
    assert "_drop_b" in module.Worker.notifs.__wrapped__.__code__.co_names


def test_call_rewrites_of_one_method_are_all_installed(fake):
    """A redirect and a filter in one method: one recompile holds both."""
    fake.module("core.worker", POLLING)
    fake.overlay("core/worker.py", POLLING_OVERLAY.replace(
        "from vllm_patches._overlay import amend, filter_call_in, filter_result_of",
        "from vllm_patches._overlay import amend, filter_call_in, filter_result_of, "
        "redirect_call_in") + '''
    @redirect_call_in("notifs", "set")
    def _as_sorted_set(self, extra):
        return set(sorted(extra)) | {"r"}
''')
    fake.install([make_fix("F1", ["core/worker.py"])])
    assert fake.get("core.worker").Worker().notifs(extra=["x"]) == {"a", "x", "z", "r"}


SUBCLASSED = POLLING + '''

class PushWorker(Worker):
    def notifs(self, extra=()):
        found = super().notifs(extra)
        return found | {m + "!" for m in self.agent.poll()["decode"]}
'''


def test_a_call_filter_recompiles_a_method_that_calls_super(fake):
    """Zero-argument super() reads the method's __class__ cell: the recompiled method
    gets the original's (push_worker.py's get_finished)."""
    fake.module("core.worker", SUBCLASSED)
    fake.overlay("core/worker.py", '''\
from vllm_patches._overlay import amend, filter_call_in


@amend("F1", ">=0.18")
class PushWorker:
    @filter_call_in("notifs", "self.agent.poll")
    def _drop_b(self, notifs):
        return {agent: [m for m in messages if m != "b"] for agent, messages in notifs.items()}
''')
    fake.install([make_fix("F1", ["core/worker.py"])])
    module = fake.get("core.worker")
    assert module.PushWorker().notifs(extra=["x"]) == {"a", "b", "x", "a!"}, \
        "super()'s call unfiltered, the subclass's own filtered"
    assert module.Worker().notifs() == {"a", "b"}
    code = inspect.unwrap(module.PushWorker.notifs).__code__
    assert "_drop_b" in code.co_names and code.co_filename == module.__file__


GUARDED = '''\
class Worker:
    def __init__(self):
        self.held = {"a"}
        self.errors = []

    def notifs(self, messages):
        found = set()
        for message in messages:
            if message not in self.held:
                self.errors.append(message)
                self.errors.append("logged")
                continue
            found.add(message)
        return found
'''


def test_a_branch_guard_recompiles_the_method_and_asks_the_hook_with_its_variables(fake):
    fake.module("core.worker", GUARDED)
    fake.overlay("core/worker.py", '''\
from vllm_patches._overlay import amend, guard_branch_in


@amend("F1", ">=0.18")
class Worker:
    @guard_branch_in("notifs", "self.errors.append")
    def _unless_early(self, message, found):
        """Takes the messages that name an early request."""
        return not message.startswith("early") or bool(found)
''')
    fake.install([make_fix("F1", ["core/worker.py"])])
    worker = fake.get("core.worker").Worker()
    recompiled = fake.get("core.worker").Worker.notifs
    assert [i.argval for i in dis.get_instructions(recompiled)].count("_unless_early") == 1, \
        "one guard, however often the branch calls"
    assert worker.notifs(["early-b", "x", "a", "early-c"]) == {"a"}
    assert worker.errors == ["x", "logged", "early-c", "logged"], \
        "taken before the branch ran; the hook saw the loop's own variables"


def test_a_call_filter_without_the_call_is_an_error(fake):
    fake.module("core.worker", POLLING)
    fake.overlay("core/worker.py", POLLING_OVERLAY.replace('"self.agent.poll"', '"self.agent.peek"'))
    with pytest.raises(ActivationError, match="notifs makes no call of self.agent.peek"):
        fake.install([make_fix("F1", ["core/worker.py"])])
    assert "_drop_b" not in vars(fake.get("core.worker").Worker), "nothing installed"


def test_a_hook_naming_no_parameter_of_its_target_is_an_error(fake):
    fake.module("core.worker", HOOKED)
    fake.overlay("core/worker.py", HOOKS_OVERLAY.replace("_settle(self, metadata)",
                                                         "_settle(self, request)"))
    with pytest.raises(ActivationError, match="Worker.start has no parameter request for _settle"):
        fake.install([make_fix("F1", ["core/worker.py"])])


def test_a_definition_added_into_another_overlay_file_is_installed_there(fake):
    fake.module("core.worker", WORKER)
    fake.module("core.other", "X = 1\n")
    fake.overlay("core/other.py", '''\
        from collections import OrderedDict

        from vllm_patches._overlay import add


        @add("F1", ">=0.20", into="worker.py")
        def shared():
            return OrderedDict(x=X)
        ''')
    fake.overlay("core/worker.py", "from vllm_patches._overlay import add\n")
    fake.install([make_fix("F1", ["core/other.py", "core/worker.py"])])
    worker = fake.get("core.worker")
    worker.X = 2
    assert worker.shared() == OrderedDict(x=2), "runs in the module it was added into"
    assert worker.shared.__code__.co_filename == str(fake.overlays / "core/other.py")
    assert not hasattr(fake.get("core.other"), "shared")


def test_a_partial_class_of_another_name_amends_the_named_class(fake):
    fake.module("core.worker", WORKER)
    fake.overlay("core/base.py", '''\
        from vllm_patches._overlay import amend


        @amend("F1", ">=0.20", into="worker.py", name="Worker")
        class BaseWorker:
            def step(self):
                return self.x * 100
        ''')
    fake.overlay("core/worker.py", "from vllm_patches._overlay import amend\n")
    fake.install([make_fix("F1", ["core/base.py", "core/worker.py"])])
    worker = fake.get("core.worker")
    assert worker.Worker().step() == 100
    assert not hasattr(worker, "BaseWorker"), "the partial class binds no name of its own"


def test_tracebacks_point_at_the_overlay(worker):
    worker.install([make_fix("F1", ["core/worker.py"])])
    code = worker.get("core.worker").Worker.step.__code__
    assert code.co_filename == str(worker.overlays / "core/worker.py")
    assert code.co_firstlineno == OVERLAY.splitlines().index("    def step(self):") + 1


def test_installing_twice_is_a_no_op(worker):
    fixes = [make_fix("F1", ["core/worker.py"])]
    worker.install(fixes)
    module = worker.get("core.worker")
    before = dict(module.Worker.__dict__), module.helper
    worker.install(fixes)
    assert dict(module.Worker.__dict__) == before[0] and module.helper is before[1]
    assert module.Worker().inits == 1, "__init__ is wrapped once"


def test_variants_are_chosen_by_release(worker):
    worker.install([make_fix("F1", ["core/worker.py"])], release="0.19.0")
    assert worker.get("core.worker").helper(1) == ("old", 1)


def test_upstream_and_not_applicable_install_nothing(worker):
    fixes = [make_fix("F1", ["core/worker.py"]),
             make_fix("F2", ["core/worker.py"], releases=">=0.30.0", upstream_since=None)]
    states = worker.install(fixes, release="0.24.0")
    assert [(s.fix.id, s.state, s.detail) for s in states] == [
        ("F1", _runtime.UPSTREAM, "since v0.24.0"),
        ("F2", _runtime.NOT_APPLICABLE, "needed on vLLM >=0.30.0, not on v0.24.0")]
    assert f"{PACKAGE}.core.worker" not in sys.modules


@pytest.mark.parametrize("overlay, message", [
    ('@amend("F1", ">=0.18")\nclass Missing:\n    pass\n', "@amend Missing, but the module has no such"),
    ('@amend("F1", ">=0.18")\ndef gone(a):\n    pass\n', "@amend gone, but the module has no such"),
    ('@add("F1", ">=0.18")\ndef helper(a):\n    pass\n', "@add helper, but the module already defines"),
    ('@amend("F1", ">=0.18")\nclass helper:\n    pass\n', "helper is function, not a class"),
    (('@amend("F1", ">=0.18")\nclass Base:\n    @call_at_end_of("__init__")\n    def _x(self):\n'
      '        pass\n'), "Base has no __init__ to call _x from"),
])
def test_a_missing_target_is_an_error_before_any_change(fake, overlay, message):
    fake.module("core.worker", WORKER)
    fake.overlay("core/worker.py", 'from vllm_patches._overlay import add, amend, call_at_end_of\n'
                 '\n\n@amend("F1", ">=0.18")\nclass Worker:\n    def step(self):\n        return 0\n'
                 '\n\n' + overlay)
    with pytest.raises(ActivationError, match=message):
        fake.install([make_fix("F1", ["core/worker.py"])])
    assert fake.get("core.worker").Worker().step() == 1, "validated before changing anything"


def test_a_missing_module_is_an_error(fake):
    fake.module("core.worker", WORKER)
    fake.overlay("core/gone.py", '@amend("F1", ">=0.18")\ndef f():\n    pass\n')
    with pytest.raises(ActivationError, match="cannot import the target module fakevllm.core.gone"):
        fake.install([make_fix("F1", ["core/gone.py"])])


def test_a_needed_fix_without_a_variant_is_an_error(worker):
    fixes = [make_fix("F1", ["core/worker.py"], releases=">=0.18.0,<0.30.0",
                      upstream_since="0.30.0")]
    with pytest.raises(ActivationError, match="no overlay variant holds that release"):
        worker.install(fixes, release="0.25.0")


def test_a_failed_postcondition_is_loud(fake):
    fake.module("core.worker", '''\
        class Sticky(type):
            def __setattr__(cls, name, value):
                pass  # swallows every assignment


        class Worker(metaclass=Sticky):
            def step(self):
                return 1
        ''')
    fake.overlay("core/worker.py", '''\
        from vllm_patches._overlay import amend


        @amend("F1", ">=0.18")
        class Worker:
            def step(self):
                return 2
        ''')
    with pytest.raises(ActivationError, match="postconditions failed.*Worker.step is not the "
                                              "installed definition"):
        fake.install([make_fix("F1", ["core/worker.py"])])


META = '''\
from dataclasses import dataclass, field


@dataclass{params}
class Meta:
    """Upstream meta."""

    events: dict[str, int] = field(default_factory=dict)
    count: int = 0

    def aggregate(self, other):
        return Meta(events={{**self.events, **other.events}})
'''

META_OVERLAY = '''\
from vllm_patches._overlay import amend


@amend("F1", ">=0.18")
class Meta:
    ready: frozenset[int] = frozenset()

    def aggregate(self, other):
        return Meta(events={**self.events, **other.events}, ready=self.ready | other.ready)
'''


@pytest.mark.parametrize("params", ["", "(frozen=True)", "(order=True)"])
def test_a_dataclass_gets_new_fields_in_place(fake, params):
    fake.module("meta", META.format(params=params))
    fake.module("consumer", "from fakevllm.meta import Meta\n")
    fake.overlay("meta.py", META_OVERLAY)
    module, consumer = fake.get("meta"), fake.get("consumer")
    cls = module.Meta
    old = cls(events={"a": 1})
    fake.install([make_fix("F1", ["meta.py"])])
    assert module.Meta is cls and consumer.Meta is cls
    assert [f.name for f in dataclasses.fields(cls)] == ["events", "count", "ready"]
    first, second = cls(), cls()
    assert first.events == {} and first.events is not second.events, "default_factory kept"
    merged = cls(events={"a": 1}, ready=frozenset({0})).aggregate(cls(ready=frozenset({1})))
    assert merged.ready == {0, 1} and merged.events == {"a": 1}
    assert "ready=frozenset()" in repr(first) and first == second
    assert cls.__doc__ == "Upstream meta."
    assert isinstance(old, cls) and old.ready == frozenset(), "old instances see the default"
    if "frozen" in params:
        with pytest.raises(dataclasses.FrozenInstanceError):
            first.ready = frozenset({2})
    if "order" in params:
        assert cls(count=1) < cls(count=2)


def test_a_slots_dataclass_is_refused(fake):
    fake.module("meta", META.format(params="(slots=True)"))
    fake.overlay("meta.py", META_OVERLAY)
    with pytest.raises(ActivationError, match="slots dataclass"):
        fake.install([make_fix("F1", ["meta.py"])])


def test_future_annotations_follow_the_upstream_module(fake):
    fake.module("core.worker", "from __future__ import annotations\n\n\n" + WORKER)
    fake.overlay("core/worker.py", '''\
        from vllm_patches._overlay import amend


        @amend("F1", ">=0.18")
        def helper(a: Undefined) -> int:
            return a
        ''')
    fake.install([make_fix("F1", ["core/worker.py"])])
    assert fake.get("core.worker").helper.__annotations__ == {"a": "Undefined", "return": "int"}


def test_an_overlay_importing_an_added_name_goes_after_the_overlay_that_adds_it(fake):
    fake.module("meta", "def existing():\n    return 1\n")
    fake.module("manager", "class Manager:\n    def ready(self):\n        return False\n")
    fake.overlay("manager.py", '''\
        from fakevllm.meta import is_ready

        from vllm_patches._overlay import amend


        @amend("F1", ">=0.18")
        class Manager:
            def ready(self):
                return is_ready()
        ''')
    fake.overlay("meta.py", '''\
        from vllm_patches._overlay import add


        @add("F1", ">=0.18")
        def is_ready():
            return True
        ''')
    fake.install([make_fix("F1", ["manager.py", "meta.py"])])
    assert fake.get("manager").Manager().ready() is True


def test_a_later_fix_replaces_an_earlier_ones_member(fake):
    fake.module("core.worker", WORKER)
    fake.overlay("core/worker.py", '''\
        from vllm_patches._overlay import amend


        @amend("F3", ">=0.18")
        def helper(a):
            return "f2 and f3"


        @amend("F2", ">=0.18")
        def helper(a):
            return "f2"
        ''')
    fixes = [make_fix(i, ["core/worker.py"], ">=0.18", None) for i in ("F2", "F3")]
    fake.install(fixes)
    assert fake.get("core.worker").helper(0) == "f2 and f3"


def test_a_source_tree_that_carries_the_fix_is_left_alone(fake):
    patched = WORKER.replace('''    def step(self):
        return self.x
''', '''    def step(self):
        return self.x + 1

    def _init_extra(self):
        self.inits = getattr(self, "inits", 0) + 1
''').replace("        self.x = 1\n", "        self.x = 1\n        self._init_extra()\n")
    fake.module("core.worker", patched)
    fake.overlay("core/worker.py", '''\
        from vllm_patches._overlay import amend, call_at_end_of


        @amend("F1", ">=0.18")
        class Worker:
            def step(self):
                return self.x + 1

            @call_at_end_of("__init__")
            def _init_extra(self):
                self.inits = getattr(self, "inits", 0) + 1
        ''')
    states = fake.install([make_fix("F1", ["core/worker.py"])])
    assert (states[0].state, states[0].detail) == (_runtime.IN_SOURCE, "patched tree")
    module = fake.get("core.worker")
    assert module.Worker().inits == 1 and not hasattr(module, "__vllm_patches_installed__")



PATCHED_BY_A_SERIES = WORKER.replace('    """Upstream docstring."""\n', '    """Fixed docstring."""\n') \
    .replace("    def step(self):\n        return self.x\n",
             "    def step(self):\n        return self.x + 2\n") + "\n\nclass Added:\n    pass\n"

SERIES_OVERLAY = '''\
from vllm_patches._overlay import add, amend


@amend("F1", ">=0.18")
class Worker:
    __doc__ = """Fixed docstring."""


@amend("F2", ">=0.18")
class Worker:
    def step(self):
        return self.x + 1


@add("F2", ">=0.18")
class Added:
    pass


@amend("F3", ">=0.18")
class Worker:
    def step(self):
        return self.x + 2
'''


def test_a_tree_patched_by_a_series_whose_later_fix_replaces_a_member_is_left_alone(fake):
    """A checkout `apply` patched, installed with the Python-only build,
    holds F3's version of a method F2 adds and F4's `__doc__` as the class docstring; the
    plugin took F2 for not in the tree and refused (`@add ... but the module already
    defines it`), so vLLM did not start on the fixed tree."""
    fake.module("core.worker", PATCHED_BY_A_SERIES)
    fake.overlay("core/worker.py", SERIES_OVERLAY)
    states = fake.install([make_fix(i, ["core/worker.py"]) for i in ("F1", "F2", "F3")])
    assert [s.state for s in states] == [_runtime.IN_SOURCE] * 3
    module = fake.get("core.worker")
    assert module.Worker().step() == 3 and not hasattr(module, "__vllm_patches_installed__")

# ---------------------------------------------------------------- choosing and refusing

SERIES = _series.load()


def test_selection_by_environment():
    every = [f.id for f in SERIES.fixes]
    assert _runtime.selected_ids(SERIES, {}) == every
    assert _runtime.selected_ids(SERIES, {"VLLM_PATCHES_FIXES": "all"}) == every
    assert _runtime.selected_ids(SERIES, {"VLLM_PATCHES_FIXES": f" {every[0]} "}) == every[:1]
    with pytest.raises(ActivationError, match="names unknown fix.*F99"):
        _runtime.selected_ids(SERIES, {"VLLM_PATCHES_FIXES": "F99"})
    with pytest.raises(ActivationError, match="VLLM_PATCHES_DISABLE='maybe': expected 1 or 0"):
        _runtime.env_flag({"VLLM_PATCHES_DISABLE": "maybe"}, "VLLM_PATCHES_DISABLE")


def test_a_fix_chosen_without_one_it_requires_activates_nothing():
    """F3's hooks build on F2's (F3.toml requires): VLLM_PATCHES_FIXES=F3 alone would run
    half a fix, so it is refused as a bad value (no fix active, the ERROR line says why),
    as `apply --fix F3` is refused on a checkout."""
    def check(fixes: str, release: str) -> None:
        environ = {"VLLM_PATCHES_FIXES": fixes}
        ids = _runtime.selected_ids(SERIES, environ)
        _runtime.require_requirements(SERIES, Version(release), ids, environ)

    with pytest.raises(ActivationError, match="VLLM_PATCHES_FIXES='F3,F4': F3 requires F2"):
        check("F3,F4", "0.21.0")
    check("F2,F3", "0.21.0")
    # F20 requires F4 only where F4 hooks the same methods (F20.toml, requires_from).
    check("F20", "0.18.1")
    with pytest.raises(ActivationError, match="F20 requires F4"):
        check("F20", "0.21.0")


def test_supported_range_is_oldest_lane_series_to_newest_lane():
    supported = SERIES.supported
    lanes = sorted(SERIES.lanes)
    assert Version(f"{lanes[0].major}.{lanes[0].minor}.0") in supported
    assert all(lane in supported for lane in lanes)
    assert Version(f"{lanes[-1].major}.{lanes[-1].minor + 1}.0") not in supported


def test_releases_that_cannot_be_verified_are_refused_unless_overridden():
    ids = SERIES.ids
    with pytest.raises(ActivationError, match=r"v0\.17\.0 is not a covered release \(covered: "
                                              r"v0\.18\.0 \.\. v.*nor a later release of a covered "
                                              r"minor series.*VLLM_PATCHES_ALLOW_UNSUPPORTED=1"):
        _runtime.release_basis("0.17.0", SERIES, ids, allow_unsupported=False)
    newest = SERIES.covered[-1]
    with pytest.raises(ActivationError, match="not a covered release"):
        _runtime.release_basis(f"{newest.major}.{newest.minor + 1}.0", SERIES, ids, False)
    with pytest.raises(ActivationError, match="development build"):
        _runtime.release_basis("0.21.1.dev3+g123", SERIES, ids, allow_unsupported=False)
    old = _runtime.release_basis("0.17.0", SERIES, ids, allow_unsupported=True)
    assert (old.release, old.how) == (Version("0.17.0"), _runtime.AT_OWN_RISK)
    dev = _runtime.release_basis("0.21.1.dev3", SERIES, ids, allow_unsupported=True)
    assert (dev.release, dev.how) == (Version("0.21.1"), _runtime.AT_OWN_RISK)
    assert _runtime.release_basis("0.21.0+cpu", SERIES, ids, allow_unsupported=False) == \
        _runtime.Basis("0.21.0", Version("0.21.0"), _runtime.COVERED)


@pytest.fixture
def fresh_process(monkeypatch):
    """activate() as in a new process, with a fake installer and vLLM version."""
    monkeypatch.setattr(_runtime, "_CURRENT", None)
    calls = []

    def fake_install(series, release, ids, **where):
        calls.append((release, ids))
        return _runtime.fix_states(series, release, ids)

    monkeypatch.setattr(_runtime, "install", fake_install)
    monkeypatch.setattr(_runtime, "installed_version_text", lambda: "0.21.0+cpu")
    return calls


def test_activate_reads_the_environment_once_per_process(fresh_process):
    first = _runtime.activate({"VLLM_PATCHES_FIXES": "F1"})
    assert fresh_process == [(Version("0.21.0"), ["F1"])]
    assert _runtime.activate({}) is first and len(fresh_process) == 1
    assert _runtime.current() is first


def test_disabled_activates_nothing(fresh_process):
    activation = _runtime.activate({"VLLM_PATCHES_DISABLE": "1", "VLLM_PATCHES_FIXES": "F99"})
    assert activation.disabled and fresh_process == []
    assert activation.line() == "vllm-patches: disabled by VLLM_PATCHES_DISABLE; no fix is active"


def test_override_activates_an_unsupported_release(fresh_process, monkeypatch):
    monkeypatch.setattr(_runtime, "installed_version_text", lambda: "0.17.0")
    with pytest.raises(ActivationError, match="not a covered release"):
        _runtime.activate({"VLLM_PATCHES_STRICT": "1"})
    activation = _runtime.activate({"VLLM_PATCHES_ALLOW_UNSUPPORTED": "1"})
    assert fresh_process == [(Version("0.17.0"), [f.id for f in SERIES.fixes])]
    assert activation.line().startswith(
        "vllm-patches on vLLM v0.17.0 (NOT verified: vLLM v0.17.0 is not a covered release")
    assert "activated by VLLM_PATCHES_ALLOW_UNSUPPORTED=1 at your own risk): active: " in \
        activation.line()


def test_register_logs_one_line_once(fresh_process, caplog):
    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    _runtime.register()
    _runtime.register()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.vllm_patches"]
    assert len(lines) == 1
    assert lines[0].startswith("vllm-patches on vLLM v0.21.0: active: F1")
    assert "; upstream: " in lines[0]
    assert "not applicable: " in lines[0]


def test_the_line_names_what_is_upstream_and_what_does_not_apply():
    f1 = make_fix("F1", [])
    f4 = make_fix("F4", [], releases=">=0.19.0", upstream_since=None)
    states = _runtime.fix_states(Series((f1, f4), LANES), Version("0.33.0"), ["F1", "F4"])
    assert _runtime.Activation(Version("0.33.0"), states).line() == (
        "vllm-patches on vLLM v0.33.0: active: F4; upstream: F1 (since v0.24.0); "
        "not applicable: none")
    states = _runtime.fix_states(Series((f1, f4), LANES), Version("0.18.1"), ["F4"])
    assert _runtime.Activation(Version("0.18.1"), states).line() == (
        "vllm-patches on vLLM v0.18.1: active: none; upstream: none; not applicable: F4 (needed "
        "on vLLM >=0.19.0, not on v0.18.1); not selected (VLLM_PATCHES_FIXES): F1")


def test_the_entry_point_is_declared():
    pyproject = tomllib.loads((_series.REPO_DIR / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"][_runtime.ENTRY_POINT_GROUP]
    assert plugins == {_runtime.ENTRY_POINT_NAME: "vllm_patches._engine.runtime:register"}


def test_the_plugin_module_imports_without_libcst():
    """vLLM logs and skips a plugin whose module fails to import: keep that import small."""
    code = ("import sys, vllm_patches._engine.runtime\n"
            "print(sorted(m for m in sys.modules if 'libcst' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(_series.REPO_DIR)}).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("release", sorted({Version(f"0.{m}.0") for m in range(18, 34)}
                                           | set(SERIES.lanes)), ids=str)
def test_the_real_overlays_compile_for_every_supported_release(release):
    """What activation would execute on ``release``: selected, compiled, not run."""
    fixes = [s.fix for s in _runtime.fix_states(SERIES, release, [f.id for f in SERIES.fixes])
             if s.state == _runtime.ACTIVE]
    for item in _install._plans(fixes, release, _series.PACKAGE_DIR, "vllm"):
        for definition in item.definitions:
            compile(ast.Module(body=[definition.node], type_ignores=[]),
                    str(item.path), "exec", dont_inherit=True)


def test_an_amended_class_with_only_a_docstring_keeps_upstreams(fake):
    fake.module("core.worker", WORKER)
    fake.overlay("core/worker.py", '''\
        from vllm_patches._overlay import amend


        @amend("F1", ">=0.18")
        class Worker:
            """Only a docstring."""
        ''')
    fake.install([make_fix("F1", ["core/worker.py"])])
    assert fake.get("core.worker").Worker.__doc__ == "Upstream docstring."


# ------------------------------------------- the release policy: a vLLM that says v0.33.1

POLICY_OVERLAY = '''\
from vllm_patches._overlay import add, amend, call_at_end_of


@amend("F2", ">=0.18.0,<0.34.0")
class Worker:
    @call_at_end_of("start")
    def _settle(self, metadata):
        self.settled = getattr(self, "settled", []) + [metadata]


@add("F2", ">=0.18.0,<0.34.0")
def settled_count(worker):
    return len(worker.settled)
'''

# Not a target of F2: a patch release may change it.
UNRELATED = '''

def unrelated():
    return "added in the patch release"
'''


@pytest.fixture
def on_v0_33_1(fake, tmp_path, monkeypatch):
    """A vLLM whose version says 0.33.1 (``fakevllm``), a series covering v0.33.0, and the
    fingerprints of v0.33.0's tree as regen writes them; ``install(source)`` puts the
    installed module in place. ``register()`` runs as in a vLLM process."""
    from vllm_patches._catalog import patchset as _patchset
    from vllm_patches._engine import fingerprint as _fingerprint

    fix = make_fix("F2", ["core/worker.py"], releases=">=0.18.0,<0.34.0", upstream_since=None)
    series = Series((fix,), LANES, covered=(Version("0.33.0"),))
    fake.overlay("core/worker.py", POLICY_OVERLAY)
    tree = tmp_path / "v0.33.0"  # the release's tree: upstream paths under the package
    (tree / "core").mkdir(parents=True)
    (tree / "core" / "worker.py").write_text(HOOKED)
    found = _fingerprint.compute(series, Version("0.33.0"), fake.overlays,
                                 lambda overlay: (tree / overlay).read_text())
    patches = tmp_path / "patches"
    (patches / "v0.33.0").mkdir(parents=True)
    (patches / "v0.33.0" / _fingerprint.FILE).write_text(
        _fingerprint.render(Version("0.33.0"), found))
    monkeypatch.setattr(_patchset, "patches_dir", lambda: patches)
    monkeypatch.setattr(_series, "load", lambda: series)
    monkeypatch.setattr(_runtime, "installed_version_text", lambda: "0.33.1")
    monkeypatch.setattr(_runtime, "_CURRENT", None)
    monkeypatch.setattr(_runtime, "activate", functools.partial(
        _runtime.activate, root=fake.overlays, package=PACKAGE))
    for name in ("VLLM_PATCHES_DISABLE", "VLLM_PATCHES_FIXES", "VLLM_PATCHES_STRICT",
                 "VLLM_PATCHES_ALLOW_UNSUPPORTED"):
        monkeypatch.delenv(name, raising=False)

    def install_source(source: str) -> None:
        fake.module("core.worker", source)
        importlib.invalidate_caches()  # sys.path named the folder before it existed

    fake.install_source = install_source
    return fake


def plugin_lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "vllm.vllm_patches"]


def test_a_patch_release_identical_at_every_target_runs_the_fixes_as_the_covered_one(
        on_v0_33_1, caplog):
    """VLLM v0.33.1 stopped at startup although its code at every
    target is v0.33.0's; the plugin compares it and activates as v0.33.0."""
    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    on_v0_33_1.install_source(HOOKED.replace("        return {\"a\"}", "        return {\"a\", \"x\"}")
                              + UNRELATED)
    _runtime.register()
    assert plugin_lines(caplog) == [(logging.WARNING, (
        "vllm-patches on vLLM v0.33.1 as v0.33.0 (not a covered release; its code at every "
        "target equals v0.33.0's: 4 definitions compared): active: F2; upstream: none; "
        "not applicable: none"))]
    worker = on_v0_33_1.get("core.worker").Worker()
    worker.start("m")
    assert worker.settled == ["m"], "the fix is installed"
    assert _runtime.current().release == Version("0.33.0")


@pytest.mark.parametrize(("installed", "shown"), [("0.33.1.dev12+gabcdef", "0.33.1.dev12"),
                                                  ("0.34.0rc1.dev3+g1234567", "0.34.0rc1.dev3")])
def test_a_development_build_identical_at_every_target_runs_as_the_newest_covered(
        on_v0_33_1, monkeypatch, caplog, installed, shown):
    """A vLLM built from main got no fix without
    VLLM_PATCHES_ALLOW_UNSUPPORTED=1, even with v0.33.0's code at every target. It is
    compared with the newest covered release not newer than its base (0.33.1, 0.34.0),
    and runs as it, with a WARNING, exactly as a patch release."""
    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    monkeypatch.setattr(_runtime, "installed_version_text", lambda: installed)
    on_v0_33_1.install_source(HOOKED + UNRELATED)
    _runtime.register()
    assert plugin_lines(caplog) == [(logging.WARNING, (
        f"vllm-patches on vLLM v{shown} as v0.33.0 (a development build; its code at every "
        "target equals v0.33.0's: 4 definitions compared): active: F2; upstream: none; "
        "not applicable: none"))]
    worker = on_v0_33_1.get("core.worker").Worker()
    worker.start("m")
    assert worker.settled == ["m"], "the fix is installed"


@pytest.mark.parametrize(("installed", "why"), [
    ("0.33.1.dev3+g1234567", ("vLLM 0.33.1.dev3+g1234567 is a development build, and its "
                              "code differs from v0.33.0's at core/worker.py:Worker.start "
                              "(F2: changed)")),
    ("0.33.0rc2", ("vLLM 0.33.0rc2 is a pre-release, and its code differs from v0.33.0's at "
                   "core/worker.py:Worker.start (F2: changed)")),
    ("0.32.1.dev5", ("vLLM 0.32.1.dev5 is a development build, and the series covers no "
                     "release up to its base v0.32.1 (covered: v0.33.0 .. v0.33.0)")),
])
def test_a_development_build_that_differs_or_predates_the_series_is_not_active(
        on_v0_33_1, monkeypatch, caplog, installed, why):
    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    monkeypatch.setattr(_runtime, "installed_version_text", lambda: installed)
    on_v0_33_1.install_source(DIFFERENT["a hooked method changed"][0])
    _runtime.register()
    assert plugin_lines(caplog) == [(logging.ERROR, (
        f"vllm-patches: NOT active on vLLM {installed}: F2; vLLM starts without the fixes "
        f"(VLLM_PATCHES_STRICT=1 stops it instead). Why: {why}; set "
        "VLLM_PATCHES_ALLOW_UNSUPPORTED=1 to activate the fixes anyway, at your own risk, or "
        "VLLM_PATCHES_DISABLE=1 to run without them"))]
    assert "_settle" not in vars(on_v0_33_1.get("core.worker").Worker)


# Each: the installed module differs from v0.33.0's at one target of F2.
DIFFERENT = {
    "a hooked method changed": (
        HOOKED.replace("self.started = metadata", "self.started = [metadata]"),
        "core/worker.py:Worker.start (F2: changed)"),
    "an @add name now defined": (
        HOOKED + "\n\ndef settled_count(worker):\n    return 0\n",
        "core/worker.py:settled_count (F2: now defined)"),
}


@pytest.mark.parametrize("case", DIFFERENT, ids=str)
def test_a_patch_release_that_differs_at_a_target_starts_without_the_fixes(
        on_v0_33_1, caplog, case):
    """By default nothing stops the engine: one ERROR line, and no fix is installed."""
    source, where = DIFFERENT[case]
    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    on_v0_33_1.install_source(source)
    _runtime.register()  # does not raise
    assert plugin_lines(caplog) == [(logging.ERROR, (
        "vllm-patches: NOT active on vLLM 0.33.1: F2; vLLM starts without the fixes "
        "(VLLM_PATCHES_STRICT=1 stops it instead). Why: vLLM v0.33.1 is not a covered "
        f"release, and its code differs from v0.33.0's at {where}; set "
        "VLLM_PATCHES_ALLOW_UNSUPPORTED=1 to activate the fixes anyway, at your own risk, or "
        "VLLM_PATCHES_DISABLE=1 to run without them"))]
    module = on_v0_33_1.get("core.worker")
    assert "_settle" not in vars(module.Worker) and not hasattr(module, INSTALLED), \
        "nothing installed"
    assert _runtime.current().failure is not None and _runtime.current().states == []


def test_strict_stops_vllm_on_a_patch_release_that_differs(on_v0_33_1, monkeypatch):
    on_v0_33_1.install_source(DIFFERENT["a hooked method changed"][0])
    monkeypatch.setenv("VLLM_PATCHES_STRICT", "1")
    with pytest.raises(ActivationError, match=r"not a covered release, and its code differs "
                                              r"from v0\.33\.0's at core/worker\.py:Worker\.start"):
        _runtime.register()
    assert "_settle" not in vars(on_v0_33_1.get("core.worker").Worker)
    assert _runtime.current() is None


def test_the_override_activates_a_patch_release_that_differs(on_v0_33_1, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    on_v0_33_1.install_source(DIFFERENT["a hooked method changed"][0])
    monkeypatch.setenv("VLLM_PATCHES_ALLOW_UNSUPPORTED", "1")
    _runtime.register()
    [(level, line)] = plugin_lines(caplog)
    assert level == logging.WARNING and line.startswith(
        "vllm-patches on vLLM v0.33.1 (NOT verified: vLLM v0.33.1 is not a covered release, "
        "and its code differs from v0.33.0's at core/worker.py:Worker.start (F2: changed); "
        "activated by VLLM_PATCHES_ALLOW_UNSUPPORTED=1 at your own risk): active: F2")
    assert "_settle" in vars(on_v0_33_1.get("core.worker").Worker)


def test_any_activation_error_starts_vllm_without_fixes_by_default(on_v0_33_1, monkeypatch,
                                                                   caplog):
    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    on_v0_33_1.install_source(HOOKED)
    monkeypatch.setenv("VLLM_PATCHES_FIXES", "F99")
    _runtime.register()
    [(level, line)] = plugin_lines(caplog)
    assert level == logging.ERROR and line.startswith(
        "vllm-patches: NOT active on vLLM 0.33.1: F2; vLLM starts without the fixes")
    assert "Why: VLLM_PATCHES_FIXES names unknown fix F99" in line


def test_any_error_before_the_first_change_starts_vllm_without_fixes(on_v0_33_1, monkeypatch,
                                                                     caplog):
    from vllm_patches._engine import fingerprint as _fingerprint

    caplog.set_level(logging.INFO, logger="vllm.vllm_patches")
    on_v0_33_1.install_source(HOOKED)
    monkeypatch.setattr(_fingerprint, "compute", lambda *a: 1 / 0)
    _runtime.register()
    [(level, line)] = plugin_lines(caplog)
    assert level == logging.ERROR and line.endswith(
        "vLLM starts without the fixes (VLLM_PATCHES_STRICT=1 stops it instead). Why: "
        "ZeroDivisionError('division by zero')")
    assert "_settle" not in vars(on_v0_33_1.get("core.worker").Worker)


def test_a_half_installed_fix_stops_vllm_under_every_policy(on_v0_33_1, monkeypatch):
    """Installing that fails after the first change cannot be taken back: it is never
    reported as a start without fixes (the postcondition test's metaclass)."""
    monkeypatch.setattr(_runtime, "installed_version_text", lambda: "0.33.0")
    on_v0_33_1.install_source(HOOKED.replace("class Worker:", "class Sticky(type):\n"
                                             "    def __setattr__(cls, name, value):\n"
                                             "        pass\n\n\nclass Worker(metaclass=Sticky):"))
    with pytest.raises(_runtime.PartlyInstalled, match="part of the fixes may be in this process "
                                                       "and cannot be taken back.*postconditions"):
        _runtime.register()
    assert _runtime.current() is None
