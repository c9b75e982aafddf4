"""Splice overlay definitions into an upstream module with libcst.

Everything the overlay does not name stays byte-identical: only the named top-level
definitions and class members are replaced or inserted, and only the imports the
spliced code uses and upstream lacks are added.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_patches._errors import UserError
from vllm_patches._overlay import (
    ADD,
    AMEND,
    CALL_AT_END_OF,
    CALL_REWRITES,
    FILTER_CALL_IN,
    FILTER_RESULT_OF,
    HOOKS,
    REDIRECT_CALL_IN,
)
from vllm_patches._series import describe_releases

MARKERS = {AMEND, ADD}
# ruff's default line length, which vLLM keeps: the spliced text must pass ruff format.
LINE_LENGTH = 88
# A partial class's own docstring describes the overlay; ``__doc__ = """..."""``
# replaces the upstream class docstring.
DOCSTRING_MEMBER = "__doc__"
OWN_PACKAGE = "vllm_patches"


class SpliceError(UserError):
    """An overlay names something the upstream module does not have (or already has)."""


@dataclass(frozen=True)
class OverlayDefinition:
    """One marked top-level definition of an overlay module."""

    kind: str  # AMEND or ADD
    fix: str
    releases: SpecifierSet
    node: cst.ClassDef | cst.FunctionDef  # marker decorators already removed
    source: Path  # the overlay file it is written in
    position: int  # its index among the top-level definitions of ``source``
    into: Path | None = None  # the overlay whose upstream module receives it, if not source
    target: str | None = None  # the upstream class an @amend(..., name=...) partial amends

    @property
    def name(self) -> str:
        """The upstream name it replaces, amends or adds."""
        return self.target or self.node.name.value

    def partial_members(self) -> set[str | None]:
        """Names of the members an amended class sets; {None} for anything else.

        Two partial classes of one fix may hold the same release when their
        members differ: members shared by every release live in one, the
        members that differ per release in narrower ones beside it.
        """
        if self.kind != AMEND or not isinstance(self.node, cst.ClassDef):
            return {None}
        return {_member_name(m) for m in self.node.body.body if not _is_docstring(m)}


@dataclass(frozen=True)
class Overlay:
    """A parsed overlay module: its marked definitions and the imports they may need."""

    path: Path
    definitions: tuple[OverlayDefinition, ...]
    imports: tuple[cst.SimpleStatementLine, ...]

    @classmethod
    def parse(cls, path: Path, others: Iterable[Path] = ()) -> Overlay:
        """The definitions spliced into ``path``'s upstream module: those written in
        ``path``, and those the overlay files ``others`` add ``into`` it, with the
        imports of the files they are written in."""
        definitions, imports = _parse_file(path)
        own = [d for d in definitions if d.into is None]
        imports = list(imports)
        target = path.resolve()
        for other in others:
            if other.resolve() == target:
                continue
            foreign, foreign_imports = _parse_file(other)
            sent = [d for d in foreign if d.into == target]
            if sent:
                own += sent
                imports += foreign_imports
        return cls(path, tuple(own), tuple(imports))

    def fixes(self) -> set[str]:
        return {d.fix for d in self.definitions}

    def select(self, fixes: list[str], release: Version) -> list[OverlayDefinition]:
        """The definitions of ``fixes`` whose range holds ``release``, in series order."""
        chosen = [d for d in self.definitions if d.fix in fixes and release in d.releases]
        for i, first in enumerate(chosen):
            for second in chosen[i + 1 :]:
                if (first.fix, first.name) == (second.fix, second.name) and not (
                    first.partial_members().isdisjoint(second.partial_members())
                ):
                    raise SpliceError(
                        f"{self.path}: two variants of {first.fix} {first.name} "
                        f"hold v{release} ({describe_releases(first.releases)} and "
                        f"{describe_releases(second.releases)})"
                    )
        return sorted(chosen, key=lambda d: fixes.index(d.fix))


@dataclass(frozen=True)
class UnstartedBound:
    """An upper bound ``<end`` of a marker's range where no other variant of the same
    definition starts: it can only be "the newest release verified", which is the
    series' (``Series.newest``), written once."""

    definition: OverlayDefinition
    end: Version

    def __str__(self) -> str:
        d = self.definition
        return (f"{d.source}: @{d.kind}({d.fix!r}, {describe_releases(d.releases)!r}) on "
                f"{d.node.name.value}: the upper bound <{self.end} starts no other variant "
                f"of {d.name}; a marker says where a variant starts (the newest release "
                "verified is series.toml's last covered one)")


def unstarted_bounds(paths: Iterable[Path]) -> list[UnstartedBound]:
    """Every upper bound in the markers of the overlay files ``paths`` that is not where
    another variant of the same definition starts. Variants of one definition: the
    markers of one fix linked, directly or through others, by sitting on one node or by
    naming one class or function (a partial class written for several layouts with
    ``name=``, a class upstream split). Only ``>=start`` and ``<end`` clauses are
    accepted."""
    definitions = [d for path in dict.fromkeys(paths) for d in _parse_file(path)[0]]
    groups: list[tuple[set[object], list[OverlayDefinition]]] = []
    for definition in definitions:
        keys = {(definition.fix, definition.source, definition.position),
                (definition.fix, definition.node.name.value), (definition.fix, definition.name)}
        linked = [group for group in groups if group[0] & keys]
        for group in linked:
            groups.remove(group)
            keys |= group[0]
        groups.append((keys, [definition, *(d for group in linked for d in group[1])]))
    found = []
    for _, variants in groups:
        for definition in variants:
            starts = {Version(clause.version) for other in variants if other is not definition
                      for clause in other.releases if clause.operator == ">="}
            for clause in definition.releases:
                if clause.operator not in (">=", "<"):
                    raise SpliceError(f"{definition.source}: {definition.node.name.value}: "
                                      f"{clause} in a marker; a range is >=start[,<end]")
                if clause.operator == "<" and Version(clause.version) not in starts:
                    found.append(UnstartedBound(definition, Version(clause.version)))
    return found


def check_bounds(paths: Iterable[Path]) -> None:
    """Refuse a marker bound that is merely the newest verified release (see
    ``unstarted_bounds``)."""
    for bound in unstarted_bounds(paths):
        raise SpliceError(str(bound))


def _parse_file(path: Path) -> tuple[tuple[OverlayDefinition, ...],
                                     tuple[cst.SimpleStatementLine, ...]]:
    """The marked definitions (one per marker) and the imports of one overlay file."""
    return _parse_source(path, path.read_text())


@functools.cache
def _parse_source(path: Path, source: str) -> tuple[tuple[OverlayDefinition, ...],
                                                    tuple[cst.SimpleStatementLine, ...]]:
    module = cst.parse_module(source)
    definitions: list[OverlayDefinition] = []
    imports: list[cst.SimpleStatementLine] = []
    position = 0
    for statement in module.body:
        if _is_import(statement):
            if not _imports_from(statement, (OWN_PACKAGE, "__future__")):
                imports.append(statement)
        elif isinstance(statement, (cst.ClassDef, cst.FunctionDef)):
            definitions += _parse_definition(path, statement, position)
            position += 1
    return tuple(definitions), tuple(imports)


def _parse_definition(path: Path, node: cst.ClassDef | cst.FunctionDef,
                      position: int) -> list[OverlayDefinition]:
    markers = [d for d in node.decorators if _decorator_name(d) in MARKERS]
    kinds = {_decorator_name(d) for d in markers}
    if not markers or len(kinds) > 1:
        raise SpliceError(
            f"{path}: {node.name.value} needs @amend(...) or @add(...) markers of one kind"
        )
    bare = node.with_changes(decorators=[d for d in node.decorators if d not in markers])
    definitions = []
    for marker in markers:
        args = _string_args(path, marker, ("fix", "releases"), optional=("into", "name"))
        into = (path.parent / args["into"]).resolve() if "into" in args else None
        if into is not None and not into.is_file():
            raise SpliceError(f"{path}: {node.name.value}: into={args['into']!r} is no overlay")
        if "name" in args and (kinds != {AMEND} or not isinstance(node, cst.ClassDef)):
            raise SpliceError(f"{path}: {node.name.value}: name= is for @amend partial classes")
        definitions.append(OverlayDefinition(
            kind=_decorator_name(marker), fix=args["fix"], releases=SpecifierSet(args["releases"]),
            node=bare, source=path, position=position, into=into, target=args.get("name")))
    return definitions


def _decorator_name(decorator: cst.Decorator) -> str | None:
    target = decorator.decorator
    if isinstance(target, cst.Call):
        target = target.func
    return target.value if isinstance(target, cst.Name) else None


def _string_args(path: Path, decorator: cst.Decorator, names: tuple[str, ...],
                 optional: tuple[str, ...] = ()) -> dict[str, str]:
    call = decorator.decorator
    if not isinstance(call, cst.Call):
        raise SpliceError(f"{path}: @{_decorator_name(decorator)} must be called with arguments")
    values: dict[str, str] = {}
    for position, arg in enumerate(call.args):
        key = arg.keyword.value if arg.keyword else names[position]
        if not isinstance(arg.value, cst.SimpleString):
            raise SpliceError(f"{path}: @{_decorator_name(decorator)} takes string literals only")
        values[key] = arg.value.evaluated_value
    if not set(names) <= set(values) <= set(names + optional):
        raise SpliceError(f"{path}: @{_decorator_name(decorator)} needs {', '.join(names)}")
    return values


def _is_import(statement: cst.CSTNode) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and isinstance(
        statement.body[0], (cst.Import, cst.ImportFrom)
    )


def _imports_from(statement: cst.SimpleStatementLine, packages: tuple[str, ...]) -> bool:
    node = statement.body[0]
    if isinstance(node, cst.ImportFrom):
        if node.relative or node.module is None:
            return False
        dotted = cst.Module([]).code_for_node(node.module)
        return dotted.split(".")[0] in packages
    return False


def _bound_names(statement: cst.SimpleStatementLine) -> list[tuple[str, cst.ImportAlias]]:
    """(name the import binds, its alias node) for each alias of an import statement."""
    node = statement.body[0]
    assert isinstance(node, (cst.Import, cst.ImportFrom))
    assert not isinstance(node.names, cst.ImportStar), "star imports are not supported"
    bound = []
    for alias in node.names:
        if alias.asname is not None:
            bound.append((alias.asname.name.value, alias))
        else:
            dotted = cst.Module([]).code_for_node(alias.name)
            bound.append((dotted.split(".")[0], alias))
    return bound


def _member_name(node: cst.CSTNode) -> str | None:
    if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
        return node.name.value
    if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1:
        small = node.body[0]
        target = None
        if isinstance(small, cst.AnnAssign):
            target = small.target
        elif isinstance(small, cst.Assign) and len(small.targets) == 1:
            target = small.targets[0].target
        if isinstance(target, cst.Name):
            return target.value
    return None


def _is_docstring(node: cst.CSTNode) -> bool:
    return (
        isinstance(node, cst.SimpleStatementLine)
        and isinstance(node.body[0], cst.Expr)
        and isinstance(node.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _comment_lines(node: cst.CSTNode) -> list[cst.EmptyLine]:
    return [line for line in getattr(node, "leading_lines", ()) if line.comment is not None]


def _with_leading(blank: list[cst.EmptyLine], own: cst.CSTNode) -> cst.CSTNode:
    """``own`` with the blank lines ``blank`` and ``own``'s comment lines in front."""
    return own.with_changes(leading_lines=[*blank, *_comment_lines(own)])


def _blank_lines(node: cst.CSTNode) -> list[cst.EmptyLine]:
    return [line for line in getattr(node, "leading_lines", ()) if line.comment is None]


class _NameCollector(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)


def _used_names(nodes: list[cst.CSTNode]) -> set[str]:
    collector = _NameCollector()
    for node in nodes:
        node.visit(collector)
    return collector.names


def _module_bindings(module: cst.Module) -> set[str]:
    """Names bound unconditionally at the top level of ``module``."""
    bound: set[str] = set()
    for statement in module.body:
        name = _member_name(statement)
        if name:
            bound.add(name)
        elif _is_import(statement) and not isinstance(statement.body[0].names, cst.ImportStar):
            bound.update(name for name, _ in _bound_names(statement))
    return bound


def _amend_class(upstream: cst.ClassDef, overlay: cst.ClassDef, path: Path,
                 call_filters: CallFilters) -> cst.ClassDef:
    """Replace same-named members in place; insert new ones next to the replaced ones.

    New members that precede a replaced member in the overlay are inserted right
    before it; new members after the last replaced one follow it; with no replaced
    member at all they go to the end of the class.
    """
    body = list(upstream.body.body)
    index = {_member_name(node): i for i, node in enumerate(body) if _member_name(node)}
    pending: list[cst.CSTNode] = []
    cursor = len(body)
    hooks: list[tuple[tuple[str, ...], cst.FunctionDef]] = []
    for member in overlay.body.body:
        if _is_docstring(member):
            continue
        name = _member_name(member)
        if name is None:
            raise SpliceError(f"{path}: {overlay.name.value} holds a statement that names nothing")
        member, hook = _strip_hook(member)
        if hook:
            hooks.append((hook, member))
        if name == DOCSTRING_MEMBER:
            body = _replace_docstring(body, member)
            index = {_member_name(n): i for i, n in enumerate(body) if _member_name(n)}
            continue
        if name in index:
            position = index[name]
            replaced = body[position]
            body[position] = _with_leading(_blank_lines(replaced), member)
            body[position:position] = pending
            cursor = position + len(pending) + 1
            pending = []
            index = {_member_name(n): i for i, n in enumerate(body) if _member_name(n)}
        else:
            pending.append(_with_leading([cst.EmptyLine(indent=False)], member))
    body[cursor:cursor] = pending
    amended = upstream.with_changes(body=upstream.body.with_changes(body=body))
    for marker, hook in hooks:
        amended = _hook_into(amended, marker, hook, path, call_filters)
    return amended


def _replace_docstring(body: list[cst.CSTNode], member: cst.CSTNode) -> list[cst.CSTNode]:
    """``__doc__ = "..."`` in a partial class: that string becomes the class docstring."""
    assert isinstance(member, cst.SimpleStatementLine)
    assignment = member.body[0]
    assert isinstance(assignment, (cst.Assign, cst.AnnAssign))
    docstring = cst.SimpleStatementLine([cst.Expr(assignment.value)])
    if body and _is_docstring(body[0]):
        return [docstring.with_changes(leading_lines=body[0].leading_lines), *body[1:]]
    return [docstring, *body]


def _strip_hook(member: cst.CSTNode) -> tuple[cst.CSTNode, tuple[str, ...] | None]:
    """``member`` without its hook marker, and the marker's (kind, *string arguments)
    if it had one: (kind, upstream method) or (kind, upstream method, callee)."""
    if not isinstance(member, cst.FunctionDef):
        return member, None
    for decorator in member.decorators:
        kind = _decorator_name(decorator)
        if kind in HOOKS:
            call = decorator.decorator
            assert isinstance(call, cst.Call) and all(
                isinstance(arg.value, cst.SimpleString) for arg in call.args)
            arguments = tuple(arg.value.evaluated_value for arg in call.args)  # type: ignore[union-attr]
            kept = [d for d in member.decorators if d is not decorator]
            return member.with_changes(decorators=kept), (kind, *arguments)
    return member, None


def hook_parameters(hook: cst.FunctionDef) -> list[str]:
    """The parameters of a hook method after ``self``: names of its target's parameters."""
    return [param.name.value for param in hook.params.params[1:]]


class _Reindent(cst.CSTTransformer):
    """Indents every continuation line of an expression by four more spaces."""

    def leave_ParenthesizedWhitespace(self, original, updated):
        return updated.with_changes(
            last_line=cst.SimpleWhitespace(updated.last_line.value + "    "))


def _one_argument_per_line(call: cst.Call) -> cst.Call:
    """``f(<multi-line arg>)`` the way ruff formats it: the argument on lines of its own,
    four spaces deeper, and ``)`` back at the statement's indentation."""
    (arg,) = call.args
    def line(indent: str) -> cst.ParenthesizedWhitespace:
        return cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(indent))
    return call.with_changes(
        whitespace_before_args=line("    "),
        args=[arg.with_changes(value=arg.value.visit(_Reindent()),
                               whitespace_after_arg=line(""))])


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

    def __init__(self, kind: str, call: str, where: str) -> None:
        super().__init__()
        self.kind, self.call, self.where = kind, call, where
        self.returns = 0

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
        self.returns += 1
        if self.kind == FILTER_RESULT_OF:
            if statement.value is None:
                raise SpliceError(f"{self.where}: a bare `return` can't pass a result through "
                                  "the hook")
            result = statement.value
            if isinstance(result, cst.Tuple) and not result.lpar:
                # `return a, b` passes one tuple: `self.hook((a, b))`.
                result = result.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            value = cst.parse_expression(f"{self.call}(_)").with_changes(
                args=[cst.Arg(result)])
            if "\n" in cst.Module([]).code_for_node(result):
                value = _one_argument_per_line(value)
            return updated.with_changes(body=[*updated.body[:-1], statement.with_changes(
                value=value, whitespace_after_return=cst.SimpleWhitespace(" "))])
        if statement.value is not None:
            raise SpliceError(f"{self.where}: it returns a value; use @filter_result_of")
        call = cst.parse_statement(f"{self.call}\n")
        return cst.FlattenSentinel([call.with_changes(leading_lines=updated.leading_lines),
                                    updated.with_changes(leading_lines=[])])


class _CallFilter(_OwnScopeTransformer):
    """Rewrites every call of the hooked callees in one function body (not in nested
    scopes): a redirect sends the call to its hook instead (same arguments), a filter
    wraps it in its hook, in order, the first innermost; a wrapped call that makes its
    line longer than ``line_length`` (when given) is laid out as ruff lays it out, the
    argument of the outermost hook on a line of its own."""

    def __init__(self, hooks: dict[str, list[tuple[str, bool]]], lines: list[str],
                 column: int, positions: Mapping[cst.CSTNode, CodeRange],
                 line_length: int | None) -> None:
        super().__init__()
        self.hooks = hooks  # callee -> (hook call, redirect), in order
        self.calls: dict[str, int] = dict.fromkeys(hooks, 0)
        self.lines, self.column, self.positions = lines, column, positions
        self.line_length = line_length

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        callee = cst.Module([]).code_for_node(original.func)
        if self.nested or callee not in self.hooks:
            return updated
        self.calls[callee] += 1
        wrapped: cst.BaseExpression = updated
        for hook_call, redirect in self.hooks[callee]:
            if redirect:
                wrapped = updated.with_changes(func=cst.parse_expression(hook_call))
            else:
                wrapped = cst.parse_expression(f"{hook_call}(_)").with_changes(
                    args=[cst.Arg(wrapped)])
        if wrapped is not updated and self._too_long(original, callee) and not \
                self.hooks[callee][-1][1]:
            assert isinstance(wrapped, cst.Call)
            wrapped = _one_argument_per_line(wrapped)
        return wrapped

    def _too_long(self, original: cst.Call, callee: str) -> bool:
        """Whether rewriting ``original`` (on one line) makes its line too long."""
        where = self.positions[original]
        if self.line_length is None or where.start.line != where.end.line:
            return False
        added = sum(len(hook_call) - len(callee) if redirect else len(hook_call) + 2
                    for hook_call, redirect in self.hooks[callee])
        line = self.lines[where.start.line - 1]
        return self.column + len(line) + added > self.line_length


# (upstream class, method) -> the (callee, hook, redirect) of its @filter_call_in and
# @redirect_call_in hooks, in series order: what one rewrite of that method applies.
CallFilters = dict[tuple[str, str], list[tuple[str, str, bool]]]


def group_call_filters(hooks: Iterable[tuple[str, tuple[str, ...], str]]) -> CallFilters:
    """The call rewrites of ``hooks`` ((upstream class, hook marker, hook method) in
    series order) grouped per method, so that each method is rewritten once with all
    of them: two filters of one callee compose, the earlier fix's innermost."""
    grouped: CallFilters = {}
    for cls, marker, hook in hooks:
        if marker[0] in CALL_REWRITES:
            grouped.setdefault((cls, marker[1]), []).append(
                (marker[2], hook, marker[0] == REDIRECT_CALL_IN))
    return grouped


def filter_calls(function: cst.FunctionDef, filters: list[tuple[str, str, bool]], where: str,
                 column: int = 0, line_length: int | None = None) -> cst.FunctionDef:
    """``function`` with each call ``c(...)`` of a hooked callee in its body rewritten,
    for each ``(callee, hook, redirect)`` of ``filters`` in order: ``self.<hook>(c(...))``
    (``@filter_call_in``; a later filter of the same callee wraps the earlier:
    ``self.<h2>(self.<h1>(c(...)))``) or, with ``redirect``, ``self.<hook>(...)``
    (``@redirect_call_in``; a redirected callee takes no other hook). The one rewrite
    of both kinds: the splice and the runtime apply all of a method's with it, in one
    pass.

    ``column``: where ``function``'s ``def`` starts; with ``line_length`` (the splice:
    the text must pass ruff format), a line that the hooks make too long is split."""
    hooks: dict[str, list[tuple[str, bool]]] = {}
    for callee, hook, redirect in filters:
        hooks.setdefault(callee, []).append((f"self.{hook}", redirect))
    if shared := [callee for callee, each in hooks.items()
                  if len(each) > 1 and any(redirect for _, redirect in each)]:
        raise SpliceError(f"{where}: {', '.join(shared)} is redirected and hooked again; "
                          "a redirected call takes no other hook")
    alone = cst.Module(body=[function])
    positions = MetadataWrapper(alone, unsafe_skip_copy=True).resolve(PositionProvider)
    rewriter = _CallFilter(hooks, alone.code.splitlines(), column, positions, line_length)
    body = function.body.visit(rewriter)
    if missing := [callee for callee, calls in rewriter.calls.items() if not calls]:
        raise SpliceError(f"{where}: {function.name.value} makes no call of {', '.join(missing)}")
    assert isinstance(body, cst.BaseSuite)
    return function.with_changes(body=body)


def _hook_into(cls: cst.ClassDef, marker: tuple[str, ...], hook: cst.FunctionDef,
               path: Path, call_filters: CallFilters) -> cst.ClassDef:
    """Hook the new method ``hook`` into ``cls.<target>`` (see ``_overlay``).

    The first call filter of a method rewrites it with all of ``call_filters``' filters
    of that method (and takes them out); the later ones find their calls in place."""
    kind, target = marker[:2]
    where = f"{path}: @{kind}({target!r}) on {cls.name.value}.{hook.name.value}"
    body = list(cls.body.body)
    for i, node in enumerate(body):
        if isinstance(node, cst.FunctionDef) and node.name.value == target:
            break
    else:
        raise SpliceError(f"{where}: {cls.name.value} has no {target}")
    params = hook_parameters(hook)
    name = hook.name.value
    if kind in (FILTER_RESULT_OF, FILTER_CALL_IN) and len(params) != 1:
        raise SpliceError(f"{where}: the hook takes one argument, the result")
    if kind in CALL_REWRITES:
        filters = call_filters.pop((cls.name.value, target), None)
        if filters is not None:
            column = len(cls.body.indent if cls.body.indent is not None else "    ")
            body[i] = filter_calls(node, filters, where, column, LINE_LENGTH)
        return cls.with_changes(body=cls.body.with_changes(body=body))
    if kind == FILTER_RESULT_OF:
        rewriter = _ReturnRewriter(kind, f"self.{name}", where)
    else:
        own = {p.name.value for p in (*node.params.posonly_params, *node.params.params,
                                      *node.params.kwonly_params)}
        if missing := [p for p in params if p not in own]:
            raise SpliceError(f"{where}: {target} has no parameter {', '.join(missing)}")
        rewriter = _ReturnRewriter(kind, f"self.{name}({', '.join(params)})", where)
    block = node.body.visit(rewriter)
    assert isinstance(block, cst.IndentedBlock)
    statements = list(block.body)
    ends_in_return = isinstance(statements[-1], cst.SimpleStatementLine) and any(
        isinstance(s, cst.Return) for s in statements[-1].body)
    if kind == FILTER_RESULT_OF and not ends_in_return:
        raise SpliceError(f"{where}: {target} must end in `return value`")
    if kind == CALL_AT_END_OF and not ends_in_return:
        statements.append(cst.parse_statement(f"{rewriter.call}\n"))
    body[i] = node.with_changes(body=block.with_changes(body=statements))
    return cls.with_changes(body=cls.body.with_changes(body=body))


def _hooks(definitions: list[OverlayDefinition]) -> Iterable[tuple[str, tuple[str, ...], str]]:
    """(upstream class, hook marker, hook method) of each hook of ``definitions``, in order."""
    for definition in definitions:
        if definition.kind == AMEND and isinstance(definition.node, cst.ClassDef):
            for member in definition.node.body.body:
                marker = _strip_hook(member)[1]
                if marker:
                    yield definition.name, marker, member.name.value  # type: ignore[attr-defined]


def splice(upstream_source: str, definitions: list[OverlayDefinition],
           imports: tuple[cst.SimpleStatementLine, ...], path: Path) -> str:
    """``upstream_source`` with ``definitions`` spliced in, in order."""
    module = cst.parse_module(upstream_source)
    body = list(module.body)
    call_filters = group_call_filters(_hooks(definitions))
    top = {_member_name(node): i for i, node in enumerate(body) if _member_name(node)}
    for definition in definitions:
        name = definition.name
        node = definition.node
        if definition.kind == ADD:
            if name in top:
                raise SpliceError(f"{path}: @add {name}, but upstream already defines it")
            body.append(_with_leading([cst.EmptyLine(indent=False), cst.EmptyLine(indent=False)], node))
            top[name] = len(body) - 1
            continue
        if name not in top:
            raise SpliceError(f"{path}: @amend {name}, but upstream has no such definition")
        position = top[name]
        current = body[position]
        if isinstance(node, cst.ClassDef):
            if not isinstance(current, cst.ClassDef):
                raise SpliceError(f"{path}: @amend class {name}, but upstream {name} is no class")
            body[position] = _amend_class(current, node, path, call_filters)
        else:
            body[position] = _with_leading(_blank_lines(current), node)
    module = module.with_changes(body=body)
    return _add_imports(module, [d.node for d in definitions], imports).code


def _add_imports(module: cst.Module, spliced: list[cst.CSTNode],
                 imports: tuple[cst.SimpleStatementLine, ...]) -> cst.Module:
    """Add the overlay imports that ``spliced`` uses and ``module`` does not bind."""
    added = missing_imports(_module_bindings(module), spliced, imports)
    if not added:
        return module
    body = list(module.body)
    last_import = max(i for i, s in enumerate(body) if _is_import(s))
    body[last_import + 1 : last_import + 1] = added
    return module.with_changes(body=body)


def missing_imports(present: set[str], spliced: list[cst.CSTNode],
                    imports: tuple[cst.SimpleStatementLine, ...]) -> list[cst.SimpleStatementLine]:
    """The overlay import statements, cut down to the names ``spliced`` uses and ``present``
    lacks: what the splice adds to an upstream module (and the runtime to a live one)."""
    used = _used_names(spliced)
    present = set(present)
    added: list[cst.SimpleStatementLine] = []
    for statement in imports:
        bound = [(name, alias) for name, alias in _bound_names(statement)
                 if name in used and name not in present]
        if not bound:
            continue
        present.update(name for name, _ in bound)  # overlays sharing definitions repeat imports
        wanted = [alias for _, alias in bound]
        wanted[-1] = wanted[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        node = statement.body[0].with_changes(names=wanted)
        if isinstance(node, cst.ImportFrom):
            node = node.with_changes(lpar=None, rpar=None)
        added.append(statement.with_changes(body=[node], leading_lines=[]))
    return added
