"""The ``vllm-patches`` command: verbs that each do one thing.

Exit codes: 0 done (or nothing to do, or a --check that passed); 1 refused (a chosen
patch conflicts or is blocked by one it requires, a chosen fix requires one neither
chosen nor applied, `revert` would leave an applied fix without one it requires, files
the series touches have local changes, a git operation of the user's is in progress,
another vllm-patches run still holds the repository after the wait (``_checkout.lock``), the
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

Each verb is one module of ``_commands``, imported when it runs: `--help`, `list` and
`status` never load libcst (splicing, for regen and matrix) or the network modules.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from vllm_patches import _interrupt
from vllm_patches._errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED, Refused, UserError
from vllm_patches._plural import count

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

    def verb(name: str, help_text: str) -> argparse.ArgumentParser:
        return verbs.add_parser(name, help=help_text, description=help_text)

    def release_option(sub: argparse.ArgumentParser, **kwargs) -> None:
        sub.add_argument("--release", type=_release_arg, metavar="vX.Y.Z", **kwargs)

    def fix_option(sub: argparse.ArgumentParser, verb_text: str) -> None:
        sub.add_argument("--fix", action="append", metavar="ID[,ID...]",
                         help=f"{verb_text} only these fixes (repeatable; default: all)")

    sub = verb("list", "the series, in order, with its metadata")
    sub.add_argument("-v", "--verbose", action="store_true", help="also What/Why/How/Future")

    sub = verb("status", "per fix: applicable, applied, applied or reverted but "
                                     "not committed, upstream, not applicable, conflict, or "
                                     "blocked (requires a fix that conflicts or is not chosen)")
    sub.add_argument("checkout", nargs="?", help=f"a vLLM git checkout ({DEFAULT_CHECKOUT})")
    release_option(sub, help="the checkout's release, if it cannot be detected")
    sub.add_argument("--3way", dest="three_way", action="store_true",
                     help="judge as `apply --3way` would (git may merge where context differs)")
    fix_option(sub, "show")

    sub = verb("apply", "apply the series (or the --fix ones) for the checkout's "
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

    sub = verb("revert", "undo the applied fixes (or the --fix ones), all or "
                                     "nothing")
    sub.add_argument("checkout", nargs="?", help=f"a vLLM git checkout ({DEFAULT_CHECKOUT})")
    release_option(sub, help="the checkout's release, if it cannot be detected")
    sub.add_argument("--check", action="store_true", help="only say whether it would revert")
    sub.add_argument("--no-commit", action="store_true",
                     help="change the work tree only instead of adding revert commits")
    fix_option(sub, "revert")

    sub = verb("export", "one fix as an upstream pull request: the fix and its "
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

    sub = verb("regen", "regenerate patches/ from the overlays (needs the dev "
                                   "extras: pip install -e '.[dev]')")
    sub.add_argument("--check", action="store_true",
                     help="fail (exit 1) if patches/ differs from what the overlays generate")
    release_option(sub, action="append", help="only this covered release (repeatable)")

    sub = verb("fetch", "fetch a release's source archive into a cached git checkout")
    sub.add_argument("release_positional", type=_release_arg, metavar="RELEASE")
    sub.add_argument("--from", dest="source", metavar="CHECKOUT",
                     help="take the release from this vLLM git checkout (its tag vX.Y.Z) "
                          "instead of the index's source archive")

    sub = verb("matrix", "per covered release: does each fix splice, is it "
                                     "upstream, or not needed")
    sub.add_argument("--write-readme", action="store_true",
                     help="also write the table into the generated section of "
                          "docs/supported-releases.md (README links to it; the option keeps "
                          "its name from when README held the table)")
    sub.add_argument("--cached-only", action="store_true",
                     help="only the releases already fetched (no network)")

    sub = verb("cache", "show the cache of fetched releases and reclaim its space")
    choice = sub.add_mutually_exclusive_group()
    choice.add_argument("--remove", nargs="+", type=_release_arg, metavar="vX.Y.Z",
                        help="remove these releases (fetch brings them back)")
    choice.add_argument("--prune", action="store_true",
                        help="remove the downloaded archives (each checkout holds its files), "
                             "releases the series does not cover, and interrupted fetches")
    choice.add_argument("--clear", action="store_true", help="remove everything")

    sub = verb("doctor", "this Python's vLLM and kvcached, the fixes active in it, "
                                     "and known-bad combinations")
    sub.add_argument("-tp", "--tensor-parallel-size", type=int, metavar="N",
                     help="the tensor parallelism you serve with (checks kvcached < 0.1.6)")
    sub.add_argument("--no-load", action="store_true",
                     help="do not load vLLM's general plugins; show what they would activate")

    sub = verb("diagnose", "the series' bugs in vLLM logs: per symptom found, "
                                         "how often, the release and fixes active there, "
                                         "the fix that removes it and its option")
    sub.add_argument("logs", nargs="+", metavar="LOG",
                     help="a log file (plain or gzip; kubectl logs output too), - for stdin")
    sub.add_argument("--json", action="store_true", help="the findings as a JSON list")
    sub.epilog = ("What no log line shows, so diagnose cannot name it: docs/operator-guide.md, "
                  "\"What the logs say\".")
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
        return _run(args)
    except Refused as exc:
        print(f"vllm-patches: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except UserError as exc:
        print(f"vllm-patches: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        sys.stdout = stdout


def _run(args: argparse.Namespace) -> int:
    """The verb's module (``_commands``), imported now, runs the verb."""
    verb = importlib.import_module(f"vllm_patches._commands.{args.verb}")
    if args.verb == "export":  # export's entry takes the values, not the namespace
        from vllm_patches._catalog import series as _series

        return verb.command(_series.load(), args.fix, args.release, args.onto, args.output,
                            args.three_way, args.check)
    return verb.run(args)
