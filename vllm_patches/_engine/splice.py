"""Splice overlay definitions into an upstream module with libcst.

Everything the overlay does not name stays byte-identical: only the named top-level
definitions and class members are replaced or inserted, and only the imports the
spliced code uses and upstream lacks are added (those of the overlay's ``if
TYPE_CHECKING:`` block, names of annotations only, to upstream's own such block).
"""

from __future__ import annotations

import functools
from collections.abc import Container, Iterable
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_patches._catalog.series import describe_releases
from vllm_patches._engine.hooks import (
    HOOK_KINDS,
    CallFilters,
    CallRewrite,
    filter_calls,
    group_call_filters,
    hook_parameters,
)
from vllm_patches._errors import SpliceError
from vllm_patches._overlay import ADD, AMEND, HOOKS

MARKERS = {AMEND, ADD}
# A partial class's own docstring describes the overlay; ``__doc__ = """..."""``
# replaces the upstream class docstring.
DOCSTRING_MEMBER = "__doc__"
OWN_PACKAGE = "vllm_patches"


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
    after: str | None = None  # the upstream member an @amend(..., after=...) partial's new ones follow

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
    """A parsed overlay module: its marked definitions and the imports they may need
    (``type_imports``: those under ``if TYPE_CHECKING:``, for annotations only)."""

    path: Path
    definitions: tuple[OverlayDefinition, ...]
    imports: tuple[cst.SimpleStatementLine, ...]
    type_imports: tuple[cst.SimpleStatementLine, ...] = ()

    @classmethod
    def parse(cls, path: Path, others: Iterable[Path] = ()) -> Overlay:
        """The definitions spliced into ``path``'s upstream module: those written in
        ``path``, and those the overlay files ``others`` add ``into`` it, with the
        imports of the files they are written in."""
        definitions, imports, type_imports = _parse_file(path)
        own = [d for d in definitions if d.into is None]
        imports, type_imports = list(imports), list(type_imports)
        target = path.resolve()
        for other in others:
            if other.resolve() == target:
                continue
            foreign, foreign_imports, foreign_type_imports = _parse_file(other)
            sent = [d for d in foreign if d.into == target]
            if sent:
                own += sent
                imports += foreign_imports
                type_imports += foreign_type_imports
        return cls(path, tuple(own), tuple(imports), tuple(type_imports))

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


def unstarted_bounds(paths: Iterable[Path],
                     fixes: Container[str] | None = None) -> list[UnstartedBound]:
    """Every upper bound in the markers of the overlay files ``paths`` (those of
    ``fixes``, default all) that is not where another variant of the same definition
    starts. Variants of one definition: the markers of one fix linked, directly or
    through others, by sitting on one node or by naming one class or function (a partial
    class written for several layouts with ``name=``, a class upstream split). Only
    ``>=start`` and ``<end`` clauses are accepted.

    A fix's variants all lie in its own overlays, but a file holds the markers of every
    fix that edits it: ``fixes`` keeps another fix's marker, whose next variant is in a
    file not among ``paths``, from being judged without it."""
    definitions = [d for path in dict.fromkeys(paths) for d in _parse_file(path)[0]
                   if fixes is None or d.fix in fixes]
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


def check_bounds(paths: Iterable[Path], fixes: Container[str]) -> None:
    """Refuse a marker bound of ``fixes`` that is merely the newest verified release (see
    ``unstarted_bounds``; ``paths``: their overlays)."""
    for bound in unstarted_bounds(paths, fixes):
        raise SpliceError(str(bound))


_Imports = tuple[cst.SimpleStatementLine, ...]


def _parse_file(path: Path) -> tuple[tuple[OverlayDefinition, ...], _Imports, _Imports]:
    """The marked definitions (one per marker), the imports and the imports under ``if
    TYPE_CHECKING:`` of one overlay file."""
    return _parse_source(path, path.read_text())


@functools.cache
def _parse_source(path: Path, source: str) -> tuple[tuple[OverlayDefinition, ...],
                                                    _Imports, _Imports]:
    module = cst.parse_module(source)
    definitions: list[OverlayDefinition] = []
    imports: list[cst.SimpleStatementLine] = []
    type_imports: list[cst.SimpleStatementLine] = []
    position = 0
    for statement in module.body:
        if _is_import(statement):
            if not _imports_from(statement, (OWN_PACKAGE, "__future__")):
                imports.append(statement)
        elif isinstance(statement, (cst.ClassDef, cst.FunctionDef)):
            definitions += _parse_definition(path, statement, position)
            position += 1
        elif _is_type_checking_block(statement):
            type_imports += statement.body.body
        elif not _is_docstring(statement):
            # Only marked definitions and imports reach upstream: anything else
            # (a constant, a registration call) would silently be left out.
            first_line = module.code_for_node(statement).strip().splitlines()[0]
            raise SpliceError(
                f"{path}: `{first_line}` is a module-level statement outside a marked "
                "definition, which the splice would drop; make it a marked @add "
                "definition or move it into one")
    return tuple(definitions), tuple(imports), tuple(type_imports)


def _is_type_checking_block(statement: cst.CSTNode) -> bool:
    """``if TYPE_CHECKING:`` with imports only: annotations' names."""
    return (
        isinstance(statement, cst.If)
        and isinstance(statement.test, cst.Name)
        and statement.test.value == "TYPE_CHECKING"
        and statement.orelse is None
        and all(_is_import(line) for line in statement.body.body)
    )


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
        args = _string_args(path, marker, ("fix", "releases"),
                            optional=("into", "name", "after"))
        into = (path.parent / args["into"]).resolve() if "into" in args else None
        if into is not None and not into.is_file():
            raise SpliceError(f"{path}: {node.name.value}: into={args['into']!r} is no overlay")
        for keyword in ("name", "after"):
            if keyword in args and (kinds != {AMEND} or not isinstance(node, cst.ClassDef)):
                raise SpliceError(
                    f"{path}: {node.name.value}: {keyword}= is for @amend partial classes")
        definitions.append(OverlayDefinition(
            kind=_decorator_name(marker), fix=args["fix"], releases=SpecifierSet(args["releases"]),
            node=bare, source=path, position=position, into=into, target=args.get("name"),
            after=args.get("after")))
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
        self.annotation_names: set[str] = set()  # in string annotations ("Request")

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Annotation(self, node: cst.Annotation) -> None:
        if isinstance(node.annotation, cst.SimpleString):
            quoted = cst.parse_expression(str(node.annotation.evaluated_value))
            self.annotation_names |= _used_names([quoted])


def _used_names(nodes: list[cst.CSTNode], *, quoted: bool = False) -> set[str]:
    """The names ``nodes`` use; with ``quoted``, also those in string annotations."""
    collector = _NameCollector()
    for node in nodes:
        node.visit(collector)
    return collector.names | (collector.annotation_names if quoted else set())


def _type_checking_bindings(module: cst.Module) -> set[str]:
    """Names bound by the imports of ``module``'s top-level ``if TYPE_CHECKING:`` blocks."""
    return {name for statement in module.body if _is_type_checking_block(statement)
            for line in statement.body.body for name, _ in _bound_names(line)}


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
                 call_filters: CallFilters, after: str | None = None) -> cst.ClassDef:
    """Replace same-named members in place; insert new ones next to the replaced ones.

    New members that precede a replaced member in the overlay are inserted right
    before it; new members after the last replaced one follow it; with no replaced
    member at all they go right after upstream member ``after``, else to the end of
    the class.
    """
    body = list(upstream.body.body)
    index = {_member_name(node): i for i, node in enumerate(body) if _member_name(node)}
    pending: list[cst.CSTNode] = []
    if after is not None and after not in index:
        raise SpliceError(f"{path}: {overlay.name.value}: after={after!r}, but upstream "
                          f"{upstream.name.value} has no such member")
    cursor = index[after] + 1 if after is not None else len(body)
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


def _hook_into(cls: cst.ClassDef, marker: tuple[str, ...], hook: cst.FunctionDef,
               path: Path, call_filters: CallFilters) -> cst.ClassDef:
    """Hook the new method ``hook`` into ``cls.<target>`` (see ``_overlay``) with its kind's
    rewrite (``_hooks.HOOK_KINDS``).

    The first call filter of a method rewrites it with all of ``call_filters``' filters
    of that method (and takes them out); the later ones find their calls in place."""
    kind, target = HOOK_KINDS[marker[0]], marker[1]
    where = f"{path}: @{kind.marker}({target!r}) on {cls.name.value}.{hook.name.value}"
    body = list(cls.body.body)
    for i, node in enumerate(body):
        if isinstance(node, cst.FunctionDef) and node.name.value == target:
            break
    else:
        raise SpliceError(f"{where}: {cls.name.value} has no {target}")
    kind.check(hook_parameters(hook), where)
    if isinstance(kind, CallRewrite):
        filters = call_filters.pop((cls.name.value, target), None)
        if filters is not None:
            body[i] = filter_calls(node, filters, where)
    else:
        body[i] = kind.splice(node, hook, where)
    return cls.with_changes(body=cls.body.with_changes(body=body))


def _hooks(definitions: list[OverlayDefinition]
           ) -> Iterable[tuple[str, tuple[str, ...], str, list[str]]]:
    """(upstream class, hook marker, hook method, its parameters after ``self``) of each
    hook of ``definitions``, in order."""
    for definition in definitions:
        if definition.kind == AMEND and isinstance(definition.node, cst.ClassDef):
            for member in definition.node.body.body:
                hook, marker = _strip_hook(member)
                if marker:
                    assert isinstance(hook, cst.FunctionDef)
                    yield definition.name, marker, hook.name.value, hook_parameters(hook)


def splice(upstream_source: str, definitions: list[OverlayDefinition],
           overlay: Overlay) -> str:
    """``upstream_source`` with ``definitions`` (chosen from ``overlay``) spliced in, in
    order, and the overlay's imports they need."""
    path = overlay.path
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
            body[position] = _amend_class(current, node, path, call_filters,
                                          after=definition.after)
        else:
            body[position] = _with_leading(_blank_lines(current), node)
    module = module.with_changes(body=body)
    spliced = [d.node for d in definitions]
    module = _add_imports(module, spliced, overlay.imports)
    return _add_type_imports(module, spliced, overlay.type_imports).code


def _add_imports(module: cst.Module, spliced: list[cst.CSTNode],
                 imports: _Imports) -> cst.Module:
    """Add the overlay imports that ``spliced`` uses and ``module`` does not bind."""
    added = missing_imports(_module_bindings(module), spliced, imports)
    if not added:
        return module
    body = list(module.body)
    position = _after_imports(body)
    body[position:position] = added
    return module.with_changes(body=body)


def _after_imports(body: list[cst.CSTNode]) -> int:
    return max(i for i, s in enumerate(body) if _is_import(s)) + 1


def _add_type_imports(module: cst.Module, spliced: list[cst.CSTNode],
                      type_imports: _Imports) -> cst.Module:
    """Add the overlay's ``if TYPE_CHECKING:`` imports that ``spliced``'s annotations
    use and ``module`` binds nowhere, to ``module``'s first such block (a new one after
    its imports if it has none). At run time nothing needs them: vLLM's modules quote
    such annotations, as overlays do, and type checkers (upstream's mypy hook) read
    them; without them an exported fix fails that hook (F821, name-defined)."""
    present = _module_bindings(module) | _type_checking_bindings(module)
    added = missing_imports(present, spliced, type_imports, quoted=True)
    if not added:
        return module
    body = list(module.body)
    block = next((i for i, s in enumerate(body) if _is_type_checking_block(s)), None)
    if block is not None:
        existing = body[block]
        body[block] = existing.with_changes(body=existing.body.with_changes(
            body=[*existing.body.body, *added]))
        return module.with_changes(body=body)
    position = _after_imports(body)
    new = [cst.If(test=cst.Name("TYPE_CHECKING"), body=cst.IndentedBlock(body=added),
                  leading_lines=[cst.EmptyLine(indent=False)])]
    if "TYPE_CHECKING" not in present:
        new.insert(0, cst.parse_statement("from typing import TYPE_CHECKING\n"))
    body[position:position] = new
    return module.with_changes(body=body)


def missing_imports(present: set[str], spliced: list[cst.CSTNode], imports: _Imports,
                    *, quoted: bool = False) -> list[cst.SimpleStatementLine]:
    """The overlay import statements, cut down to the names ``spliced`` uses (with
    ``quoted``, in string annotations too) and ``present`` lacks: what the splice adds to
    an upstream module (and the runtime to a live one)."""
    used = _used_names(spliced, quoted=quoted)
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
