"""Installing overlays into the modules of an imported vLLM: the runtime's mechanism.

It mirrors the static splice (``_splice``): the definitions ``Overlay.select`` picks,
compiled from an ``ast`` of the overlay file (tracebacks point at it) and executed in
the upstream module's namespace, with the splice's imports and hook rewrites. Everything
is validated before the first change (``ActivationError``); a failure after it is
``PartlyInstalled``. See CONTRIBUTING.md, "Runtime activation".
"""

from __future__ import annotations
import __future__

import ast
import copy
import dataclasses
import functools
import importlib
import inspect
import sys
import textwrap
import types
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_patches._errors import UserError
from vllm_patches._overlay import ADD, AMEND, HOOKS

if TYPE_CHECKING:
    from packaging.version import Version

    from vllm_patches._catalog.series import Fix
    from vllm_patches._engine.hooks import CallFilters, CallRewrite

# Set on each upstream module that received definitions: fix id -> what was installed.
INSTALLED_ATTR = "__vllm_patches_installed__"
# Set on the wrapper a hook marker (@call_at_end_of, @filter_result_of) installs: the
# new method it calls.
HOOK_WRAPPER_ATTR = "__vllm_patches_hook_wrapper__"


class ActivationError(UserError):
    """The fixes cannot be activated as asked: no fix is installed, and every process
    says so (or, with ``VLLM_PATCHES_STRICT=1``, vLLM does not start)."""

    def __init__(self, message: str):
        super().__init__(f"vllm-patches: {message}")

    @property
    def reason(self) -> str:
        return str(self).removeprefix("vllm-patches: ")


class PartlyInstalled(ActivationError):
    """Installing failed after the first change: part of a fix is in the process and
    cannot be taken back, so vLLM must not run (raised under every policy)."""


@dataclass
class Installed:
    """One thing a fix put into a live module or class, and how to check it is there."""

    fix: str
    owner: Any  # the upstream module or class
    name: str
    value: Any  # what owner.__dict__[name] is (for "field": the dataclass Field)
    kind: str  # "member", "function", "add", "field", "call"

    @property
    def label(self) -> str:
        owner = self.owner.__name__ if isinstance(self.owner, types.ModuleType) \
            else f"{self.owner.__module__}.{self.owner.__qualname__}"
        suffix = f" (calls {self.value})" if self.kind == "call" else ""
        return f"{owner}.{self.name}{suffix}"

    def problem(self, expected: Any) -> str | None:
        """Why the postcondition does not hold (``expected``: the final value), or None."""
        present = self.owner.__dict__.get(self.name, _MISSING)
        if self.kind == "field":
            fields = getattr(self.owner, "__dataclass_fields__", {})
            if self.name not in fields:
                return f"{self.label} is not a dataclass field"
            if fields[self.name].init and \
                    self.name not in inspect.signature(self.owner.__init__).parameters:
                return f"{self.label} is not a parameter of __init__"
            return None
        if self.kind == "call":
            # The hook's wrapper, or a later fix's replacement whose own text calls it.
            while present is not _MISSING and getattr(present, HOOK_WRAPPER_ATTR, None) != \
                    self.value and not _calls_method(present, self.value):
                present = getattr(present, "__wrapped__", _MISSING)
            return None if present is not _MISSING else \
                f"{self.label}: the upstream method no longer calls the new one"
        if present is not expected:
            return f"{self.label} is not the installed definition"
        if not isinstance(self.owner, types.ModuleType) and \
                inspect.getattr_static(self.owner, self.name) is not expected:
            return f"{self.label} does not resolve to the installed definition"
        return None


_MISSING = object()


def _calls_method(function: Any, method: str) -> bool:
    """Whether ``function``'s own code names ``method`` (as in ``self.method(...)``)."""
    code = getattr(function, "__code__", None)
    return code is not None and method in code.co_names


@dataclass
class _Member:
    name: str
    node: ast.stmt | None  # the member's ast (hook marker stripped)
    # (marker kind, upstream method[, callee]) of a hook: the marker's arguments.
    hook: tuple[str, ...] | None = None

    @property
    def call_target(self) -> str | None:
        return self.hook[1] if self.hook else None

    @property
    def hook_parameters(self) -> list[str]:
        """The parameters after ``self``: the upstream method's arguments it takes."""
        assert isinstance(self.node, ast.FunctionDef)
        return [arg.arg for arg in self.node.args.args[1:]]


@dataclass
class _Definition:
    fix: str
    kind: str  # AMEND or ADD
    name: str
    node: ast.stmt  # marker stripped
    members: list[_Member]  # for an amended class
    cst_node: Any  # what missing_imports analyses
    source: Path  # the overlay file it is written in (tracebacks point there)

    @property
    def amends_class(self) -> bool:
        return self.kind == AMEND and isinstance(self.node, ast.ClassDef)


@dataclass
class _OverlayPlan:
    overlay: str
    path: Path
    module_name: str
    definitions: list[_Definition]
    imports: tuple  # libcst import statements of the overlay
    depends_on: set[str]  # upstream module names whose overlays must go first
    module: types.ModuleType | None = None


def module_name(overlay: str, package: str) -> str:
    """``v1/core/x.py`` -> ``vllm.v1.core.x`` (the module the overlay mirrors)."""
    dotted = overlay.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    return f"{package}.{dotted}"


@dataclass
class Result:
    """What ``install`` did: everything the fixes put into the process (this call's and,
    for a fix an earlier call installed, that call's), and the fixes left alone because
    the source tree already carries them (``vllm-patches apply``)."""

    installed: list[Installed]
    in_source: set[str]


def install(fixes: list[Fix], release: Version, *, root: Path, package: str) -> Result:
    """Install ``fixes`` (their variants for ``release``) into the live ``package``;
    re-entrant: a fix an earlier call installed is left as it is.

    ``root`` holds the overlays. Everything is validated (modules import, targets exist)
    before the first change (ActivationError); postconditions are checked after the last
    (PartlyInstalled for any failure after the first change).
    """
    plans = _plans(fixes, release, root, package)
    for fix in fixes:
        if not any(d.fix == fix.id for p in plans for d in p.definitions):
            raise ActivationError(f"{fix.id} is needed on vLLM v{release} "
                                  f"({fix.describe_needed()}) but no overlay variant "
                                  "holds that release")
    for item in plans:
        try:
            item.module = importlib.import_module(item.module_name)
        except ImportError as exc:
            raise ActivationError(f"{item.overlay}: cannot import the target module "
                                  f"{item.module_name} on vLLM v{release}: {exc}") from exc
    earlier, in_source = _already_there(plans, fixes)
    skip = set(earlier) | in_source
    for item in plans:
        _validate(item, skip)
    installed = [item for items in earlier.values() for item in items]
    try:
        for item in plans:
            installed += _install_overlay(item, skip)
        _check_postconditions(installed)
    except Exception as exc:
        detail = exc.reason if isinstance(exc, ActivationError) else repr(exc)
        raise PartlyInstalled(
            f"installing failed after it changed vLLM's code, so part of the fixes may be in "
            f"this process and cannot be taken back; vLLM must not run like this ({detail})"
        ) from exc
    return Result(installed, in_source)


def _plans(fixes: list[Fix], release: Version, root: Path, package: str) -> list[_OverlayPlan]:
    """Parse every overlay of ``fixes``, select the variants for ``release``, order them."""
    import libcst as cst

    from vllm_patches._engine.splice import Overlay

    ids = [fix.id for fix in fixes]
    plans = []
    overlays = list(dict.fromkeys(o for fix in fixes for o in fix.overlays))
    # Each overlay file is parsed once: definitions shared by @add/@amend(into=...)
    # are written in one file and installed from it into several modules.
    top_level: dict[Path, list[ast.stmt]] = {}
    for overlay in overlays:
        path = root / overlay
        parsed = Overlay.parse(path, [root / other for other in overlays])
        chosen = parsed.select(ids, release)
        if not chosen:
            continue
        definitions = []
        for chosen_definition in chosen:
            source = chosen_definition.source
            if source not in top_level:
                tree = ast.parse(source.read_text(), filename=str(source))
                top_level[source] = [n for n in tree.body if isinstance(
                    n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
            # A copy: _definition strips markers from the node it is given.
            node = copy.deepcopy(top_level[source][chosen_definition.position])
            assert node.name == chosen_definition.node.name.value, source
            definitions.append(_definition(chosen_definition, node))
        depends = set()
        for statement in parsed.imports:
            node = statement.body[0]
            if isinstance(node, cst.ImportFrom) and node.module is not None:
                depends.add(cst.Module([]).code_for_node(node.module))
        plans.append(_OverlayPlan(overlay, path, module_name(overlay, package), definitions,
                                  parsed.imports, depends))
    return _dependency_order(plans)


def _dependency_order(plans: list[_OverlayPlan]) -> list[_OverlayPlan]:
    """Overlays whose upstream module another overlay imports from go first (stable)."""
    ordered: list[_OverlayPlan] = []
    pending = list(plans)
    while pending:
        names = {p.module_name for p in pending}
        ready = next((p for p in pending if not (p.depends_on & names) - {p.module_name}),
                     pending[0])  # a cycle: keep the listed order
        ordered.append(ready)
        pending.remove(ready)
    return ordered


def _marker_name(decorator: ast.expr) -> str | None:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return target.id if isinstance(target, ast.Name) else None


def _definition(parsed, node: ast.stmt) -> _Definition:
    from vllm_patches._engine.splice import MARKERS, _is_docstring, _member_name

    node.decorator_list = [d for d in node.decorator_list if _marker_name(d) not in MARKERS]
    members = []
    if isinstance(node, ast.ClassDef) and parsed.kind == AMEND:
        cst_members = [m for m in parsed.node.body.body if not _is_docstring(m)]
        ast_members = [m for m in node.body if not _ast_docstring(m)]
        names = [_member_name(m) for m in cst_members]
        by_name = {_ast_member_name(m): m for m in ast_members}
        for name in names:
            member = by_name.get(name)
            hook = None
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in list(member.decorator_list):
                    if _marker_name(decorator) in HOOKS:
                        hook = (_marker_name(decorator), *(
                            arg.value for arg in decorator.args))  # type: ignore[attr-defined]
                        member.decorator_list.remove(decorator)
            members.append(_Member(name, member, hook))
        # The overlay's class docstring is not spliced; it must not replace upstream's.
        node.body = [m for m in node.body if not _ast_docstring(m)] or [
            ast.copy_location(ast.Pass(), node)]
    return _Definition(parsed.fix, parsed.kind, parsed.name, node, members, parsed.node,
                       parsed.source)


def _ast_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
        and isinstance(node.value.value, str)


def _ast_member_name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    target = None
    if isinstance(node, ast.AnnAssign):
        target = node.target
    elif isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
    return target.id if isinstance(target, ast.Name) else None


def _already_there(plans: list[_OverlayPlan],
                   fixes: list[Fix]) -> tuple[dict[str, list[Installed]], set[str]]:
    """The fixes to leave alone: per fix an earlier call in this process installed, what it
    installed; and the fixes the source tree already carries (installing those again would double
    their hooks and trip over their ``@add`` names)."""
    earlier: dict[str, list[Installed]] = {}
    in_source: set[str] = set()
    for fix in fixes:
        modules = list({id(p.module): p.module for p in plans
                        if any(d.fix == fix.id for d in p.definitions)}.values())
        records = [getattr(module, INSTALLED_ATTR, {}).get(fix.id) for module in modules]
        if all(record is not None for record in records):
            earlier[fix.id] = [item for record in records for item in record]
        elif all(_in_source(p.module, d, _replaced_later(plans, fixes, p, d))
                 for p in plans for d in p.definitions if d.fix == fix.id):
            in_source.add(fix.id)
    return earlier, in_source


def _replaced_later(plans: list[_OverlayPlan], fixes: list[Fix], plan: _OverlayPlan,
                    definition: _Definition) -> set[str]:
    """Members of ``definition``'s class that a later fix of ``fixes`` amends again: a
    patched tree holds the later fix's version of them (F3 replaces a method F2 adds), so
    the earlier fix is checked without them, and the later one checks them."""
    order = [fix.id for fix in fixes]
    return {member.name for other in plans if other.module is plan.module
            for later in other.definitions
            if later.name == definition.name and later.fix in order
            and order.index(later.fix) > order.index(definition.fix)
            for member in later.members}


@functools.cache
def _source_tree(path: str) -> ast.Module | None:
    try:
        return ast.parse(Path(path).read_text(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _in_source(module: types.ModuleType, definition: _Definition,
               replaced: Collection[str] = ()) -> bool:
    """Whether the upstream module's source file already holds ``definition`` verbatim
    (an amended class: its members but those in ``replaced``; a ``__doc__`` member as the
    class docstring, where the splice puts it)."""
    from vllm_patches._engine.splice import DOCSTRING_MEMBER
    path = getattr(module, "__file__", None)
    tree = _source_tree(path) if path and path.endswith(".py") else None
    if tree is None:
        return False
    top = {n.name: n for n in tree.body
           if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
    upstream = top.get(definition.name)
    if upstream is None:
        return False
    if not definition.amends_class:
        return ast.dump(upstream) == ast.dump(definition.node)
    members = {_ast_member_name(m): m for m in upstream.body}  # type: ignore[attr-defined]
    checked = [member for member in definition.members if member.name not in replaced]
    for member in checked:
        if member.name == DOCSTRING_MEMBER:
            value = getattr(member.node, "value", None)
            if not isinstance(value, ast.Constant) or ast.get_docstring(
                    upstream, clean=False) != value.value:  # type: ignore[arg-type]
                return False
            continue
        there = members.get(member.name)
        if there is None or member.node is None or ast.dump(there) != ast.dump(member.node):
            return False
    for member in checked:
        if member.call_target:
            target = members.get(member.call_target)
            if not isinstance(target, ast.FunctionDef) or not any(
                    isinstance(node, ast.Attribute) and node.attr == member.name
                    and isinstance(node.value, ast.Name) and node.value.id == "self"
                    for node in ast.walk(target)):
                return False
    return True


def _validate(item: _OverlayPlan, skip: set[str]) -> None:
    """Every target of the overlay's definitions exists (or, for @add, does not)."""
    from vllm_patches._engine.hooks import HOOK_KINDS, CallRewrite, ReturnHook

    namespace = item.module.__dict__
    where = f"{item.overlay} -> {item.module_name}"
    call_filters = _call_filters([d for d in item.definitions if d.fix not in skip])
    for definition in item.definitions:
        if definition.fix in skip:
            continue
        name = definition.name
        if definition.kind == ADD:
            if name in namespace:
                raise ActivationError(f"{definition.fix}: {where}: @add {name}, but the module "
                                      "already defines it")
            continue
        if name not in namespace:
            raise ActivationError(f"{definition.fix}: {where}: @amend {name}, but the module "
                                  "has no such definition")
        target = namespace[name]
        if definition.amends_class:
            if not isinstance(target, type):
                raise ActivationError(f"{definition.fix}: {where}: @amend class {name}, but "
                                      f"{name} is {type(target).__name__}, not a class")
            new_members = {m.name for m in definition.members}
            for member in definition.members:
                if not member.call_target:
                    continue
                hooked = target.__dict__.get(member.call_target)
                if hooked is None and member.call_target not in new_members:
                    raise ActivationError(
                        f"{definition.fix}: {where}: {name} has no {member.call_target} to call "
                        f"{member.name} from")
                kind = HOOK_KINDS[member.hook[0]]  # type: ignore[index]
                if isinstance(kind, ReturnHook) and hooked and (
                        problem := kind.live_problem(hooked, member.hook_parameters)):
                    raise ActivationError(f"{definition.fix}: {where}: {name}."
                                          f"{member.call_target} {problem} for {member.name}")
                if isinstance(kind, CallRewrite) and (
                        filters := call_filters.pop((name, member.call_target), None)):
                    # All the method's call rewrites, as installing applies them; before any change.
                    _filter_calls_in(target, member.call_target, filters, definition.fix)
            if dataclasses.is_dataclass(target) and any(
                    isinstance(m.node, ast.AnnAssign) for m in definition.members):
                _check_dataclass_amendable(target, definition.fix, where)
        elif not isinstance(target, types.FunctionType):
            raise ActivationError(f"{definition.fix}: {where}: @amend def {name}, but {name} is "
                                  f"{type(target).__name__}, not a function")


def _check_dataclass_amendable(cls: type, fix: str, where: str) -> None:
    if "__slots__" in cls.__dict__:
        raise ActivationError(f"{fix}: {where}: {cls.__name__} is a slots dataclass; its fields "
                              "cannot change at runtime (apply the git patch instead)")
    subclasses = [sub.__qualname__ for sub in cls.__subclasses__() if dataclasses.is_dataclass(sub)]
    if subclasses:
        raise ActivationError(f"{fix}: {where}: {cls.__name__} has dataclass subclasses "
                              f"({', '.join(subclasses)}) whose fields would not change at "
                              "runtime (apply the git patch instead)")


def _install_overlay(item: _OverlayPlan, skip: set[str]) -> list[Installed]:
    from vllm_patches._engine.splice import missing_imports

    module = item.module
    namespace = module.__dict__
    todo = [d for d in item.definitions if d.fix not in skip]
    if not todo:
        return []
    for statement in missing_imports(set(namespace), [d.cst_node for d in todo], item.imports):
        import libcst as cst

        code = cst.Module(body=[statement]).code
        try:
            exec(compile(code, str(item.path), "exec", dont_inherit=True), namespace)  # noqa: S102
        except ImportError as exc:
            raise ActivationError(f"{item.overlay}: `{code.strip()}` fails on this vLLM: "
                                  f"{exc}") from exc
    flags = __future__.annotations.compiler_flag \
        if namespace.get("annotations") is __future__.annotations else 0
    installed: list[Installed] = []
    call_filters = _call_filters(todo)
    for definition in todo:
        code = compile(ast.Module(body=[definition.node], type_ignores=[]), str(definition.source),
                       "exec", flags=flags, dont_inherit=True)
        name = definition.name
        written = definition.node.name  # a partial class may amend a class of another name
        before = namespace.get(name, _MISSING)
        shadowed = namespace.get(written, _MISSING)
        exec(code, namespace)  # noqa: S102 - the overlay's own code, in the upstream module
        new = namespace[written]
        if definition.kind == ADD:
            installed.append(Installed(definition.fix, module, name, new, "add"))
        elif definition.amends_class:
            # The partial class must not replace upstream's, nor bind its own name.
            if shadowed is _MISSING:
                del namespace[written]
            else:
                namespace[written] = shadowed
            installed += _amend_class(before, new, definition, call_filters)
        else:
            _rebind(before, new, name)
            installed.append(Installed(definition.fix, module, name, new, "function"))
    record = dict(namespace.get(INSTALLED_ATTR, {}))
    for fix_id in dict.fromkeys(d.fix for d in todo):
        record[fix_id] = [i for i in installed if i.fix == fix_id]
    namespace[INSTALLED_ATTR] = record
    return installed


def _rebind(old: Any, new: Any, name: str) -> None:
    """Point every loaded module's same-named binding of ``old`` (a from-import) at ``new``."""
    for loaded in list(sys.modules.values()):
        space = getattr(loaded, "__dict__", None)
        if isinstance(space, dict) and space.get(name) is old:
            space[name] = new


def _unwrapped_functions(value: Any) -> list[types.FunctionType]:
    found = []
    for candidate in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                      getattr(value, "fset", None), getattr(value, "fdel", None),
                      getattr(value, "func", None)):
        while candidate is not None:
            if isinstance(candidate, types.FunctionType):
                found.append(candidate)
            candidate = getattr(candidate, "__wrapped__", None)
    return found


def _call_filters(definitions: list[_Definition]) -> CallFilters:
    """The call filters of ``definitions`` per (upstream class, method), as the splice
    groups them (``_hooks.group_call_filters``)."""
    from vllm_patches._engine.hooks import group_call_filters

    return group_call_filters((d.name, m.hook, m.name, m.hook_parameters) for d in definitions
                              if d.amends_class for m in d.members if m.hook)


def _amend_class(cls: type, partial: type, definition: _Definition,
                 call_filters: CallFilters) -> list[Installed]:
    """Put the members of ``partial`` (the overlay class, executed) onto the live ``cls``.

    ``call_filters``: those of the overlay's definitions not installed yet; the first
    definition that filters calls in a method recompiles it once with all of them."""
    from vllm_patches._engine.hooks import HOOK_KINDS

    # Zero-argument super() and __class__ refer to the cell of the class body that
    # defined the function: point it at the live class.
    for value in partial.__dict__.values():
        for function in _unwrapped_functions(value):
            if "__class__" in function.__code__.co_freevars:
                index = function.__code__.co_freevars.index("__class__")
                function.__closure__[index].cell_contents = cls  # type: ignore[index]
    annotations = inspect.get_annotations(partial)
    is_dataclass = dataclasses.is_dataclass(cls)
    installed: list[Installed] = []
    fields = []
    for member in definition.members:
        name = member.name
        if is_dataclass and name in annotations:
            fields.append(name)
            continue
        if name in partial.__dict__:
            value = partial.__dict__[name]
            setattr(cls, name, value)
            set_name = getattr(type(value), "__set_name__", None)
            if set_name is not None:
                set_name(value, cls, name)
            installed.append(Installed(definition.fix, cls, name, value, "member"))
        if name in annotations:
            cls.__annotations__ = {**inspect.get_annotations(cls), name: annotations[name]}
    if fields:
        _amend_dataclass(cls, partial, fields, annotations)
        installed += [Installed(definition.fix, cls, name, cls.__dataclass_fields__[name], "field")
                      for name in fields]
    # Call rewrites recompile the upstream function itself: before any wrapper goes on it.
    for member in sorted(definition.members, key=lambda m: m.hook is None or
                         not HOOK_KINDS[m.hook[0]].rewrites_calls):
        if member.hook:
            _hook_into(cls, definition.name, member, call_filters)
            installed.append(Installed(definition.fix, cls, member.call_target, member.name,
                                       "call"))
    return installed


# The class a method using zero-argument super() is recompiled in (_filter_calls_in).
_HOLDER = "_RecompiledIn"


def _filter_calls_in(cls: type, target: str, filters: list[tuple[str, str, CallRewrite, list[str]]],
                     fix: str) -> types.FunctionType:
    """Upstream ``cls.<target>`` recompiled from its source with the splice's rewrite of
    all its ``filters`` (``@filter_call_in``, ``@redirect_call_in``, ``@guard_branch_in``:
    ``_hooks.filter_calls``), in its module's namespace, at its own file and lines. One recompile per method: the source read is
    the text of the file, so a second recompile would lose the first one's rewrite."""
    import libcst as cst

    from vllm_patches._engine.hooks import filter_calls
    from vllm_patches._errors import SpliceError

    where = f"{fix}: {cls.__module__}.{cls.__qualname__}.{target}".lstrip(": ")
    original = cls.__dict__[target]
    # A method's one possible free variable is __class__, zero-argument super()'s.
    if not isinstance(original, types.FunctionType) or \
            original.__code__.co_freevars not in ((), ("__class__",)):
        raise ActivationError(f"{where}: not a plain function, cannot filter its calls")
    try:
        lines, first = inspect.getsourcelines(original)
    except (OSError, TypeError) as exc:
        raise ActivationError(f"{where}: no source to filter its calls in: {exc}") from exc
    function = cst.parse_module(textwrap.dedent("".join(lines))).body[0]
    assert isinstance(function, cst.FunctionDef), where
    try:
        rewritten = filter_calls(function, filters, where)
    except SpliceError as exc:
        raise ActivationError(str(exc)) from exc
    tree = ast.parse(cst.Module(body=[rewritten]).code)
    ast.increment_lineno(tree, first - 1)
    if original.__code__.co_freevars:
        # Compiled in a class body, the function gets its __class__ cell: the
        # original's closure fills it below.
        holder = ast.parse(f"class {_HOLDER}:\n    pass")
        holder.body[0].body = tree.body  # type: ignore[attr-defined]
        tree = holder
    namespace = sys.modules[cls.__module__].__dict__
    flags = __future__.annotations.compiler_flag \
        if namespace.get("annotations") is __future__.annotations else 0
    defined: dict[str, Any] = {}
    exec(compile(tree, original.__code__.co_filename, "exec", flags=flags,  # noqa: S102
                 dont_inherit=True), namespace, defined)
    scope = defined[_HOLDER].__dict__ if original.__code__.co_freevars else defined
    new = scope[target]
    if original.__closure__:
        assert new.__code__.co_freevars == original.__code__.co_freevars, where
        new = _with_closure(new, original.__closure__)
    new.__qualname__ = original.__qualname__
    return new


def _with_closure(function: types.FunctionType,
                  closure: tuple[types.CellType, ...]) -> types.FunctionType:
    """``function`` with the cells of ``closure`` for its free variables."""
    made = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                              function.__defaults__, closure)
    made.__kwdefaults__ = function.__kwdefaults__
    made.__annotations__ = function.__annotations__
    made.__doc__ = function.__doc__
    made.__module__ = function.__module__
    return made


def _hook_into(cls: type, name: str, member: _Member, call_filters: CallFilters) -> None:
    """Change upstream ``cls.<target>`` as the spliced hook call would change it, with the
    hook kind's own runtime change (``_hooks.HOOK_KINDS``; ``name``: the upstream class's
    name, as ``call_filters`` knows it)."""
    from vllm_patches._engine.hooks import HOOK_KINDS, CallRewrite

    kind, target = HOOK_KINDS[member.hook[0]], member.hook[1]  # type: ignore[index]
    method = member.name
    # From the method as it is now: an earlier fix may have replaced it. The first hook
    # of the method, whatever its kind, applies every call rewrite of it (a later fix's
    # too): they recompile upstream's own function, which a wrapper would hide.
    filters = call_filters.pop((name, target), None)
    if isinstance(kind, CallRewrite):
        if filters is None:
            return  # the method's first hook applied this one with its own
        wrapper = _filter_calls_in(cls, target, filters, "")
    else:
        if filters is not None:
            setattr(cls, target, _filter_calls_in(cls, target, filters, ""))
        wrapper = kind.wrap(cls.__dict__[target], method, member.hook_parameters)
    setattr(wrapper, HOOK_WRAPPER_ATTR, method)
    setattr(cls, target, wrapper)


# Methods dataclasses.dataclass generates (exec'd from "<string>") and must generate anew.
_DATACLASS_GENERATED = ("__init__", "__repr__", "__eq__", "__lt__", "__le__", "__gt__", "__ge__",
                        "__hash__", "__setattr__", "__delattr__")


def _amend_dataclass(cls: type, partial: type, names: list[str],
                     annotations: dict[str, Any]) -> None:
    """Add or replace the fields ``names`` of dataclass ``cls`` in place.

    The class object stays the same (every module that imported it, every isinstance
    check and every existing subclass keeps working): its annotations and defaults are
    updated, the generated methods are removed, and ``dataclasses.dataclass`` runs on
    the class again with its original parameters.
    """
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    old_fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    own = dict(inspect.get_annotations(cls))
    for name in own:
        if name in old_fields and name not in names:
            setattr(cls, name, old_fields[name])  # a Field keeps default, factory, kw_only...
    for name in names:
        own[name] = annotations[name]
        if name in partial.__dict__:
            setattr(cls, name, partial.__dict__[name])
        elif name in cls.__dict__:
            delattr(cls, name)
    cls.__annotations__ = own
    for name in _DATACLASS_GENERATED:
        value = cls.__dict__.get(name, _MISSING)
        generated = value is None if name == "__hash__" else callable(value) and getattr(
            getattr(inspect.unwrap(value), "__code__", None), "co_filename", None) == "<string>"
        if value is not _MISSING and generated:
            delattr(cls, name)
    match_args = "__match_args__" in cls.__dict__
    if match_args:
        delattr(cls, "__match_args__")
    if "__replace__" in cls.__dict__ and \
            cls.__dict__["__replace__"] is getattr(dataclasses, "_replace", _MISSING):
        delattr(cls, "__replace__")
    options = {key: getattr(params, key) for key in
               ("init", "repr", "eq", "order", "unsafe_hash", "frozen", "kw_only")
               if hasattr(params, key)}
    dataclasses.dataclass(cls, match_args=match_args, **options)


def _check_postconditions(installed: list[Installed]) -> None:
    """Each target carries what was installed, or what a later fix put over it."""
    final: dict[tuple[int, str, str], Installed] = {}
    for item in installed:
        final[(id(item.owner), item.name, item.kind)] = item
    problems = []
    for item in installed:
        problem = item.problem(final[(id(item.owner), item.name, item.kind)].value)
        if problem:
            problems.append(f"{item.fix}: {problem}")
    if problems:
        raise ActivationError("postconditions failed after installing: " + "; ".join(problems))
