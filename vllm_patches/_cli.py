"""The ``vllm-patches`` command: verbs that each do one thing.

Exit codes: 0 done (or nothing to do, or a --check that passed); 1 refused (a
patch conflicts, the series is half-applied, files the series touches have local
changes, patches/ is stale; `matrix`: a release needs a fix that does not splice
there; `doctor`: a known-bad combination, or the plugin would stop vLLM from
starting); 2 bad input (not a git repository, not a vLLM tree, unknown or
unsupported release, bad arguments).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packaging.version import Version

from vllm_patches import _doctor, _export, _git, _matrix, _patches, _releases, _series
from vllm_patches._checkout import Checkout, State
from vllm_patches._errors import Refused, UserError

EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2


def _release_arg(text: str) -> Version:
    try:
        return _releases.parse_release(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_list(args: argparse.Namespace) -> int:
    series = _series.load()
    for number, fix in enumerate(series.fixes, start=1):
        upstream = f"upstream since v{fix.upstream_since}" if fix.upstream_since else "not upstream"
        print(f"{number}. {fix.id} {fix.slug}: {fix.title}")
        print(f"   needed on vLLM {fix.releases}; {upstream}")
        print(f"   bug {fix.bug}" + (f"; PR {fix.pr}" if fix.pr else ""))
        if args.verbose:
            for label, text in (("What", fix.what), ("Why", fix.why), ("How", fix.how),
                                ("Future", fix.future)):
                print(f"   {label}: " + "\n     ".join(text.splitlines()))
    lanes = ", ".join(f"v{r}" for r in series.releases)
    print(f"patches generated for: {lanes} (default v{series.default_release})")
    return EXIT_OK


def _checkout(args: argparse.Namespace) -> Checkout:
    return Checkout(Path(args.checkout), args.release, _series.load())


def _print_statuses(checkout: Checkout, statuses) -> None:
    print(f"{checkout.path}: vLLM v{checkout.release}")
    for status in statuses:
        print(f"  {status.line()}")


def cmd_status(args: argparse.Namespace) -> int:
    checkout = _checkout(args)
    statuses = checkout.statuses()
    _print_statuses(checkout, statuses)
    return EXIT_REFUSED if any(s.state is State.CONFLICT for s in statuses) else EXIT_OK


def _default_checkout(release: Version | None) -> Path:
    """A fresh working copy of the (default) release in the current directory."""
    release = release or _series.load().default_release
    target = Path.cwd() / f"vllm-v{release}"
    if not target.exists():
        pristine = _releases.fetch(release)
        _git.run(Path.cwd(), "clone", "--quiet", str(pristine), str(target))
        print(f"fetched vLLM v{release} into {target}")
    return target


def cmd_apply(args: argparse.Namespace) -> int:
    if args.checkout is None:
        args.checkout = str(_default_checkout(args.release))
    checkout = _checkout(args)
    planned = checkout.apply(commit=not args.no_commit, three_way=args.three_way, check=args.check)
    return _report(checkout, planned, args.check, "applies", "apply")


def cmd_revert(args: argparse.Namespace) -> int:
    checkout = _checkout(args)
    planned = checkout.revert(commit=not args.no_commit, check=args.check)
    return _report(checkout, planned, args.check, "reverts", "revert")


def _report(checkout: Checkout, planned, check: bool, verb: str, noun: str) -> int:
    _print_statuses(checkout, checkout.statuses())
    ids = ", ".join(s.fix.id for s in planned)
    if not planned:
        print(f"nothing to {noun}")
    elif check:
        print(f"check passed: {ids} {verb} cleanly")
    else:
        print(f"done: {ids}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    return _export.command(_series.load(), args.fix, args.release, args.onto, args.output,
                           args.three_way, args.check)


def cmd_regen(args: argparse.Namespace) -> int:
    series = _series.load()
    releases = args.release or list(series.releases)
    stale = []
    for release in releases:
        series.require_supported(release)
        files = _patches.render(series, release, _releases.fetch(release))
        existing = _patches.committed(release)
        if files == existing:
            print(f"v{release}: up to date ({len(files) - 1} patches)")
            continue
        if args.check:
            changed = sorted(name for name in files.keys() | existing.keys()
                             if files.get(name) != existing.get(name))
            stale.append(f"v{release}: {', '.join(changed)}")
            continue
        directory = _patches.release_dir(release)
        directory.mkdir(parents=True, exist_ok=True)
        for name in existing.keys() - files.keys():
            (directory / name).unlink()
        for name, text in files.items():
            (directory / name).write_text(text)
        print(f"v{release}: wrote {len(files) - 1} patches to {directory}")
    if stale:
        raise Refused("patches/ is stale, run `vllm-patches regen`: " + "; ".join(stale))
    return EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    if args.source:
        print(_releases.fetch_from_checkout(args.release_positional, Path(args.source)))
    else:
        print(_releases.fetch(args.release_positional))
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    series = _series.load()
    if args.write_readme and args.cached_only:
        raise UserError("--write-readme needs every release of the range; drop --cached-only")
    available = _releases.cached_releases() if args.cached_only else _releases.sdist_releases()
    rows = _matrix.compute(series, _matrix.releases_in_range(series, available))
    sys.stdout.write(_matrix.render(series, rows))
    if args.write_readme:
        readme = _series.REPO_DIR / "README.md"
        if not readme.is_file():
            raise UserError(f"{readme}: no such file (run from a vllm-patches checkout)")
        readme.write_text(_matrix.replace_section(readme.read_text(),
                                                  _matrix.readme_section(series, rows)))
        print(f"wrote the matrix into {readme}")
    broken = [r for r in rows if any(c.state in _matrix.PROBLEMS for c in r.cells.values())]
    return EXIT_REFUSED if broken else EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size must be 1 or more, not {args.tensor_parallel_size}")
    lines, bad = _doctor.report(args.tensor_parallel_size, load=not args.no_load)
    print("\n".join(lines))
    return EXIT_REFUSED if bad else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-patches", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, func, help_text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(func=func)
        return sub

    def release_option(sub: argparse.ArgumentParser, **kwargs) -> None:
        sub.add_argument("--release", type=_release_arg, metavar="vX.Y.Z", **kwargs)

    sub = verb("list", cmd_list, "the series, in order, with its metadata")
    sub.add_argument("-v", "--verbose", action="store_true", help="also What/Why/How/Future")

    sub = verb("status", cmd_status, "per fix: applicable, applied, upstream, not applicable or conflict")
    sub.add_argument("checkout")
    release_option(sub, help="the checkout's release, if it cannot be detected")

    sub = verb("apply", cmd_apply, "apply the whole series for the checkout's release, all or nothing")
    sub.add_argument("checkout", nargs="?",
                     help="a vLLM git checkout (default: fetch the release into ./vllm-vX.Y.Z)")
    release_option(sub, help="the checkout's release (default: detected; without a checkout, "
                             "the default lane)")
    sub.add_argument("--check", action="store_true", help="only say whether it would apply")
    sub.add_argument("--3way", dest="three_way", action="store_true",
                     help="let git fall back to a 3-way merge")
    sub.add_argument("--no-commit", action="store_true",
                     help="change the work tree only (git apply) instead of commits (git am)")

    sub = verb("revert", cmd_revert, "undo the applied series, all or nothing")
    sub.add_argument("checkout")
    release_option(sub, help="the checkout's release, if it cannot be detected")
    sub.add_argument("--check", action="store_true", help="only say whether it would revert")
    sub.add_argument("--no-commit", action="store_true",
                     help="change the work tree only instead of adding revert commits")

    sub = verb("export", cmd_export, "one fix as an upstream pull request: the fix and its "
                                     "tests, with the fixes it requires, signed off by you")
    sub.add_argument("fix", help="fix id, e.g. F1")
    release_option(sub, help="whose patches (default: the --onto checkout's release, else the "
                             "newest lane that has the fix)")
    sub.add_argument("--onto", metavar="CHECKOUT",
                     help="your vLLM clone or branch: check the series applies on its HEAD and "
                          "git am it there (all or nothing)")
    sub.add_argument("--3way", dest="three_way", action="store_true",
                     help="with --onto: let git fall back to a 3-way merge")
    sub.add_argument("--check", action="store_true",
                     help="with --onto: only say whether it applies, per patch")
    sub.add_argument("-o", "--output", metavar="DIR",
                     help="write the patches and the PR description into this new directory "
                          "(default: the patches as one mbox on stdout)")

    sub = verb("regen", cmd_regen, "regenerate patches/ from the overlays")
    sub.add_argument("--check", action="store_true",
                     help="fail (exit 1) if patches/ differs from what the overlays generate")
    release_option(sub, action="append", help="only this lane (repeatable)")

    sub = verb("fetch", cmd_fetch, "fetch a release's source archive into a cached git checkout")
    sub.add_argument("release_positional", type=_release_arg, metavar="RELEASE")
    sub.add_argument("--from", dest="source", metavar="CHECKOUT",
                     help="take the release from this vLLM git checkout (its tag vX.Y.Z) "
                          "instead of the index's source archive")

    sub = verb("matrix", cmd_matrix, "per supported release: does each fix apply, is it "
                                     "upstream, or not needed")
    sub.add_argument("--write-readme", action="store_true",
                     help="also write the table into README.md's generated section")
    sub.add_argument("--cached-only", action="store_true",
                     help="only the releases already fetched (no network)")

    sub = verb("doctor", cmd_doctor, "this Python's vLLM and kvcached, the fixes active in it, "
                                     "and known-bad combinations")
    sub.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                     help="the tensor parallelism you serve with (checks kvcached < 0.1.6)")
    sub.add_argument("--no-load", action="store_true",
                     help="do not load vLLM's general plugins; show what they would activate")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Refused as exc:
        print(f"vllm-patches: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except UserError as exc:
        print(f"vllm-patches: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
