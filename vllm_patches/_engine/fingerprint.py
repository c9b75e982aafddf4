"""Fingerprints of the upstream code the fixes target, per covered release.

A target's fingerprint is a hash of its ``ast`` (no positions, comments or formatting),
or ``absent`` for an ``@add`` name. ``regen`` writes each covered release's to
``patches/v<release>/fingerprints``; the runtime computes the same from the installed
vLLM, and runs the fixes as that release only where every one equals
(``_runtime.release_basis``): any difference or unreadable file fails the comparison.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from packaging.version import Version

from vllm_patches._catalog import patchset as _patchset
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.series import Series
from vllm_patches._overlay import AMEND

FILE = "fingerprints"
HEADER = "# vllm-patches fingerprints of vLLM"  # the file's first line
ABSENT = "absent"
NO_FILE = "no file"  # the target's module has no source file
UNPARSABLE = "unparsable"  # its source is no Python this interpreter parses
DIGITS = 16  # of the sha256: 64 bits tell apart any two versions of one definition

# fix id -> target ("v1/core/x.py:Class.member", the overlay path and the qualified
# name) -> fingerprint.
Fingerprints = dict[str, dict[str, str]]
# Overlay path (v1/core/x.py) -> the upstream module's source, or None where it has none.
Reader = Callable[[str], "str | None"]


def _dump(node: object) -> str:
    """A syntax tree as text that does not depend on the Python version that parsed it:
    fields that are None or empty are left out (a newer Python's new fields, such as
    ``type_params``, are empty for code an older one parses), and the parts of an
    f-string are merged where Python versions split them differently."""
    if isinstance(node, list):
        return "[" + ", ".join(_dump(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name in node._fields:
        value = getattr(node, name, None)
        if isinstance(node, ast.JoinedStr) and name == "values":
            value = _merged_constants(value)
        if value is None or value == []:
            continue
        fields.append(f"{name}={_dump(value)}")
    return f"{type(node).__name__}({', '.join(fields)})"


def _merged_constants(values: list[ast.expr]) -> list[ast.expr]:
    merged: list[ast.expr] = []
    for value in values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            if not value.value:
                continue
            if merged and isinstance(merged[-1], ast.Constant):
                merged[-1] = ast.Constant(merged[-1].value + value.value)
                continue
            value = ast.Constant(value.value)
        merged.append(value)
    return merged


def fingerprint(nodes: list[ast.AST]) -> str:
    """The fingerprint of the definitions that bind one name (``absent``: none)."""
    if not nodes:
        return ABSENT
    text = "\n".join(_dump(node) for node in nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGITS]


def _bound_names(statement: ast.stmt) -> list[str]:
    """The names a module- or class-level statement binds."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in statement.names]
    targets = statement.targets if isinstance(statement, ast.Assign) else \
        [statement.target] if isinstance(statement, ast.AnnAssign) else []
    return [target.id for target in targets if isinstance(target, ast.Name)]


def _binding(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    return [statement for statement in body if name in _bound_names(statement)]


def _class_statement(node: ast.stmt) -> ast.stmt:
    """The class without its body: name, bases, keywords, decorators."""
    if not isinstance(node, ast.ClassDef):
        return node
    return ast.ClassDef(name=node.name, bases=node.bases, keywords=node.keywords, body=[],
                        decorator_list=node.decorator_list)


def targets(series: Series, release: Version, root: Path) -> dict[str, list[tuple[str, str]]]:
    """Fix id -> its targets on ``release``: (overlay, qualified name), for every fix the
    release needs, from the definitions ``Overlay.select`` picks (those the runtime
    installs and ``regen`` splices)."""
    import libcst as cst

    from vllm_patches._engine.splice import (
        DOCSTRING_MEMBER,
        Overlay,
        _is_docstring,
        _member_name,
        _strip_hook,
    )

    fixes = series.applicable(release)
    overlays = list(dict.fromkeys(o for fix in fixes for o in fix.overlays))
    found: dict[str, list[tuple[str, str]]] = {fix.id: [] for fix in fixes}
    for overlay in overlays:
        parsed = Overlay.parse(root / overlay, [root / other for other in overlays])
        for fix in fixes:
            for definition in parsed.select([fix.id], release):
                names = [definition.name]
                if definition.kind == AMEND and isinstance(definition.node, cst.ClassDef):
                    for member in definition.node.body.body:
                        if _is_docstring(member) or _member_name(member) == DOCSTRING_MEMBER:
                            continue  # the docstring is no code
                        _, hook = _strip_hook(member)
                        for name in (_member_name(member), hook[1] if hook else None):
                            if name:
                                names.append(f"{definition.name}.{name}")
                found[fix.id] += [(overlay, name) for name in names]
    return {fix_id: list(dict.fromkeys(named)) for fix_id, named in found.items()}


def compute(series: Series, release: Version, root: Path, read: Reader) -> Fingerprints:
    """Fix id -> target -> fingerprint of the code ``read`` gives for each target module."""
    trees: dict[str, ast.Module | str] = {}  # a tree, or why there is none
    result: Fingerprints = {}
    for fix_id, named in targets(series, release, root).items():
        result[fix_id] = {}
        for overlay, qualified in named:
            if overlay not in trees:
                trees[overlay] = _parse(read(overlay))
            tree = trees[overlay]
            if isinstance(tree, str):
                result[fix_id][f"{overlay}:{qualified}"] = tree
                continue
            top, _, member = qualified.partition(".")
            nodes = _binding(tree.body, top)
            if member:
                classes = [node for node in nodes if isinstance(node, ast.ClassDef)]
                nodes = _binding(classes[-1].body, member) if classes else []
            elif nodes and isinstance(nodes[-1], ast.ClassDef):
                nodes = [_class_statement(node) for node in nodes]
            result[fix_id][f"{overlay}:{qualified}"] = fingerprint(nodes)
    return result


def _parse(source: str | None) -> ast.Module | str:
    if source is None:
        return NO_FILE
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return UNPARSABLE


def render(release: Version, found: Fingerprints) -> str:
    """The text of ``patches/v<release>/fingerprints``."""
    lines = [f"{HEADER} v{release} at the fixes' targets; generated, do not edit.",
             f"# fix, target (overlay:name), its syntax tree's sha256 ({DIGITS} digits) or {ABSENT}"]
    for fix_id, by_target in found.items():
        lines += [f"{fix_id} {target} {value}" for target, value in by_target.items()]
    return "\n".join(lines) + "\n"


def parse(text: str) -> Fingerprints:
    found: Fingerprints = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            fix_id, target, value = line.split()
            found.setdefault(fix_id, {})[target] = value
    return found


def of_tree(series: Series, release: Version, tree: Path, base: str) -> str:
    """The fingerprints file of ``release`` from its git tree (what ``regen`` writes)."""
    from vllm_patches import _git

    def read(overlay: str) -> str | None:
        shown = _git.run(tree, "show", f"{base}:{_series.Fix.upstream_path(overlay)}",
                         check=False)
        return shown.stdout if shown.returncode == 0 else None

    return render(release, compute(series, release, _series.PACKAGE_DIR, read))


def installed_reader(package: str) -> Reader:
    """Reads the installed ``package``'s source files (vLLM's, where the runtime installs)."""
    spec = importlib.util.find_spec(package)
    directory = Path(spec.origin).parent if spec is not None and spec.origin else None

    def read(overlay: str) -> str | None:
        try:
            return (directory / overlay).read_text() if directory else None
        except (OSError, UnicodeDecodeError):
            return None

    return read


def candidate(series: Series, release: Version) -> Version | None:
    """The covered release an uncovered ``release`` is compared with: the newest covered release not
    newer than it, of its minor series (v0.33.0 for v0.33.1; a new minor series is ported, not
    assumed: None), or of any series for a development build or pre-release (v0.33.0 for
    ``0.34.0rc1.dev3``), which the series never covers."""
    if release.is_devrelease or release.is_prerelease:
        base = Version(release.base_version)
        return max((r for r in series.covered if r <= base), default=None)
    same = [r for r in series.covered if r.release[:2] == release.release[:2] and r <= release]
    return max(same, default=None)


def recorded(release: Version) -> Fingerprints | None:
    """The committed fingerprints of a covered release (None: the file is missing)."""
    path = _patchset.release_dir(release) / FILE
    return parse(path.read_text()) if path.is_file() else None


def differences(expected: Fingerprints, actual: Fingerprints, ids: list[str]) -> list[str]:
    """The targets of fixes ``ids`` whose fingerprints differ, each with its fixes and how."""
    where: dict[str, list[str]] = {}
    how: dict[str, str] = {}
    for fix_id in ids:
        for target, value in expected.get(fix_id, {}).items():
            found = actual.get(fix_id, {}).get(target)
            if found != value:
                where.setdefault(target, []).append(fix_id)
                how[target] = "no source file" if found == NO_FILE else \
                    "source not parsable" if found == UNPARSABLE else \
                    "no longer defined" if found == ABSENT else \
                    "now defined" if value == ABSENT else "changed"
    return [f"{target} ({', '.join(fixes)}: {how[target]})" for target, fixes in where.items()]
