"""The splice engine on small synthetic modules: what it replaces, adds and keeps."""

import ast
import re
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_patches._catalog import series as _series
from vllm_patches._engine import patch_writer as _patch_writer
from vllm_patches._engine.splice import (
    Overlay,
    SpliceError,
    check_bounds,
    splice,
    unstarted_bounds,
)

UPSTREAM = textwrap.dedent('''\
    # header comment
    import os
    from typing import Any

    LIMIT = 3


    class Worker:
        """Upstream docstring."""

        def __init__(self):
            self.x = 1

        def step(self):
            # upstream comment
            return self.x

        def untouched(self):
            return  os.sep  # odd spacing kept


    def helper(a):
        return a
''')


def write_overlay(tmp_path: Path, body: str) -> Overlay:
    path = tmp_path / "overlay.py"
    path.write_text("from vllm_patches._overlay import add, amend, call_at_end_of, filter_call_in, "
                    "filter_result_of, guard_branch_in, redirect_call_in\n"
                    + textwrap.dedent(body))
    return Overlay.parse(path)


def spliced(overlay: Overlay, fixes=("F1",), release="0.21.0") -> str:
    definitions = overlay.select(list(fixes), Version(release))
    return splice(UPSTREAM, definitions, overlay)


def test_replaces_a_method_and_keeps_everything_else_byte_identical(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            """Overlay docstring: not spliced."""

            def step(self):
                return self.x + 1
        ''')
    result = spliced(overlay)
    assert result == UPSTREAM.replace(
        "        # upstream comment\n        return self.x\n",
        "        return self.x + 1\n")


def test_new_methods_go_before_the_next_replaced_one_or_at_the_end(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            def first_phase(self):
                pass

            def step(self):
                return 2

            def second_phase(self):
                pass
        ''')
    result = spliced(overlay)
    order = [line.strip() for line in result.splitlines() if line.strip().startswith("def ")]
    assert order == ["def __init__(self):", "def first_phase(self):", "def step(self):",
                     "def second_phase(self):", "def untouched(self):", "def helper(a):"]


def test_new_methods_go_after_the_member_a_partial_class_names(tmp_path):
    """``after=``: a hook sits beside the method it hooks, apart from the lines other
    fixes add at the end of the class."""
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18", after="__init__")
        class Worker:
            @call_at_end_of("__init__")
            def _init_more(self):
                self.y = 2
        ''')
    result = spliced(overlay)
    order = [line.strip() for line in result.splitlines() if line.strip().startswith("def ")]
    assert order == ["def __init__(self):", "def _init_more(self):", "def step(self):",
                     "def untouched(self):", "def helper(a):"]
    assert "        self.x = 1\n        self._init_more()\n" in result


def test_imports_are_added_only_when_used_and_missing(tmp_path):
    overlay = write_overlay(tmp_path, '''
        import os
        from collections import OrderedDict, deque
        from typing import Any

        @amend("F1", ">=0.18")
        def helper(a):
            return OrderedDict(a=os.sep)
        ''')
    result = spliced(overlay)
    assert "from collections import OrderedDict\n" in result
    assert "deque" not in result
    assert result.count("import os") == 1 and result.count("from typing import Any") == 1
    # The new import sits right after upstream's last top-level import.
    assert result.index("from collections import OrderedDict") > result.index("from typing import Any")
    assert "vllm_patches" not in result


def test_call_at_end_of_init_and_add(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            @call_at_end_of("__init__")
            def _init_extra_state(self):
                self.extra = {}

        @add("F1", ">=0.18")
        class ExtraState:
            pass
        ''')
    result = spliced(overlay)
    assert "        self.x = 1\n        self._init_extra_state()\n" in result
    assert "call_at_end_of" not in result and "@amend" not in result
    assert result.endswith("\n\n\nclass ExtraState:\n    pass\n")


HOOKED = textwrap.dedent('''\
    class Worker:
        def start(self, metadata, step=0):
            for req in metadata:
                if req is None:
                    return
            if step:
                self.step = step
                return
            self.done = True

        def notifs(self):
            found = set()

            def nested():
                return None

            if not found:
                return found
            return {*found, nested()}

        def finished(self):
            return self.done, None
''')


def test_call_at_end_of_passes_arguments_and_runs_at_every_bare_return(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            @call_at_end_of("start")
            def _settle(self, metadata, step):
                pass
        ''')
    result = splice(HOOKED, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert result.startswith(textwrap.dedent('''\
        class Worker:
            def start(self, metadata, step=0):
                for req in metadata:
                    if req is None:
                        self._settle(metadata, step)
                        return
                if step:
                    self.step = step
                    self._settle(metadata, step)
                    return
                self.done = True
                self._settle(metadata, step)

            def notifs(self):
                found = set()

                def nested():
                    return None
        '''))


def test_filter_result_of_wraps_every_returned_value(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            @filter_result_of("notifs")
            def _with_more(self, found):
                return found | {1}
        ''')
    result = splice(HOOKED, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert "        if not found:\n            return self._with_more(found)\n" in result
    assert "        return self._with_more({*found, nested()})\n" in result
    assert "        def nested():\n            return None\n" in result


def test_filter_result_of_passes_a_bare_tuple_as_one_value(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            @filter_result_of("finished")
            def _seen(self, finished):
                return finished
        ''')
    result = splice(HOOKED, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert "        return self._seen((self.done, None))\n" in result


ANSWERING = textwrap.dedent('''\
    class Scheduler:
        def answer(self, request, computed=0):
            if request.remote:
                return request.size - computed, True
            return (
                0,
                False,
            )
''')


def test_filter_result_of_passes_the_parameters_its_hook_names_after_the_value(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Scheduler:
            @filter_result_of("answer")
            def _checked(self, answer, request):
                return answer
        ''')
    result = splice(ANSWERING, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert "            return self._checked((request.size - computed, True), request)\n" \
        in result
    # A value spanning lines passes through whole (its layout is ruff's: format_changes).
    assert "return self._checked((0, False), request)" in ast.unparse(ast.parse(result))


def test_filter_result_of_refuses_a_parameter_the_method_lacks(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Scheduler:
            @filter_result_of("answer")
            def _checked(self, answer, params):
                return answer
        ''')
    with pytest.raises(SpliceError, match="answer has no parameter params"):
        splice(ANSWERING, overlay.select(["F1"], Version("0.21.0")), overlay)


POLLING = textwrap.dedent('''\
    class Worker:
        def notifs(self):
            found = set()
            for agent, messages in self.agent.poll().items():
                found |= set(messages)

            def nested():
                return self.agent.poll()

            return found | self.agent.poll(1) | {self.agent.poll2()}
''')


# F1 filters each call of self.agent.poll in Worker.notifs.
SEEN_OVERLAY = '''
        @amend("F1", ">=0.18")
        class Worker:
            @filter_call_in("notifs", "self.agent.poll")
            def _seen(self, notifs):
                return notifs
'''


def test_filter_call_in_wraps_each_call_of_the_callee_in_the_method(tmp_path):
    overlay = write_overlay(tmp_path, SEEN_OVERLAY)
    result = splice(POLLING, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert result == POLLING.replace(
        "in self.agent.poll().items()", "in self._seen(self.agent.poll()).items()").replace(
        "found | self.agent.poll(1)", "found | self._seen(self.agent.poll(1))") + (
        "\n    def _seen(self, notifs):\n        return notifs\n"), "nested scopes are left alone"


POLLING_TWICE = textwrap.dedent('''\
    class Worker:
        def notifs(self):
            found = set()
            for agent, messages in self.agent.poll().items():
                found |= set(messages)
            for agent, messages in self.agent.poll_notifications().items():
                found |= set(messages)
            return found
''')


def test_call_filters_of_two_fixes_on_one_callee_compose_in_series_order(tmp_path):
    overlay = write_overlay(tmp_path, SEEN_OVERLAY + '''
            @filter_call_in("notifs", "self.agent.poll_notifications")
            def _polled(self, notifs):
                return notifs

            @filter_result_of("notifs")
            def _more(self, found):
                return found


        @amend("F2", ">=0.18")
        class Worker:
            @filter_call_in("notifs", "self.agent.poll_notifications")
            def _counted(self, notifs):
                return notifs
        ''')
    result = splice(POLLING_TWICE, overlay.select(["F1", "F2"], Version("0.21.0")),
                    overlay)
    assert "        for agent, messages in self._seen(self.agent.poll()).items():\n" in result
    # The later fix sees what the earlier one's filter returned.
    assert "for agent, messages in self._counted(self._polled(" \
        "self.agent.poll_notifications())).items():" in ast.unparse(ast.parse(result))
    assert "        return self._more(found)\n" in result


def test_filter_call_in_refuses_a_method_without_the_call(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            @filter_call_in("notifs", "self.agent.peek")
            def _seen(self, notifs):
                return notifs
        ''')
    with pytest.raises(SpliceError, match="notifs makes no call of self.agent.peek"):
        splice(POLLING, overlay.select(["F1"], Version("0.21.0")), overlay)


def test_redirect_call_in_sends_each_call_to_the_hook_with_its_arguments(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            @redirect_call_in("notifs", "self.agent.poll")
            def _poll_later(self, *args):
                return {}

            @redirect_call_in("notifs", "self.agent.poll2")
            def _poll2(self):
                return 2
        ''')
    result = splice(POLLING, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert result.startswith(POLLING.replace(
        "in self.agent.poll().items()", "in self._poll_later().items()").replace(
        "found | self.agent.poll(1) | {self.agent.poll2()}",
        "found | self._poll_later(1) | {self._poll2()}")), "nested scopes are left alone"


ALLOCATING = textwrap.dedent('''\
    class Scheduler:
        def schedule(self):
            for request in self.running:
                self.allocate(request, 1)
            for request in self.waiting:
                self.allocate(request, 2, delay=request.remote)
''')


def test_a_call_pattern_with_a_keyword_takes_only_the_calls_that_pass_it(tmp_path):
    """``c(k=...)``: the call site that passes ``k`` goes to the hook; the others
    (a scheduler's allocation per running request, every step) cost nothing."""
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Scheduler:
            @redirect_call_in("schedule", "self.allocate(delay=...)")
            def _allocate_loads(self, request, num, **kwargs):
                return None
        ''')
    result = splice(ALLOCATING, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert result.startswith(ALLOCATING.replace(
        "self.allocate(request, 2, delay", "self._allocate_loads(request, 2, delay"))


@pytest.mark.parametrize(("pattern", "error"), [
    ("self.allocate(lazy=...)", "schedule makes no call of self.allocate\\(lazy=...\\)"),
    ("self.allocate(delay=True)", "a call pattern names one keyword, as c\\(k=...\\)"),
    ("self.allocate(r, delay=...)", "a call pattern names one keyword"),
])
def test_a_call_pattern_refuses_what_it_cannot_match(tmp_path, pattern, error):
    overlay = write_overlay(tmp_path, f'''
        @amend("F1", ">=0.18")
        class Scheduler:
            @redirect_call_in("schedule", "{pattern}")
            def _allocate_loads(self, request, num, **kwargs):
                return None
        ''')
    with pytest.raises(SpliceError, match=error):
        splice(ALLOCATING, overlay.select(["F1"], Version("0.21.0")), overlay)


def test_a_call_two_patterns_match_is_not_redirected_and_hooked_again(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Scheduler:
            @redirect_call_in("schedule", "self.allocate(delay=...)")
            def _allocate_loads(self, request, num, **kwargs):
                return None

            @filter_call_in("schedule", "self.allocate")
            def _allocated(self, blocks):
                return blocks
        ''')
    with pytest.raises(SpliceError, match="self.allocate is redirected and hooked again"):
        splice(ALLOCATING, overlay.select(["F1"], Version("0.21.0")), overlay)


COUNTING = textwrap.dedent('''\
    class Worker:
        def notifs(self):
            found = set()
            for message in self.agent.poll():
                name, _, count = message.partition(":")
                if name not in self.held:
                    self.unknown += 1
                    logger.error("unknown %s", name)
                    continue
                found.add(name)

            def nested(names):
                for name in names:
                    if name:
                        logger.error("nested %s", name)
                        continue

            return found
''')


def test_guard_branch_in_asks_the_hook_first_in_the_branch_that_makes_the_call(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            @guard_branch_in("notifs", "logger.error")
            def _unknown_is_error(self, name, message):
                return True


        @amend("F2", ">=0.18")
        class Worker:
            @guard_branch_in("notifs", "logger.error")
            def _taken(self, name):
                return True
        ''')
    result = splice(COUNTING, overlay.select(["F1"], Version("0.21.0")), overlay)
    assert result.startswith(COUNTING.replace(
        "            if name not in self.held:\n",
        "            if name not in self.held:\n"
        "                if not self._unknown_is_error(name, message):\n"
        "                    continue\n")), "the call stays; nested scopes are left alone"
    both = splice(COUNTING, overlay.select(["F1", "F2"], Version("0.21.0")), overlay)
    assert ("            if name not in self.held:\n"
            "                if not self._taken(name):\n"
            "                    continue\n"
            "                if not self._unknown_is_error(name, message):\n"
            "                    continue\n"
            "                self.unknown += 1\n") in both, "the later fix's guard asks first"


@pytest.mark.parametrize(("upstream_change", "params", "error"), [
    (("                continue\n            found", "            found"), "name",
     "the branch must end in `continue` to be guarded"),
    (("            found.add(name)\n", ("            found.add(name)\n"
                                         "            logger.error(\"counted %s\", name)\n")),
     "name",
     "notifs calls logger.error other than as a statement of an `if` branch"),
    (("found = set()", "found = set()"), "name, request", "notifs has no variable request"),
])
def test_guard_branch_in_refuses_what_it_cannot_guard(tmp_path, upstream_change, params, error):
    assert upstream_change[0] in COUNTING
    overlay = write_overlay(tmp_path, f'''
        @amend("F1", ">=0.18")
        class Worker:
            @guard_branch_in("notifs", "logger.error")
            def _taken(self, {params}):
                return True
        ''')
    with pytest.raises(SpliceError, match=re.escape(error)):
        splice(COUNTING.replace(*upstream_change), overlay.select(["F1"], Version("0.21.0")),
               overlay)


@pytest.mark.parametrize(("marker", "target", "params", "error"), [
    ("call_at_end_of", "notifs", "", "it returns a value; use @filter_result_of"),
    ("filter_result_of", "start", ", metadata", "a bare `return` can't pass a result"),
    ("call_at_end_of", "start", ", request", "start has no parameter request"),
    ("call_at_end_of", "missing", "", "Worker has no missing"),
])
def test_hooks_refuse_what_they_cannot_mirror(tmp_path, marker, target, params, error):
    overlay = write_overlay(tmp_path, f'''
        @amend("F1", ">=0.18")
        class Worker:
            @{marker}("{target}")
            def _hook(self{params}):
                pass
        ''')
    with pytest.raises(SpliceError, match=error):
        splice(HOOKED, overlay.select(["F1"], Version("0.21.0")), overlay)


def test_one_definition_is_added_into_the_files_each_release_needs(tmp_path):
    (tmp_path / "old").mkdir()
    home, old = tmp_path / "new.py", tmp_path / "old" / "worker.py"
    home.write_text(textwrap.dedent('''\
        from collections import OrderedDict

        from vllm_patches._overlay import add


        @add("F1", ">=0.20")
        @add("F1", "<0.20", into="old/worker.py")
        class Shared:
            seen = OrderedDict()
        '''))
    old.write_text("from vllm_patches._overlay import amend\n")
    files = [home, old]
    received = Overlay.parse(old, files)
    assert [d.name for d in received.select(["F1"], Version("0.19.0"))] == ["Shared"]
    assert received.select(["F1"], Version("0.21.0")) == []
    result = splice(UPSTREAM, received.select(["F1"], Version("0.19.0")), received)
    assert "from collections import OrderedDict\n" in result  # the home file's import
    assert result.endswith("\n\n\nclass Shared:\n    seen = OrderedDict()\n")
    assert [d.name for d in Overlay.parse(home, files).select(["F1"], Version("0.21.0"))] == ["Shared"]
    assert Overlay.parse(home, files).select(["F1"], Version("0.19.0")) == []


def test_a_partial_class_is_written_once_for_a_class_of_another_name(tmp_path):
    home, old = tmp_path / "base.py", tmp_path / "worker.py"
    home.write_text(textwrap.dedent('''\
        from vllm_patches._overlay import amend


        @amend("F1", ">=0.20")
        @amend("F1", "<0.20", into="worker.py", name="Worker")
        class BaseWorker:
            def forget(self):
                return self.x
        '''))
    old.write_text("from vllm_patches._overlay import amend\n")
    received = Overlay.parse(old, [home, old])
    (definition,) = received.select(["F1"], Version("0.19.0"))
    assert definition.name == "Worker" and definition.source == home
    result = splice(UPSTREAM, [definition], received)
    assert "    def forget(self):\n        return self.x\n\n\ndef helper(a):" in result
    assert "BaseWorker" not in result


@pytest.mark.parametrize(("markers", "error"), [
    ('@add("F1", ">=0.18", into="nowhere.py")', "into='nowhere.py' is no overlay"),
    ('@amend("F1", ">=0.20")\n@add("F1", "<0.20")', "markers of one kind"),
])
def test_bad_markers_are_refused(tmp_path, markers, error):
    with pytest.raises(SpliceError, match=error):
        write_overlay(tmp_path, f"\n{markers}\ndef helper(a):\n    pass\n")


def test_variants_are_chosen_by_release(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", "<0.20")
        def helper(a):
            return "old"

        @amend("F1", ">=0.20")
        def helper(a):
            return "new"
        ''')
    assert 'return "old"' in spliced(overlay, release="0.19.0")
    assert 'return "new"' in spliced(overlay, release="0.21.0")


def test_later_fix_in_series_order_wins(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F3", ">=0.18")
        def helper(a):
            return "f2 and f3"

        @amend("F2", ">=0.18")
        def helper(a):
            return "f2"
        ''')
    assert 'return "f2"\n' in spliced(overlay, fixes=("F2",))
    assert 'return "f2 and f3"' in spliced(overlay, fixes=("F2", "F3"))


@pytest.mark.parametrize("body, message", [
    ('@amend("F1", ">=0.18")\nclass Missing:\n    pass\n', "upstream has no such definition"),
    ('@add("F1", ">=0.18")\ndef helper(a):\n    pass\n', "already defines it"),
    ('@amend("F1", ">=0.18")\n@amend("F1", ">=0.18")\ndef helper(a):\n    pass\n', "two variants"),
    ('@amend("F1", ">=0.18", name="Worker")\ndef helper(a):\n    pass\n', "name= is for @amend partial"),
    ('@amend("F1", ">=0.18", after="step")\ndef helper(a):\n    pass\n', "after= is for @amend partial"),
    ('@amend("F1", ">=0.18", after="gone")\nclass Worker:\n    def new(self):\n        pass\n',
     "after='gone', but upstream Worker has no such member"),
    ('@amend("F1", ">=0.18")\ndef helper(a):\n    pass\n@amend("F1", ">=0.21")\ndef helper(a):\n    pass\n',
     "two variants"),
    ('LIMIT = 4\n@add("F1", ">=0.18")\ndef helper(a):\n    pass\n', "`LIMIT = 4` is a module-level"),
    ('if DEBUG:\n    import os\n', "`if DEBUG:` is a module-level"),
])
def test_mistakes_are_loud(tmp_path, body, message):
    with pytest.raises(SpliceError, match=message):
        spliced(write_overlay(tmp_path, body))


def test_type_checking_imports_are_allowed(tmp_path):
    overlay = write_overlay(tmp_path, '''
        """The overlay's own docstring."""
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from os import PathLike

        @add("F1", ">=0.18")
        def path_of(p: "PathLike") -> str:
            return str(p)
    ''')
    result = spliced(overlay)
    assert "def path_of" in result
    # Upstream has no TYPE_CHECKING block: one is made, after its imports, for the name
    # the quoted annotation uses (upstream's mypy hook reads it; the runtime never does).
    assert "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from os import PathLike\n" \
        in result


def test_type_checking_imports_go_into_upstreams_block_unless_it_has_them(tmp_path):
    overlay = write_overlay(tmp_path, '''
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from os import PathLike
            from pathlib import PurePath

        @add("F1", ">=0.18")
        def path_of(p: "PathLike | PurePath", q: "Unrelated") -> str:
            return str(p)
    ''')
    upstream = textwrap.dedent('''\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pathlib import PurePath
    ''')
    definitions = overlay.select(["F1"], Version("0.21.0"))
    result = splice(upstream, definitions, overlay)
    assert result.startswith(textwrap.dedent('''\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pathlib import PurePath
            from os import PathLike
    '''))
    assert result.count("TYPE_CHECKING") == 2


def test_doc_assignment_replaces_the_class_docstring(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            """Describes the overlay: not spliced."""

            __doc__ = """New upstream docstring."""
        ''')
    result = spliced(overlay)
    assert result == UPSTREAM.replace('"""Upstream docstring."""', '"""New upstream docstring."""')


def test_partial_classes_of_one_fix_may_share_a_release_with_disjoint_members(tmp_path):
    overlay = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            def shared(self):
                return "every release"

        @amend("F1", ">=0.21")
        class Worker:
            def step(self):
                return "new releases"
        ''')
    result = spliced(overlay)
    assert 'return "every release"' in result and 'return "new releases"' in result
    clash = write_overlay(tmp_path, '''
        @amend("F1", ">=0.18")
        class Worker:
            def step(self):
                return 1

        @amend("F1", ">=0.21")
        class Worker:
            def step(self):
                return 2
        ''')
    with pytest.raises(SpliceError, match="two variants"):
        spliced(clash)


# ------------------------------------------------------------------ one upper bound

SERIES = _series.load()
OVERLAY_PATHS = [_series.PACKAGE_DIR / o for fix in SERIES.fixes for o in fix.overlays]


def test_a_bound_that_starts_no_variant_is_refused(tmp_path):
    """A marker's range says where a variant starts; ``<end`` only where another variant
    of the same definition starts. The newest verified release is the series'."""
    path = tmp_path / "m.py"
    path.write_text('@amend("F1", ">=0.18.0,<0.20.0")\ndef f():\n    pass\n\n\n'
                    '@amend("F1", ">=0.20.0,<0.34.0")\ndef f():\n    pass\n')
    bounds = unstarted_bounds([path])
    assert [(b.definition.fix, str(b.end)) for b in bounds] == [("F1", "0.34.0")]
    with pytest.raises(SpliceError, match=r"the upper bound <0.34.0 starts no other variant of f"):
        check_bounds([path], {"F1"})
    path.write_text(path.read_text().replace(",<0.34.0", ""))
    check_bounds([path], {"F1"})


def test_variants_linked_by_name_across_layouts_start_each_other(tmp_path):
    """A class upstream split: the old layout's variant ends where the partial class
    written for both layouts (``name=``) starts in the new one."""
    old = tmp_path / "worker.py"
    old.write_text('@amend("F3", ">=0.20.0,<0.24.0")\nclass Worker:\n    pass\n')
    new = tmp_path / "pull_worker.py"
    new.write_text('@amend("F3", ">=0.24.0")\n'
                   '@amend("F3", ">=0.18.0,<0.20.0", into="worker.py", name="Worker")\n'
                   'class PullWorker:\n    pass\n')
    assert unstarted_bounds([old, new]) == []


@pytest.mark.parametrize("releases", ["<=0.33.0", "==0.21.0", "~=0.21.0"])
def test_a_range_is_a_start_and_optionally_an_end(tmp_path, releases):
    path = tmp_path / "m.py"
    path.write_text(f'@amend("F1", ">=0.18.0,{releases}")\ndef f():\n    pass\n')
    with pytest.raises(SpliceError, match="a range is >=start"):
        unstarted_bounds([path])


def test_markers_end_only_where_a_variant_starts():
    assert [str(b) for b in unstarted_bounds(OVERLAY_PATHS)] == []


def test_a_fix_tried_alone_is_judged_by_its_own_markers(pristine_v0_21_0):
    """matrix's culprit search generates a fix without the fixes before it. F5 shares
    nixl_connector.py with F2, whose variant there ends (<0.20.0) where F2's next one,
    in a file only F2 edits, starts: judged without that file, F2's bound was reported
    as F5's conflict ("@amend('F2', ...) ... starts no other variant")."""
    f5 = SERIES.fix("F5")
    paths = [_series.PACKAGE_DIR / overlay for overlay in f5.overlays]
    assert [b.definition.fix for b in unstarted_bounds(paths)] == ["F2"]
    assert unstarted_bounds(paths, {"F5"}) == []
    alone = _series.Series((f5,), SERIES.lanes, SERIES.covered)
    patches = _patch_writer.generate(alone, Version("0.21.0"), pristine_v0_21_0)
    assert [patch.fix.id for patch in patches] == ["F5"]


ADDED = "sizes = [1,2]\n\n\ndef added(x):\n    return [x,1]\n"


def test_format_changes_lays_out_the_lines_a_hook_changed_and_only_those(tmp_path):
    """A hook's call around a multi-line upstream expression, laid out by ruff; an
    upstream line ruff would change elsewhere, and an added one (check_formatted's),
    stay as written."""
    upstream = textwrap.dedent("""\
        sizes = [1,2]


        class Scheduler:
            def reserved(self):
                return sum(
                    self._request_remaining_blocks(req) for req in self._inflight_prefills
                )
        """)
    spliced = upstream.replace("return sum(", "return self._and_own_step(sum(").replace(
        "        )\n", "        ))\n").replace("sizes = [1,2]\n", ADDED)
    result = _patch_writer.format_changes(tmp_path, "vllm/x.py", spliced, upstream)
    assert result == upstream.replace("""\
        return sum(
            self._request_remaining_blocks(req) for req in self._inflight_prefills
        )
""", """\
        return self._and_own_step(
            sum(self._request_remaining_blocks(req) for req in self._inflight_prefills)
        )
""").replace("sizes = [1,2]\n", ADDED), "an added line is not"
    assert _patch_writer.format_changes(tmp_path, "vllm/x.py", upstream, upstream) == upstream
