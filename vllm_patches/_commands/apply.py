"""`vllm-patches apply`: the series (or the chosen fixes) on a checkout, all or nothing;
without a CHECKOUT outside a vLLM checkout, on a fresh copy of the release."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from vllm_patches import _git, _interrupt
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._checkout import apply_revert as _apply_revert
from vllm_patches._commands.on_checkout import chosen, make_plan, opened, report


def run(args: argparse.Namespace) -> int:
    chosen(args)
    with (_default_checkout(args.release) if args.checkout is None
          else nullcontext(Path(args.checkout))) as path:
        args.checkout = str(path)
        with opened(args, "apply", writes=True) as checkout:
            plan = make_plan(checkout, args, "apply", args.three_way)
            done, after = _apply_revert.apply(plan, commit=not args.no_commit,
                                              check=args.check, again=_again(args, checkout.path))
            return report(after, done, args.check, "applies", "apply")


@contextmanager
def _default_checkout(release) -> Iterator[Path]:
    """A fresh working copy of the (default) release in ./vllm-vX.Y.Z, for the block
    (`apply` with no CHECKOUT, outside a vLLM checkout). A signal that ends the run before
    `apply` changed it removes the copy this run made: the directory is there, patched,
    or not at all."""
    release = release or _series.load().default_release
    target = Path.cwd() / f"vllm-v{release}"
    _series.load().require_covered(release)
    pristine = _releases.fetch(release)
    try:
        _git.run(Path.cwd(), "clone", "--quiet", str(pristine), str(target))
        print(f"fetched vLLM v{release} into {target}")
        yield target
    except _interrupt.Interrupted:
        if not _interrupt.changed():
            shutil.rmtree(target, ignore_errors=True)
        raise


def _again(args: argparse.Namespace, path: Path) -> str:
    """This apply command with ``{fixes}`` for other --fix ids (a conflict's refusal)."""
    options = [*([f"--release v{args.release}"] if args.release else []),
               *(["--3way"] if args.three_way else []),
               *(["--no-commit"] if args.no_commit else []), *(["--check"] if args.check else [])]
    return " ".join(["vllm-patches apply", *options, "--fix {fixes}", str(path)])
