"""The ``vllm-patches`` command: verbs that each do one thing.

Exit codes: 0 done (or nothing to do, or a --check that passed); 1 refused (a chosen
patch conflicts or is blocked by one it requires, a chosen fix requires one neither
chosen nor applied, `revert` would leave an applied fix without one it requires, files
the series touches have local changes, a git operation of the user's is in progress,
another vllm-patches run still holds the repository after the wait (``_lock``), the
checkout is the tool's cache, patches/ is stale; `status`: a chosen fix conflicts or is
blocked; `matrix`: a release needs a fix that does not splice there, or the index has a
release the series does not cover; `doctor`: a known-bad combination, the plugin would
stop vLLM from starting, or the environment leaves the fixes out (VLLM_PLUGINS without
vllm_patches, or VLLM_PATCHES_FIXES naming a fix the series lacks); without vLLM in its
Python doctor warns that no fix is or would be active, and exits 0 unless the
environment is such; `diagnose`: a symptom found in the logs); 2 bad input (bad
arguments, an unknown fix id in --fix, a file or missing path, not a git repository,
not a vLLM tree, a release that is not vX.Y.Z, that the series does not cover, that
cannot be told, or that the checkout's own release contradicts, a log `diagnose` cannot
read: missing, binary or empty; `regen` and `matrix` without ruff, from the dev extras,
said before anything is fetched); 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM, with one line
that says whether the checkout was changed: `apply`, `revert` and `export --onto` leave
it exactly as before or exactly as after, never half done (``_interrupt``). A reader
that leaves early
(``vllm-patches list -v | head``) changes no exit code: the rest of the output is
dropped and the verb ends with its own code. Whether a write fails depends on timing
(output that fits the pipe's buffer is written before ``head`` leaves), so 141, as a
shell reports a command killed by SIGPIPE, would tell a script when its reader left,
not whether the command did its job.

Each verb imports what it needs when it runs: `--help`, `list` and `status` never load
libcst (splicing, for regen and matrix) or the network modules.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from vllm_patches import _interrupt
from vllm_patches._errors import Refused, UserError
from vllm_patches._plural import count

EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2
# Without a CHECKOUT, status, apply and revert work where the user is (``_resolve_checkout``).
DEFAULT_CHECKOUT = ("default: the vLLM checkout the current directory is in, else "
                    "./vllm-vX.Y.Z of the release")


class _ReaderMayLeave:
    """stdout whose reader may go away (``| head``): from the first write that finds the
    pipe closed on, output goes to /dev/null and the verb runs on to its own exit code."""

    def __init__(self, stream):
        self._stream = stream

    def _drop_the_rest(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop_the_rest()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop_the_rest()
            self._stream.flush()  # what was buffered goes to /dev/null

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _release_arg(text: str):
    from vllm_patches._catalog import releases as _releases
    from vllm_patches._catalog import series as _series

    try:
        return _releases.parse_release(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(
            f"{exc}; the series covers {_series.load().describe_covered()}") from None


def cmd_list(args: argparse.Namespace) -> int:
    from vllm_patches._catalog import series as _series

    series = _series.load()
    for number, fix in enumerate(series.fixes, start=1):
        upstream = f"upstream since v{fix.upstream_since}" if fix.upstream_since else "not upstream"
        if fix.backport:
            upstream = f"backport of PR {fix.backport} ({upstream})"
        print(f"{number}. {fix.id} {fix.slug}: {fix.title}")
        print(f"   needed on vLLM {fix.describe_needed()}; {upstream}")
        print(f"   bug {fix.bug}" + (f"; PR {fix.pr}" if fix.pr else ""))
        if args.verbose:
            for label, text in (("What", fix.what), ("Why", fix.why), ("How", fix.how),
                                ("Future", fix.future)):
                print(f"   {label}: " + "\n     ".join(text.splitlines()))
    lanes = ", ".join(f"v{r}" for r in series.lanes)
    print(f"patches for every release {series.describe_covered()} ({len(series.covered)}); "
          f"tests run on the lanes {lanes} (default v{series.default_release})")
    return EXIT_OK


def _chosen(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The fix ids of every ``--fix`` (repeated, or comma lists), in series order; None
    without one. An unknown id is bad input, refused before anything is read."""
    if not args.fix:
        return None
    from vllm_patches._catalog import series as _series

    series = _series.load()
    given = {part.strip() for value in args.fix for part in value.split(",")}
    unknown = sorted(given - set(series.ids))
    if unknown:
        raise UserError(f"unknown fix {', '.join(unknown)} (the series has "
                        f"{', '.join(series.ids)})")
    return tuple(fix_id for fix_id in series.ids if fix_id in given)


def _plan(checkout, args: argparse.Namespace, verb: str, three_way: bool = False):
    from vllm_patches._catalog import series as _series
    from vllm_patches._checkout import plan as _plan

    series = _series.load()
    release = _plan.resolve_release(checkout, series, args.release, verb)
    return _plan.make(checkout, series, release, three_way, _chosen(args))


def _opened(args: argparse.Namespace, verb: str, writes: bool):
    """The checkout under its repository's lock (``_checkout.opened``) for the verb."""
    from vllm_patches._checkout import checkout as _checkout

    check = getattr(args, "check", False)
    return _checkout.opened(Path(args.checkout), verb + (" --check" if check else ""),
                            writes=writes and not check)


def _print_plan(plan) -> None:
    print(f"{plan.checkout.path}: vLLM v{plan.release}")
    for status in plan.statuses:
        print(f"  {status.line()}")
    busy = plan.checkout.operation_in_progress()
    for note in [*plan.notes(), *([busy] if busy else [])]:
        print(f"  note: {note}")


def cmd_status(args: argparse.Namespace) -> int:
    from vllm_patches._checkout.plan import State

    _chosen(args)
    with _opened(args, "status", writes=False) as checkout:
        plan = _plan(checkout, args, "status", args.three_way)
        _print_plan(plan)
    stopped = (State.CONFLICT, State.BLOCKED)
    return EXIT_REFUSED if any(s.state in stopped for s in plan.statuses) else EXIT_OK


def _resolve_checkout(args: argparse.Namespace) -> Path | None:
    """Where the verb works, as an interruption names it (None: on no checkout). Without
    a CHECKOUT, ``args.checkout`` becomes the vLLM checkout the current directory is in,
    else ./vllm-vX.Y.Z of the release where it exists; else `apply` fetches it there
    (``args.checkout`` stays None) and the other verbs refuse."""
    if args.verb == "export":
        return Path(args.onto) if args.onto else None
    if not hasattr(args, "checkout"):
        return None
    if args.checkout is None:
        from vllm_patches._catalog import series as _series
        from vllm_patches._checkout import checkout as _checkout

        release = args.release or _series.load().default_release
        here = Path.cwd()
        target = _checkout.vllm_tree_around(here) or here / f"vllm-v{release}"
        if target.exists():
            args.checkout = str(target)
        elif args.verb == "apply":
            return here  # nothing of it is changed until the fetched copy is patched
        else:
            raise UserError(f"no CHECKOUT given, and {here} is in no vLLM checkout and has no "
                            f"vllm-v{release}: name one (`vllm-patches {args.verb} PATH`), or "
                            f"fetch v{release} and apply the series there (`vllm-patches apply`)")
    return Path(args.checkout)


@contextmanager
def _default_checkout(release) -> Iterator[Path]:
    """A fresh working copy of the (default) release in ./vllm-vX.Y.Z, for the block
    (`apply` with no CHECKOUT, outside a vLLM checkout). A signal that ends the run before
    `apply` changed it removes the copy this run made: the directory is there, patched,
    or not at all."""
    from vllm_patches import _git
    from vllm_patches._catalog import releases as _releases
    from vllm_patches._catalog import series as _series

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


def cmd_apply(args: argparse.Namespace) -> int:
    from vllm_patches._checkout import apply_revert as _apply_revert

    _chosen(args)
    with (_default_checkout(args.release) if args.checkout is None
          else nullcontext(Path(args.checkout))) as path:
        args.checkout = str(path)
        with _opened(args, "apply", writes=True) as checkout:
            plan = _plan(checkout, args, "apply", args.three_way)
            done, after = _apply_revert.apply(plan, commit=not args.no_commit, check=args.check,
                                       again=_again(args, checkout.path))
            return _report(after, done, args.check, "applies", "apply")


def cmd_revert(args: argparse.Namespace) -> int:
    from vllm_patches._checkout import apply_revert as _apply_revert

    _chosen(args)
    with _opened(args, "revert", writes=True) as checkout:
        plan = _plan(checkout, args, "revert")
        done, after = _apply_revert.revert(plan, commit=not args.no_commit, check=args.check)
        return _report(after, done, args.check, "reverts", "revert")


def _again(args: argparse.Namespace, path: Path) -> str:
    """This apply command with ``{fixes}`` for other --fix ids (a conflict's refusal)."""
    options = [*([f"--release v{args.release}"] if args.release else []),
               *(["--3way"] if args.three_way else []),
               *(["--no-commit"] if args.no_commit else []), *(["--check"] if args.check else [])]
    return " ".join(["vllm-patches apply", *options, "--fix {fixes}", str(path)])


def _report(plan, done, check: bool, verb: str, noun: str) -> int:
    _print_plan(plan)
    ids = ", ".join(s.fix.id for s in done)
    if not done:
        print(f"nothing to {noun}")
    elif check:
        print(f"check passed: {ids} {verb} cleanly")
    else:
        print(f"done: {ids}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from vllm_patches import _export
    from vllm_patches._catalog import series as _series

    return _export.command(_series.load(), args.fix, args.release, args.onto, args.output,
                           args.three_way, args.check)


def cmd_regen(args: argparse.Namespace) -> int:
    from vllm_patches import _progress
    from vllm_patches._catalog import patchset as _patchset
    from vllm_patches._catalog import releases as _releases
    from vllm_patches._catalog import series as _series
    from vllm_patches._engine import patch_writer as _patch_writer

    series = _series.load()
    for release in args.release or ():
        series.require_covered(release)
    _patch_writer.require_ruff()
    releases = args.release or list(series.covered)
    stale = []
    if not args.release:  # directories of releases the series no longer covers
        for directory in sorted(_patchset.patches_dir().glob("v*")):
            if directory.is_dir() and directory.name not in {f"v{r}" for r in series.covered}:
                if args.check:
                    stale.append(f"{directory.name}: not a covered release")
                    continue
                for path in directory.iterdir():
                    path.unlink()
                directory.rmdir()
                print(f"{directory.name}: removed (not covered)")
    for number, release in enumerate(releases, start=1):
        with _progress.step(f"regen v{release} ({number}/{len(releases)})"):
            files = _patch_writer.render(series, release, _releases.fetch(release))
        existing = _patchset.committed(release)
        if files == existing:
            print(f"v{release}: up to date ({count(_patch_count(files), 'patch', 'patches')})")
            continue
        if args.check:
            changed = sorted(name for name in files.keys() | existing.keys()
                             if files.get(name) != existing.get(name))
            stale.append(f"v{release}: {', '.join(changed)}")
            continue
        directory = _patchset.release_dir(release)
        directory.mkdir(parents=True, exist_ok=True)
        for name in existing.keys() - files.keys():
            (directory / name).unlink()
        for name, text in files.items():
            (directory / name).write_text(text)
        print(f"v{release}: wrote {count(_patch_count(files), 'patch', 'patches')} to {directory}")
    if stale:
        raise Refused("patches/ is stale, run `vllm-patches regen`: " + "; ".join(stale))
    return EXIT_OK


def _patch_count(files: dict[str, str]) -> int:
    return sum(name.endswith(".patch") for name in files)


def cmd_fetch(args: argparse.Namespace) -> int:
    from vllm_patches._catalog import releases as _releases

    if args.source:
        print(_releases.fetch_from_checkout(args.release_positional, Path(args.source)))
    else:
        print(_releases.fetch(args.release_positional))
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    from vllm_patches import _matrix
    from vllm_patches._catalog import cache as _cache
    from vllm_patches._catalog import releases as _releases
    from vllm_patches._catalog import series as _series
    from vllm_patches._engine import patch_writer as _patch_writer

    series = _series.load()
    if args.write_readme and args.cached_only:
        raise UserError("--write-readme needs every covered release; drop --cached-only")
    _patch_writer.require_ruff()
    cached = set(_releases.cached_releases())
    if args.cached_only:
        releases, uncovered = [r for r in series.covered if r in cached], []
    else:
        releases = list(series.covered)
        uncovered = [r for r in _matrix.releases_in_range(series, _releases.sdist_releases())
                     if r not in series.covered]
        missing = [r for r in releases if r not in cached]
        if missing:  # minutes of downloading: say so before the first
            print(f"matrix: fetching {count(len(missing), 'release')} not in the cache "
                  f"({_cache.human(_releases.download_size(missing))} to download; "
                  "`--cached-only` skips them)", file=sys.stderr, flush=True)
    rows = _matrix.compute(series, releases)
    sys.stdout.write(_matrix.render(series, rows, uncovered))
    if args.write_readme:
        doc = _series.REPO_DIR / _matrix.DOC
        if not doc.is_file():
            raise UserError(f"{doc}: no such file (run from a vllm-patches checkout)")
        doc.write_text(_matrix.replace_section(doc.read_text(),
                                               _matrix.generated_section(series, rows)))
        print(f"wrote the matrix into {doc}")
    broken = [r for r in rows if any(c.state in _matrix.PROBLEMS for c in r.cells.values())]
    return EXIT_REFUSED if broken or uncovered else EXIT_OK


def cmd_cache(args: argparse.Namespace) -> int:
    from vllm_patches._catalog import cache as _cache
    from vllm_patches._catalog import series as _series

    series = _series.load()
    if args.remove:
        chosen = _cache.of_releases(args.remove)
        absent = [r for r in args.remove if r not in {entry.release for entry in chosen}]
        for release in dict.fromkeys(absent):  # nothing to do: exit 0, as the contract says
            print(f"v{release}: nothing of this release is cached in {_cache.root()}")
        if not chosen:
            return EXIT_OK
        removed = _cache.remove(chosen)
    elif args.prune:
        removed = _cache.remove(_cache.prunable(series))
    elif args.clear:
        removed = _cache.remove(_cache.entries())
    else:
        print("\n".join(_cache.report(series)))
        return EXIT_OK
    print(f"removed {_cache.human(sum(e.size for e in removed))} "
          f"({count(len(removed), 'item')}) from {_cache.root()}")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from vllm_patches import _doctor

    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size must be 1 or more, not {args.tensor_parallel_size}")
    lines, bad = _doctor.report(args.tensor_parallel_size, load=not args.no_load)
    print("\n".join(lines))
    return EXIT_REFUSED if bad else EXIT_OK


def cmd_diagnose(args: argparse.Namespace) -> int:
    from vllm_patches import _diagnose

    return _diagnose.report(args.logs, args.json)


class _Version(argparse.Action):
    """``--version``: the package's version and the releases the series covers, one line;
    computed when asked (reading the series), not for every command line."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        import importlib.metadata

        from vllm_patches._catalog import series as _series

        series = _series.load()
        print(f"{parser.prog} {importlib.metadata.version('vllm-patches')} (vLLM "
              f"{series.describe_covered()}, {count(len(series.covered), 'release')})")
        parser.exit(EXIT_OK)


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line on stderr (and exit 2), not argparse's usage block."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-patches", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version,
                        help="the version and the vLLM releases it covers")
    verbs = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, func, help_text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(func=func)
        return sub

    def release_option(sub: argparse.ArgumentParser, **kwargs) -> None:
        sub.add_argument("--release", type=_release_arg, metavar="vX.Y.Z", **kwargs)

    def fix_option(sub: argparse.ArgumentParser, verb_text: str) -> None:
        sub.add_argument("--fix", action="append", metavar="ID[,ID...]",
                         help=f"{verb_text} only these fixes (repeatable; default: all)")

    sub = verb("list", cmd_list, "the series, in order, with its metadata")
    sub.add_argument("-v", "--verbose", action="store_true", help="also What/Why/How/Future")

    sub = verb("status", cmd_status, "per fix: applicable, applied, applied or reverted but "
                                     "not committed, upstream, not applicable, conflict, or "
                                     "blocked (requires a fix that conflicts or is not chosen)")
    sub.add_argument("checkout", nargs="?", help=f"a vLLM git checkout ({DEFAULT_CHECKOUT})")
    release_option(sub, help="the checkout's release, if it cannot be detected")
    sub.add_argument("--3way", dest="three_way", action="store_true",
                     help="judge as `apply --3way` would (git may merge where context differs)")
    fix_option(sub, "show")

    sub = verb("apply", cmd_apply, "apply the series (or the --fix ones) for the checkout's "
                                   "release, all or nothing (finishes a half-applied series)")
    sub.add_argument("checkout", nargs="?",
                     help=f"a vLLM git checkout ({DEFAULT_CHECKOUT}; where neither is, "
                          "fetch the release into ./vllm-vX.Y.Z and apply there)")
    release_option(sub, help="the checkout's release (default: detected; without a checkout, "
                             "the default lane)")
    sub.add_argument("--check", action="store_true", help="only say whether it would apply")
    sub.add_argument("--3way", dest="three_way", action="store_true",
                     help="let git fall back to a 3-way merge")
    sub.add_argument("--no-commit", action="store_true",
                     help="change the work tree only instead of one commit per fix (git am)")
    fix_option(sub, "apply")

    sub = verb("revert", cmd_revert, "undo the applied fixes (or the --fix ones), all or "
                                     "nothing")
    sub.add_argument("checkout", nargs="?", help=f"a vLLM git checkout ({DEFAULT_CHECKOUT})")
    release_option(sub, help="the checkout's release, if it cannot be detected")
    sub.add_argument("--check", action="store_true", help="only say whether it would revert")
    sub.add_argument("--no-commit", action="store_true",
                     help="change the work tree only instead of adding revert commits")
    fix_option(sub, "revert")

    sub = verb("export", cmd_export, "one fix as an upstream pull request: the fix and its "
                                     "tests, with the fixes it requires, signed off by you")
    sub.add_argument("fix", help="fix id, e.g. F1")
    release_option(sub, help="whose patches (default: the --onto checkout's release, else the "
                             "newest covered release that has the fix)")
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

    sub = verb("regen", cmd_regen, "regenerate patches/ from the overlays (needs the dev "
                                   "extras: pip install -e '.[dev]')")
    sub.add_argument("--check", action="store_true",
                     help="fail (exit 1) if patches/ differs from what the overlays generate")
    release_option(sub, action="append", help="only this covered release (repeatable)")

    sub = verb("fetch", cmd_fetch, "fetch a release's source archive into a cached git checkout")
    sub.add_argument("release_positional", type=_release_arg, metavar="RELEASE")
    sub.add_argument("--from", dest="source", metavar="CHECKOUT",
                     help="take the release from this vLLM git checkout (its tag vX.Y.Z) "
                          "instead of the index's source archive")

    sub = verb("matrix", cmd_matrix, "per covered release: does each fix splice, is it "
                                     "upstream, or not needed")
    sub.add_argument("--write-readme", action="store_true",
                     help="also write the table into the generated section of "
                          "docs/supported-releases.md (README links to it; the option keeps "
                          "its name from when README held the table)")
    sub.add_argument("--cached-only", action="store_true",
                     help="only the releases already fetched (no network)")

    sub = verb("cache", cmd_cache, "show the cache of fetched releases and reclaim its space")
    choice = sub.add_mutually_exclusive_group()
    choice.add_argument("--remove", nargs="+", type=_release_arg, metavar="vX.Y.Z",
                        help="remove these releases (fetch brings them back)")
    choice.add_argument("--prune", action="store_true",
                        help="remove the downloaded archives (each checkout holds its files), "
                             "releases the series does not cover, and interrupted fetches")
    choice.add_argument("--clear", action="store_true", help="remove everything")

    sub = verb("doctor", cmd_doctor, "this Python's vLLM and kvcached, the fixes active in it, "
                                     "and known-bad combinations")
    sub.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                     help="the tensor parallelism you serve with (checks kvcached < 0.1.6)")
    sub.add_argument("--no-load", action="store_true",
                     help="do not load vLLM's general plugins; show what they would activate")

    sub = verb("diagnose", cmd_diagnose, "the series' bugs in vLLM logs: per symptom found, "
                                         "how often, the release and fixes active there, "
                                         "the fix that removes it and its option")
    sub.add_argument("logs", nargs="+", metavar="LOG",
                     help="a log file (plain or gzip; kubectl logs output too), - for stdin")
    sub.add_argument("--json", action="store_true", help="the findings as a JSON list")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the verb of ``argv`` (None: this process's command line, whose signal handlers
    then stay until it exits; given: a caller in this process, whose handlers are put
    back) and return its exit code. A SIGINT or SIGTERM, from the first statement on, is
    one line and 130 or 143 (``_interrupt``)."""
    try:  # outside the handlers' block: a signal that lands as they are set is caught too
        with _interrupt.handled(restore=argv is not None):
            try:
                code = _main(argv)
            finally:
                _interrupt.stop()  # a signal that comes later changes nothing
            _interrupt.raise_lost()
            return code
    except _interrupt.Interrupted as exc:
        print(f"vllm-patches: {exc}", file=sys.stderr)
        return exc.exit_code


def _main(argv: list[str] | None) -> int:
    stdout, sys.stdout = sys.stdout, _ReaderMayLeave(sys.stdout)
    try:
        args = build_parser().parse_args(argv)
        _interrupt.about(_resolve_checkout(args), args.verb)
        return args.func(args)
    except Refused as exc:
        print(f"vllm-patches: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except UserError as exc:
        print(f"vllm-patches: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        sys.stdout = stdout
