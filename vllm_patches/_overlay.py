"""How an overlay names its upstream target.

An overlay module mirrors one upstream module (``vllm_patches/v1/core/x.py`` changes
``vllm/v1/core/x.py``). Each top-level definition in it carries one marker:

``@amend(fix, releases)`` on a class
    A partial class: each member replaces the upstream class's member of the same
    name, or is added to that class when upstream has none. The upstream class
    must exist.
``@amend(fix, releases)`` on a function
    Replaces the upstream module-level function of the same name, which must exist.
``@add(fix, releases)`` on a class or function
    A new module-level definition; upstream must not have one of that name.
``@add(fix, releases, into="../other.py")``
    The same, added to the upstream module of another overlay (a path relative to
    this file): one definition that different releases need in different files
    (an upstream module that was split) is written once. A definition may carry
    several ``@add`` markers, one per file and range.
``@amend(fix, releases, into="../other.py", name="OldClass")`` on a class
    A partial class written once for several layouts: in other releases its members
    go to class ``name`` of another overlay's upstream module (where that state lived
    before a class was split).
``@amend(fix, releases, after="m")`` on a class
    The partial class's new members go right after upstream member ``m`` rather than
    to the end of the class, where other fixes add theirs: two fixes that add members
    to one class touch the same lines only if one names the other's place. A hook
    sits best after the method it hooks.

``releases`` is a PEP 440 specifier set that says where the variant starts
(``">=0.24.0"``). Where one upstream file needs different code in different releases,
the variants sit side by side in the overlay, each with its range; ranges of one fix's
variants of a name must not overlap, and a range ends (``">=0.20.0,<0.24.0"``) only
where another variant of the same definition starts
(``_engine.splice.check_bounds``). How far the series is verified is
``series.toml``'s newest covered release, written only there.

Inside an amended class, the class's own docstring describes the overlay and is
not spliced; an assignment ``__doc__ = "..."`` (a string literal) replaces the upstream class
docstring.

Markers on a new method of an amended class hook it into an upstream method of
that class, so a fix adds a step without replacing (and copying) a long method:

``@call_at_end_of("m")``
    ``self.<hook>(a, b)`` runs whenever upstream ``m`` returns normally: the splice
    puts the call before each bare ``return`` of ``m`` and after its last statement.
    The hook's parameters after ``self`` name parameters of ``m``, which pass through
    (``m`` must not rebind them); ``m`` must not return a value.
``@filter_result_of("m")``
    Every ``return value`` of upstream ``m`` becomes ``return self.<hook>(value)``:
    the hook takes what ``m`` computed and returns what ``m`` returns. ``m`` must end
    in a ``return value`` and have no bare ``return``. Parameters of the hook after the
    value name parameters of ``m``, which it receives too:
    ``return self.<hook>(value, request)`` (``m`` must not rebind them).
``@filter_call_in("m", "self.agent.poll")``
    Inside upstream ``m`` (not in functions nested in it), every call whose callee is
    written ``self.agent.poll`` becomes ``self.<hook>(self.agent.poll(...))``: the hook
    takes what the call returned and returns what ``m`` then works with. ``m`` must
    make at least one such call. For a step inside a loop that no return value shows
    (F2 sees the NIXL notifications before upstream's loop counts them). Filters of
    one callee by several fixes compose in series order, the earlier fix's
    innermost: ``self.<h2>(self.<h1>(self.agent.poll()))``.
``@redirect_call_in("m", "pin_tensor")``
    Inside upstream ``m`` (not in nested functions), every call written ``pin_tensor(...)``
    becomes ``self.<hook>(...)`` with the same arguments: the hook decides whether and
    when the call runs and returns what ``m`` then works with. ``m`` must make at least
    one such call. For a step that must move elsewhere (F4 defers the pin and the copy
    backend's init until the worker finished CUDA-graph capture). Call filters and
    redirects of one method are one rewrite; a redirected callee takes no filter.
``@guard_branch_in("m", "logger.error")``
    Inside upstream ``m`` (not in nested functions), each ``if`` branch that calls
    ``logger.error`` as one of its own statements, and ends in ``continue``, first runs
    ``if not self.<hook>(a, b): continue``: the branch's statements run only when the
    hook returns true; otherwise the hook took the case and the loop goes on. The
    hook's parameters after ``self`` name variables of ``m`` (``req_id``), which it
    receives as they are there. It costs nothing where the branch is not taken. For a
    case upstream's loop already singles out (F3 takes the notifications for requests
    the NIXL producer does not hold, where upstream logs them as invalid, unless they
    are late). One rewrite with the call filters and redirects of the method. The one
    hook that sees a loop's own state per item (upstream's test of which requests it
    holds, what the loop released before): a filter before or after the loop cannot.

Hooks of several fixes on one method compose in series order, the later fix's
outside. The hooked method may be an ``async def`` (F26 filters the OpenAI serving
calls' results); the hook stays a plain method, which sees the awaited value.

The call hooks also take a call pattern, ``"c(k=...)"``: only the calls of ``c`` that
pass keyword ``k`` (F25 redirects the scheduler's allocation that admits a waiting
request, which passes ``delay_cache_blocks``, and leaves the running requests' own,
one each every step, as they are).

A later fix that replaces ``m`` whole keeps the hook call in its own text.

Module-level imports of the overlay are the imports its definitions need; the
splice adds to the upstream module those it lacks and the spliced code uses.

The markers only record facts (they return their argument unchanged), so an overlay
module imports cleanly, and its functions can be installed onto the live upstream
classes. Zero-argument ``super()`` works in both (the runtime points the ``__class__``
cell at the live class, ``_engine.install``), and upstream's ruff asks for it (UP008).
Every global name the code uses must resolve in the upstream module once the imports are
added: overlays use upstream's own names (``logger``) unimported.

Checked: the splice refuses what breaks these rules, on every covered release (regen),
and checks each spliced file's names (``_engine.patch_writer.check_names``); ruff lints
the overlays (``tests/tool/test_series.py``) with F821 and F811 off for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

Definition = TypeVar("Definition")

AMEND = "amend"
ADD = "add"


def _marker(kind: str, fix: str, releases: str, into: str | None = None,
            name: str | None = None, after: str | None = None
            ) -> Callable[[Definition], Definition]:
    def mark(definition: Definition) -> Definition:
        markers = getattr(definition, "__vllm_patches__", ())
        marker = (kind, fix, releases, into, name, after)
        definition.__vllm_patches__ = (*markers, marker)  # type: ignore[attr-defined]
        return definition

    return mark


def amend(fix: str, releases: str, into: str | None = None, name: str | None = None,
          after: str | None = None) -> Callable[[Definition], Definition]:
    """Replace or extend the upstream definition of the same name (of ``name``, for a
    partial class; in the upstream module of the overlay ``into``, when given; a
    partial class's new members right after upstream member ``after``, when given)."""
    return _marker(AMEND, fix, releases, into, name, after)


def add(fix: str, releases: str, into: str | None = None) -> Callable[[Definition], Definition]:
    """A new module-level definition that upstream does not have (in the upstream module
    of the overlay ``into``, relative to this one, when given)."""
    return _marker(ADD, fix, releases, into)


HOOK_ATTR = "__vllm_patches_hook__"
CALL_AT_END_OF = "call_at_end_of"
FILTER_RESULT_OF = "filter_result_of"
FILTER_CALL_IN = "filter_call_in"
REDIRECT_CALL_IN = "redirect_call_in"
GUARD_BRANCH_IN = "guard_branch_in"
HOOKS = {CALL_AT_END_OF, FILTER_RESULT_OF, FILTER_CALL_IN, REDIRECT_CALL_IN, GUARD_BRANCH_IN}


def _hook(kind: str, method: str, call: str | None = None) -> Callable[[Definition], Definition]:
    def mark(definition: Definition) -> Definition:
        setattr(definition, HOOK_ATTR, (kind, method, call))
        return definition

    return mark


def call_at_end_of(method: str) -> Callable[[Definition], Definition]:
    """Run the decorated new method whenever upstream ``method`` returns normally,
    with the arguments of ``method`` its parameters name."""
    return _hook(CALL_AT_END_OF, method)


def filter_result_of(method: str) -> Callable[[Definition], Definition]:
    """Pass every value upstream ``method`` returns through the decorated new method;
    its parameters after the value name arguments of ``method`` it receives too."""
    return _hook(FILTER_RESULT_OF, method)


def filter_call_in(method: str, call: str) -> Callable[[Definition], Definition]:
    """Pass what each call ``call`` (a dotted callee, ``self.agent.poll``) inside upstream
    ``method`` returns through the decorated new method."""
    return _hook(FILTER_CALL_IN, method, call)


def redirect_call_in(method: str, call: str) -> Callable[[Definition], Definition]:
    """Send each call ``call`` (a dotted callee, ``pin_tensor``) inside upstream ``method``
    to the decorated new method instead, with the same arguments."""
    return _hook(REDIRECT_CALL_IN, method, call)


def guard_branch_in(method: str, call: str) -> Callable[[Definition], Definition]:
    """Ask the decorated new method first, in each ``if`` branch of upstream ``method``
    that calls ``call`` and ends in ``continue``, whether that branch runs; its
    parameters name variables of ``method``."""
    return _hook(GUARD_BRANCH_IN, method, call)
