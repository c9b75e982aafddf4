"""Hook kinds: one class per hook marker of ``_overlay``, behind one registry.

A hook hooks a new method of an amended class into an upstream method of that class
(see ``_overlay``). Each kind is one class here, and that class is the only place its
change of the upstream method is written, for both ways the fixes reach vLLM:

- the static splice (``_splice``) asks the kind to rewrite the upstream method's libcst
  (``HookKind.splice``, or, for the call rewrites, ``rewrite_call`` per call or, for a
  branch guard, ``guard`` per branch, all of a method's in one pass: ``filter_calls``);
- the runtime install (``_install``) asks the kind what replaces the live method
  (``HookKind.wrap``: a wrapper that does what the spliced text does) or, for the call
  rewrites, recompiles the live method from its source with the same ``filter_calls``.

``HOOK_KINDS`` maps each marker name to its kind; a new kind is one class added to it
(plus its marker in ``_overlay``), not a change in the splice and the runtime.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import libcst as cst
import libcst.matchers as m

from vllm_patches._errors import SpliceError
from vllm_patches._overlay import (
    CALL_AT_END_OF,
    FILTER_CALL_IN,
    FILTER_RESULT_OF,
    GUARD_BRANCH_IN,
    REDIRECT_CALL_IN,
)


def hook_parameters(hook: cst.FunctionDef) -> list[str]:
    """The parameters of a hook method after ``self``: names of its target's parameters."""
    return [param.name.value for param in hook.params.params[1:]]


def _own_parameters(method: cst.FunctionDef) -> set[str]:
    """The names of ``method``'s parameters."""
    return {p.name.value for p in (*method.params.posonly_params, *method.params.params,
                                   *method.params.kwonly_params)}


class HookKind(ABC):
    """What every kind says: its marker, and whether the hook takes one argument (what
    upstream computed). ``rewrites_calls``: the kind rewrites calls inside the method
    (``CallRewrite``), all of a method's hooks at once; else it changes the method's
    returns (``ReturnHook``)."""

    marker: ClassVar[str]
    takes_result: ClassVar[bool]
    rewrites_calls: ClassVar[bool]

    def check(self, parameters: list[str], where: str) -> None:
        """The hook method's own shape (``parameters``: those after ``self``)."""
        if self.takes_result and len(parameters) != 1:
            raise SpliceError(f"{where}: the hook takes one argument, the result")


class ReturnHook(HookKind):
    """A kind that changes what happens where upstream's method returns."""

    rewrites_calls = False

    @abstractmethod
    def splice(self, method: cst.FunctionDef, hook: cst.FunctionDef,
               where: str) -> cst.FunctionDef:
        """Upstream ``method`` (libcst) with ``hook`` hooked in, as the patch writes it."""

    def live_problem(self, original: Callable[..., Any], parameters: list[str]) -> str | None:
        """Why the live upstream method ``original`` cannot take the hook, or None."""
        return None

    @abstractmethod
    def wrap(self, original: Callable[..., Any], hook: str,
             parameters: list[str]) -> Callable[..., Any]:
        """What replaces the live ``original``: does what ``splice``'s text does."""

    def _returns(self, method: cst.FunctionDef, call: str, where: str,
                 extra: list[str] | None = None
                 ) -> tuple[cst.IndentedBlock, list[cst.BaseStatement], bool]:
        """``method``'s body with its returns rewritten, its statements, and whether it
        ends in a ``return`` (``extra``: names passed after a returned value)."""
        block = method.body.visit(_ReturnRewriter(self, call, where, extra or []))
        assert isinstance(block, cst.IndentedBlock)
        statements = list(block.body)
        ends_in_return = isinstance(statements[-1], cst.SimpleStatementLine) and any(
            isinstance(s, cst.Return) for s in statements[-1].body)
        return block, statements, ends_in_return


class CallAtEndOf(ReturnHook):
    """``@call_at_end_of("m")``: ``self.<hook>(a, b)`` whenever ``m`` returns normally."""

    marker = CALL_AT_END_OF
    takes_result = False

    def splice(self, method, hook, where):
        params = hook_parameters(hook)
        if missing := [p for p in params if p not in _own_parameters(method)]:
            raise SpliceError(f"{where}: {method.name.value} has no parameter "
                              f"{', '.join(missing)}")
        call = f"self.{hook.name.value}({', '.join(params)})"
        block, statements, ends_in_return = self._returns(method, call, where)
        if not ends_in_return:
            statements.append(cst.parse_statement(f"{call}\n"))
        return method.with_changes(body=block.with_changes(body=statements))

    def live_problem(self, original, parameters):
        own = inspect.signature(original).parameters
        if missing := [p for p in parameters if p not in own]:
            return f"has no parameter {', '.join(missing)}"
        return None

    def wrap(self, original, hook, parameters):
        arguments = _arguments_named(original, parameters)

        def after(self, result, args, kwargs):
            getattr(self, hook)(*arguments(args, kwargs))
            return result

        return _returning_through(original, after)


class FilterResultOf(ReturnHook):
    """``@filter_result_of("m")``: every ``return value`` of ``m`` passes through the hook.

    The hook's first parameter after ``self`` takes the value; parameters after it name
    parameters of ``m``, which it receives too (``return self.<hook>(value, request)``;
    ``m`` must not rebind them: the runtime passes the arguments ``m`` was called with,
    as ``@call_at_end_of`` does)."""

    marker = FILTER_RESULT_OF
    takes_result = True

    def check(self, parameters, where):
        if not parameters:
            raise SpliceError(f"{where}: the hook takes the result first")

    def splice(self, method, hook, where):
        extra = hook_parameters(hook)[1:]
        if missing := [p for p in extra if p not in _own_parameters(method)]:
            raise SpliceError(f"{where}: {method.name.value} has no parameter "
                              f"{', '.join(missing)}")
        block, statements, ends_in_return = self._returns(
            method, f"self.{hook.name.value}", where, extra)
        if not ends_in_return:
            raise SpliceError(f"{where}: {method.name.value} must end in `return value`")
        return method.with_changes(body=block.with_changes(body=statements))

    def live_problem(self, original, parameters):
        own = inspect.signature(original).parameters
        if missing := [p for p in parameters[1:] if p not in own]:
            return f"has no parameter {', '.join(missing)}"
        return None

    def wrap(self, original, hook, parameters):
        arguments = _arguments_named(original, parameters[1:])

        def after(self, result, args, kwargs):
            return getattr(self, hook)(result, *arguments(args, kwargs))

        return _returning_through(original, after)


def _returning_through(
    original: Callable[..., Any], after: Callable[..., Any]
) -> Callable[..., Any]:
    """A method that calls ``original`` and returns ``after(self, result, args,
    kwargs)``; for a coroutine function a coroutine function, which ``after`` follows
    once the result is awaited, as the spliced text's does."""
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def awaiting(self, *args, **kwargs):
            return after(self, await original(self, *args, **kwargs), args, kwargs)

        return awaiting

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        return after(self, original(self, *args, **kwargs), args, kwargs)

    return wrapper


def _arguments_named(
    method: Callable[..., Any], names: list[str]
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...]]:
    """What a runtime hook receives of the arguments ``method`` was called with: the
    values of its parameters ``names``, passed by position or keyword or left to their
    defaults. Positions and defaults are read once, when the hook is installed, not
    per call: the hooked methods run every engine step, some once per request
    (``inspect.Signature.bind`` costs microseconds a call)."""
    if not names:
        return lambda args, kwargs: ()
    parameters = list(inspect.signature(method).parameters.values())[1:]  # no self
    positions = {p.name: i for i, p in enumerate(parameters)
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
    defaults = {p.name: p.default for p in parameters}
    wanted = [(name, positions.get(name), defaults[name]) for name in names]

    def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        values = []
        for name, position, default in wanted:
            if position is not None and position < len(args):
                values.append(args[position])
            elif name in kwargs:
                values.append(kwargs[name])
            elif default is not inspect.Parameter.empty:
                values.append(default)
            else:
                raise TypeError(f"{method.__qualname__}() missing argument {name!r}")
        return tuple(values)

    return arguments


class CallRewrite(HookKind):
    """A kind that rewrites each call of a callee inside upstream's method; all of a
    method's call rewrites are one pass (``filter_calls``), in the splice and at runtime."""

    rewrites_calls = True
    # The call goes to the hook instead (no other hook may then take that callee).
    replaces_call: ClassVar[bool]

    @abstractmethod
    def rewrite_call(self, call: cst.BaseExpression, hook_call: str) -> cst.BaseExpression:
        """``call`` (the callee's call, as earlier hooks left it) rewritten for the hook
        ``hook_call`` (``self.<hook>``)."""

    def hook_call(self, hook: str, parameters: list[str]) -> str:
        """How the rewritten method names the hook method ``hook``."""
        return f"self.{hook}"


class FilterCallIn(CallRewrite):
    """``@filter_call_in("m", "c")``: ``c(...)`` in ``m`` becomes ``self.<hook>(c(...))``."""

    marker = FILTER_CALL_IN
    takes_result = True
    replaces_call = False

    def rewrite_call(self, call, hook_call):
        return cst.parse_expression(f"{hook_call}(_)").with_changes(args=[cst.Arg(call)])


class RedirectCallIn(CallRewrite):
    """``@redirect_call_in("m", "c")``: ``c(...)`` in ``m`` becomes ``self.<hook>(...)``."""

    marker = REDIRECT_CALL_IN
    takes_result = False
    replaces_call = True

    def rewrite_call(self, call, hook_call):
        assert isinstance(call, cst.Call)
        return call.with_changes(func=cst.parse_expression(hook_call))


class GuardBranchIn(CallRewrite):
    """``@guard_branch_in("m", "c")``: each ``if`` branch of ``m`` that calls ``c`` as one
    of its own statements, and ends in ``continue``, starts with
    ``if not self.<hook>(a, b): continue``; the hook's parameters name variables of ``m``.

    The call itself is left as it is: the branch runs it only when the hook returns true.
    Guards of several fixes on one branch compose in series order, the later fix's
    asked first."""

    marker = GUARD_BRANCH_IN
    takes_result = False
    replaces_call = False

    def rewrite_call(self, call, hook_call):
        return call

    def hook_call(self, hook, parameters):
        return f"self.{hook}({', '.join(parameters)})"

    def guard(self, branch: cst.If, hook_call: str, where: str) -> cst.If:
        """``branch`` (an ``if`` whose own statements call the callee) guarded by the hook."""
        body = branch.body
        last = body.body[-1] if isinstance(body, cst.IndentedBlock) else None
        if not (isinstance(last, cst.SimpleStatementLine)
                and isinstance(last.body[-1], cst.Continue)):
            raise SpliceError(f"{where}: the branch must end in `continue` to be guarded")
        check = cst.parse_statement(f"if not {hook_call}:\n    continue\n")
        return branch.with_changes(body=body.with_changes(body=[check, *body.body]))


HOOK_KINDS: Mapping[str, ReturnHook | CallRewrite] = {
    kind.marker: kind for kind in (CallAtEndOf(), FilterResultOf(), FilterCallIn(),
                                   RedirectCallIn(), GuardBranchIn())}


# ---------------------------------------------------------------- the libcst rewrites


class _OwnScopeTransformer(cst.CSTTransformer):
    """Visits one function body; ``nested`` is how deep inside a function, class or
    lambda defined in it a node is (0: the body's own code)."""

    def __init__(self) -> None:
        self.nested = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.nested += 1
        return True

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.nested -= 1
        return updated

    visit_ClassDef = visit_FunctionDef  # type: ignore[assignment]
    leave_ClassDef = leave_FunctionDef  # type: ignore[assignment]
    visit_Lambda = visit_FunctionDef  # type: ignore[assignment]
    leave_Lambda = leave_FunctionDef  # type: ignore[assignment]


class _ReturnRewriter(_OwnScopeTransformer):
    """Rewrites the ``return`` statements of one function body, not of nested scopes."""

    def __init__(self, kind: ReturnHook, call: str, where: str, extra: list[str]) -> None:
        super().__init__()
        self.kind, self.call, self.where, self.extra = kind, call, where, extra

    def leave_SimpleStatementSuite(self, original, updated):
        if not self.nested and any(isinstance(s, cst.Return) for s in updated.body):
            raise SpliceError(f"{self.where}: a one-line `...: return` can't take a hook; "
                              "amend the method instead")
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        returns = [s for s in updated.body if isinstance(s, cst.Return)]
        if self.nested or not returns:
            return updated
        (statement,) = returns
        if self.kind.takes_result:
            if statement.value is None:
                raise SpliceError(f"{self.where}: a bare `return` can't pass a result through "
                                  "the hook")
            result = statement.value
            if isinstance(result, cst.Tuple) and not result.lpar:
                # `return a, b` passes one tuple: `self.hook((a, b))`.
                result = result.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            value = cst.parse_expression(f"{self.call}(_)").with_changes(
                args=[cst.Arg(result), *(cst.Arg(cst.Name(name)) for name in self.extra)])
            return updated.with_changes(body=[*updated.body[:-1], statement.with_changes(
                value=value, whitespace_after_return=cst.SimpleWhitespace(" "))])
        if statement.value is not None:
            raise SpliceError(f"{self.where}: it returns a value; use @filter_result_of")
        call = cst.parse_statement(f"{self.call}\n")
        return cst.FlattenSentinel([call.with_changes(leading_lines=updated.leading_lines),
                                    updated.with_changes(leading_lines=[])])


@dataclasses.dataclass(frozen=True)
class CallPattern:
    """The calls a call hook takes, as its marker writes them: ``c`` (every call whose
    callee is written ``c``) or ``c(k=...)`` (only those that pass keyword ``k``: a
    hook that concerns one call site of a callee leaves the others as they are)."""

    written: str
    callee: str
    keyword: str | None

    @classmethod
    def parse(cls, written: str, where: str) -> CallPattern:
        try:
            expression = cst.parse_expression(written)
        except cst.ParserSyntaxError as exc:
            raise SpliceError(f"{where}: {written!r} is not a callee or a call") from exc
        if not isinstance(expression, cst.Call):
            return cls(written, written, None)
        keywords = [arg for arg in expression.args if arg.keyword is not None]
        if len(expression.args) != 1 or len(keywords) != 1 or \
                not isinstance(keywords[0].value, cst.Ellipsis):
            raise SpliceError(f"{where}: {written!r}: a call pattern names one keyword, "
                              "as c(k=...)")
        assert keywords[0].keyword is not None
        return cls(written, _code(expression.func), keywords[0].keyword.value)

    def matches(self, call: cst.Call) -> bool:
        return _code(call.func) == self.callee and (self.keyword is None or any(
            arg.keyword is not None and arg.keyword.value == self.keyword
            for arg in call.args))


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


class _CallFilter(_OwnScopeTransformer):
    """Rewrites every call the hooks' patterns match in one function body (not in nested
    scopes): a redirect sends the call to its hook instead (same arguments), a filter
    wraps it in its hook, in order, the first innermost (the splice leaves the layout
    to ruff: ``patch_writer.format_changes``). A guarded call stays;
    the ``if`` branch it is a statement of starts with its guards (``guarded`` counts
    those calls)."""

    def __init__(self, hooks: dict[CallPattern, list[tuple[str, CallRewrite]]],
                 where: str) -> None:
        super().__init__()
        # pattern -> (hook call, kind), in order: the call rewrites, and the guards.
        self.hooks = {pattern: [(h, k) for h, k in each if not isinstance(k, GuardBranchIn)]
                      for pattern, each in hooks.items()}
        self.guards = {pattern: [(h, k) for h, k in each if isinstance(k, GuardBranchIn)]
                       for pattern, each in hooks.items()}
        self.calls: dict[CallPattern, int] = dict.fromkeys(hooks, 0)
        self.guarded: dict[CallPattern, int] = dict.fromkeys(hooks, 0)
        self.where = where

    def _matching(self, call: cst.Call) -> list[CallPattern]:
        """The patterns ``call`` matches; refused where one redirects it and another
        hooks it too (a redirected call takes no other hook)."""
        patterns = [pattern for pattern in self.hooks if pattern.matches(call)]
        if len(patterns) > 1 and any(kind.replaces_call for pattern in patterns
                                     for _, kind in self.hooks[pattern]):
            raise SpliceError(f"{self.where}: {_code(call.func)} is redirected and hooked "
                              "again; a redirected call takes no other hook")
        return patterns

    def leave_If(self, original: cst.If, updated: cst.If) -> cst.If:
        if self.nested or not isinstance(original.body, cst.IndentedBlock):
            return updated
        guarded: dict[CallPattern, None] = {}
        for statement in original.body.body:
            call = statement.body[0].value if isinstance(statement, cst.SimpleStatementLine) \
                and isinstance(statement.body[0], cst.Expr) else None
            if not isinstance(call, cst.Call):
                continue
            for pattern in self._matching(call):
                if self.guards[pattern]:
                    self.guarded[pattern] += 1
                    guarded[pattern] = None
        for pattern in guarded:  # once per branch, however often it makes the call
            for hook_call, kind in self.guards[pattern]:
                assert isinstance(kind, GuardBranchIn)
                updated = kind.guard(updated, hook_call, self.where)
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        if self.nested:
            return updated
        wrapped: cst.BaseExpression = updated
        for pattern in self._matching(original):
            self.calls[pattern] += 1
            for hook_call, kind in self.hooks[pattern]:
                wrapped = kind.rewrite_call(wrapped, hook_call)
        return wrapped


# (upstream class, method) -> the (callee, hook, kind, hook parameters) of its call
# rewrites (@filter_call_in, @redirect_call_in, @guard_branch_in), in series order: what
# one rewrite of that method applies.
CallFilters = dict[tuple[str, str], list[tuple[str, str, CallRewrite, list[str]]]]


def group_call_filters(hooks: Iterable[tuple[str, tuple[str, ...], str, list[str]]]
                       ) -> CallFilters:
    """The call rewrites of ``hooks`` ((upstream class, hook marker, hook method, its
    parameters after ``self``) in series order) grouped per method, so that each method
    is rewritten once with all of them: two filters of one callee compose, the earlier
    fix's innermost."""
    grouped: CallFilters = {}
    for cls, marker, hook, parameters in hooks:
        kind = HOOK_KINDS[marker[0]]
        if isinstance(kind, CallRewrite):
            grouped.setdefault((cls, marker[1]), []).append((marker[2], hook, kind, parameters))
    return grouped


def filter_calls(function: cst.FunctionDef,
                 filters: list[tuple[str, str, CallRewrite, list[str]]], where: str
                 ) -> cst.FunctionDef:
    """``function`` with each call in its body that a hook's pattern matches rewritten
    (``CallPattern``: ``c`` or ``c(k=...)``), for each ``(pattern, hook, kind,
    parameters)`` of ``filters`` in order:
    ``self.<hook>(c(...))`` (``@filter_call_in``; a later filter of the same callee wraps
    the earlier: ``self.<h2>(self.<h1>(c(...)))``) or, for a redirect, ``self.<hook>(...)``
    (``@redirect_call_in``; a redirected callee takes no other hook); for a guard
    (``@guard_branch_in``) the call stays and the ``if`` branch it is a statement of starts
    with ``if not self.<hook>(<parameters>): continue``. The one rewrite of these kinds:
    the splice and the runtime apply all of a method's with it, in one pass."""
    hooks: dict[CallPattern, list[tuple[str, CallRewrite]]] = {}
    variables = _variables(function)
    for written, hook, kind, parameters in filters:
        if isinstance(kind, GuardBranchIn) and (
                unknown := [name for name in parameters if name not in variables]):
            raise SpliceError(f"{where}: {function.name.value} has no variable "
                              f"{', '.join(unknown)}")
        hooks.setdefault(CallPattern.parse(written, where), []).append(
            (kind.hook_call(hook, parameters), kind))
    if shared := [pattern.callee for pattern, each in hooks.items()
                  if len(each) > 1 and any(kind.replaces_call for _, kind in each)]:
        raise SpliceError(f"{where}: {', '.join(shared)} is redirected and hooked again; "
                          "a redirected call takes no other hook")
    rewriter = _CallFilter(hooks, where)
    body = function.body.visit(rewriter)
    if missing := [p.written for p, calls in rewriter.calls.items() if not calls]:
        raise SpliceError(f"{where}: {function.name.value} makes no call of {', '.join(missing)}")
    if unguarded := [p.written for p, each in rewriter.guards.items()
                     if each and rewriter.guarded[p] != rewriter.calls[p]]:
        raise SpliceError(f"{where}: {function.name.value} calls {', '.join(unguarded)} "
                          "other than as a statement of an `if` branch")
    assert isinstance(body, cst.BaseSuite)
    return function.with_changes(body=body)


def _variables(function: cst.FunctionDef) -> set[str]:
    """The names ``function`` mentions (its parameters, its variables): what a guard may
    pass to its hook."""
    return {name.value for name in m.findall(function, m.Name())}
