"""Drop the upper bounds of overlay markers that start no other variant.

A marker's range says where a variant starts (``>=0.24.0``); an upper bound belongs
there only where another variant of the same definition starts (``_splice.
unstarted_bounds``). The newest release the series is verified on is series.toml's
last ``covered`` entry, written once. This rewrites, with libcst, the ``releases``
string of each marker that still ends at a bound no variant starts
(``@amend("F2", ">=0.24.0,<0.34.0")`` becomes ``@amend("F2", ">=0.24.0")``) and
touches nothing else; markers never reach the patches, so ``regen --check`` stays
byte-identical.

    .venv/bin/python tools/drop_bounds.py F2 F3 F4     # rewrite their overlays
    .venv/bin/python tools/drop_bounds.py --check      # exit 1 if any fix has such a bound

After rewriting a fix, remove it from ``_splice.TRANSITIONAL_BOUNDS``:
tests/tool/test_splice.py then checks it strictly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import libcst as cst
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vllm_patches import _series, _splice


class _DropBounds(cst.CSTTransformer):
    """Rewrites the markers of one overlay file: ``drops`` maps (top-level position,
    fix, range) to the bounds to drop from that marker's range."""

    def __init__(self, drops: dict[tuple[int, str, SpecifierSet], set[str]]) -> None:
        self.drops = drops
        self.position = -1
        self.depth = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return self._enter()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return self._enter()

    def _enter(self) -> bool:
        if self.depth == 0:
            self.position += 1
        self.depth += 1
        return self.depth == 1  # only top-level definitions carry markers

    def leave_ClassDef(self, original, updated):
        self.depth -= 1
        return updated

    def leave_FunctionDef(self, original, updated):
        self.depth -= 1
        return updated

    def leave_Decorator(self, original: cst.Decorator, updated: cst.Decorator) -> cst.Decorator:
        call = updated.decorator
        if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name)
                and call.func.value in _splice.MARKERS and len(call.args) >= 2):
            return updated
        fix, releases = (arg.value for arg in call.args[:2])
        assert isinstance(fix, cst.SimpleString) and isinstance(releases, cst.SimpleString)
        key = (self.position, fix.evaluated_value, SpecifierSet(releases.evaluated_value))
        if key not in self.drops:
            return updated
        kept = [clause.strip() for clause in releases.evaluated_value.split(",")
                if clause.strip() not in self.drops[key]]
        quote = releases.quote
        text = cst.SimpleString(f"{quote}{','.join(kept)}{quote}")
        args = [call.args[0], call.args[1].with_changes(value=text), *call.args[2:]]
        return updated.with_changes(decorator=call.with_changes(args=args))


def drop(root: Path, fix_ids: list[str]) -> list[Path]:
    """Rewrite the overlays under ``root`` of ``fix_ids``; the files changed."""
    series = _series.load()
    paths = [root / overlay for fix in series.fixes for overlay in fix.overlays]
    by_file: dict[Path, dict[tuple[int, str, SpecifierSet], set[str]]] = {}
    for bound in _splice.unstarted_bounds(paths):
        d = bound.definition
        if d.fix in fix_ids:
            key = (d.position, d.fix, d.releases)
            by_file.setdefault(d.source, {}).setdefault(key, set()).add(f"<{bound.end}")
    for path, drops in by_file.items():
        module = cst.parse_module(path.read_text())
        path.write_text(module.visit(_DropBounds(drops)).code)
    return sorted(by_file)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixes", nargs="*", help="the fixes whose markers to rewrite")
    parser.add_argument("--root", type=Path, default=_series.PACKAGE_DIR,
                        help="the overlays' root (default: vllm_patches/)")
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; exit 1 if a fix has such a bound")
    args = parser.parse_args()
    series = _series.load()
    if args.check:
        bounds = _splice.unstarted_bounds(args.root / o for f in series.fixes for o in f.overlays)
        for bound in bounds:
            print(bound)
        return 1 if bounds else 0
    unknown = set(args.fixes) - set(series.ids)
    if unknown or not args.fixes:
        parser.error(f"name fixes of the series ({', '.join(series.ids)})")
    for path in drop(args.root, args.fixes):
        print(f"rewrote {path.relative_to(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
