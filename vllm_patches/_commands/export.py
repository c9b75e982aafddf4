"""`vllm-patches export`: one fix as the pull request a contributor sends upstream.

The fix and every fix it requires, one commit each (the release's patch plus the fix's
tests), by the contributor's git identity (none guessed), built on a base in a scratch
store (``_git.Commits``); ``--onto`` applies them with ``git am``, all or nothing. Every
word is upstream's: commit messages from the fixes' title, Why and How, the description
from ``export.*``, the base's template filled in, true on the base's release.
A backport (a fix upstream since a later release) is for the release branch of its base
(the v0.23 branch for a v0.23.0 base) and says which PR it backports; main needs nothing.
"""

from __future__ import annotations

import ast
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from vllm_patches import _git
from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._catalog.patchset import PatchSet
from vllm_patches._catalog.series import Fix, Series
from vllm_patches._checkout import plan as _plan
from vllm_patches._checkout.checkout import Checkout, opened
from vllm_patches._engine.splice import Overlay
from vllm_patches._errors import Refused, UserError
from vllm_patches._plural import count

# Plain `git am` strips the subject's [Bugfix][NIXL] tags along with [PATCH k/n].
GIT_AM = "git am --keep-non-patch"
COVER_FILE = "pr-description.md"
TITLE_FILE = "pr-title.txt"
TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
# The sections of every covered release's template, for a base that has none.
TEMPLATE_SECTIONS = ("Purpose", "Test Plan", "Test Result")
# The checklist items the description does what they ask, as the templates' items open:
# up to v0.31 its purpose, test plan and results; from v0.32 testing and validation (the
# tests fail without the change and pass with it) and its contents (summary, links,
# evidence, root cause and design). Design fit, code quality, AI assistance and
# documentation are the contributor's to judge.
FULFILLED = ("The purpose of the PR", "The test plan", "The test results",
             "**Testing and Validation:**", "**Pull Request Contents:**")


@dataclass(frozen=True)
class Contributor:
    """Who signs the export off: author and committer as git itself resolves them (its
    configuration or GIT_* environment), never a guessed one."""

    author: _git.Identity
    committer: _git.Identity

    @classmethod
    def of(cls, where: Path) -> Contributor:
        """The contributor git commits as in ``where``; refused when git would guess."""
        author = _git.Identity.configured(where, "AUTHOR")
        committer = _git.Identity.configured(where, "COMMITTER")
        if author is None or committer is None:
            raise Refused("no git identity to sign the patches off with; set yours: git "
                          "config --global user.name 'Your Name' && git config --global "
                          "user.email you@example.com (vLLM's DCO needs your own "
                          "Signed-off-by)")
        return cls(author, committer)

    def env(self) -> dict[str, str]:
        return self.author.env(self.committer)


@dataclass(frozen=True)
class Step:
    """One patch of the series: it applies on the base, conflicts (git's reason), or was
    not tried because an earlier patch it is built on conflicts."""

    number: int
    total: int
    fix: Fix
    error: str | None = None
    blocked_by: str | None = None

    def line(self) -> str:
        state = ("applies" if self.error is None and self.blocked_by is None
                 else f"conflict ({self.error})" if self.error is not None
                 else f"not tried (needs {self.blocked_by})")
        return f"{self.number}/{self.total} {self.fix.id} {self.fix.slug}: {state}"


@dataclass(frozen=True)
class Export:
    """A fix's series for one release on one base: its steps and, when all apply, its patches."""

    fix: Fix
    fixes: tuple[Fix, ...]  # the series: what ``fix`` requires, then ``fix``, in series order
    named: tuple[str, ...]  # requirements not in the series, and why (upstream, not needed)
    release: Version
    base_text: str  # the commit the series is built on, as upstream knows it
    steps: tuple[Step, ...]
    patches: tuple[tuple[str, str], ...]  # (file name, text) as git format-patch writes them
    template: str | None = None  # the base's pull request template, if it has one
    upstream_tests: tuple[str, ...] = ()  # the series' upstream suites the base has
    amended_tests: tuple[str, ...] = ()  # upstream tests the series changes (test_overlays)

    @property
    def applies(self) -> bool:
        return all(step.error is None and step.blocked_by is None for step in self.steps)

    @property
    def title(self) -> str:
        """The pull request's title: the fix's own when the series is the fix alone
        (what it requires is upstream or not needed on the base), else the title that
        covers them all."""
        return self.fix.series_title if len(self.fixes) > 1 else self.fix.title

    def touched(self) -> list[str]:
        """Every path the series may change: the fixes' upstream files, their tests and
        the tests' helper modules."""
        tests = {test for f in self.fixes for test in (*f.tests, *f.test_overlays)}
        return sorted({Fix.upstream_path(o) for f in self.fixes for o in f.overlays}
                      | tests | set(test_helpers(tests)))

    @property
    def backport_of(self) -> Version | None:
        """The release upstream has had the fix since, when the base predates it: the
        pull request is then a backport to the base's release."""
        return self.fix.upstream_since

    def summary(self) -> str:
        text = (f"{self.fix.id} for vLLM v{self.release}, on {self.base_text}: "
                f"{count(len(self.fixes), 'patch', 'patches')}")
        required = [f.id for f in self.fixes if f is not self.fix]
        if required:
            text += f" ({self.fix.id} requires {', '.join(required)}: included, applied first)"
        return text + "".join(f"; {note}" for note in self.named)


def fix_test_file(test: str) -> Path:
    """A fix test's source: in this repository, or bundled in the package (wheel install)."""
    for root in (_series.PACKAGE_DIR / "fix_tests", _series.REPO_DIR):
        if (root / test).is_file():
            return root / test
    raise UserError(f"fix test {test} not found (install vllm-patches from its repository)")


def _repository_file(path: str) -> Path | None:
    try:
        return fix_test_file(path)
    except UserError:
        return None


def test_helpers(tests: Iterable[str]) -> list[str]:
    """The modules beside ``tests`` that they import (``from .nixl_harness import``),
    and those import, which this repository has and which are not test modules:
    shipped with the tests. Upstream's own (``utils.py``) are on the base already."""
    found: list[str] = []
    pending = list(tests)
    while pending:
        test = pending.pop()
        source = _repository_file(test)
        if source is None:
            continue
        folder = Path(test).parent
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            names = [node.module] if node.module else [a.name for a in node.names]
            for name in names:
                helper = str(folder / f"{name.replace('.', '/')}.py")
                if (not Path(helper).name.startswith("test_") and helper not in found
                        and _repository_file(helper) is not None):
                    found.append(helper)
                    pending.append(helper)
    return sorted(found)


def commit_message(fix: Fix) -> str:
    """The fix as an upstream commit: its PR-style title, Why and How. Upstream needs none
    of the vendor trailers of patches/ (Origin, Forwarded, ...); the Signed-off-by line is
    git format-patch's own (-s)."""
    return "\n\n".join([fix.title, f"Why:\n{fix.why}", f"How:\n{fix.how}"]) + "\n"


def _release_patches(series: Series, release: Version) -> dict[str, Path]:
    """The committed patch of each fix ``release`` needs, by fix id."""
    return {patch.fix.id: patch.path for patch in PatchSet.load(series, release).patches}


def build(series: Series, fix: Fix, release: Version, repo: Path, contributor: Contributor,
          three_way: bool = False, onto: bool = False) -> Export:
    """``fix``'s series for ``release``, built on ``repo``'s HEAD in a scratch store.

    ``onto``: ``repo`` is the contributor's checkout. When its HEAD is a commit
    upstream knows (a clone of upstream's git), the patches name it (``base-commit:``).
    A release's source archive committed as it is (the cached checkout, or a clone of
    it: ``_releases.is_archive_import``) is unknown upstream: the description names
    the upstream commit the release was built from instead, and no patch names a base.
    """
    wanted = series.with_requirements(fix, release)
    fixes = tuple(f for f in wanted if f.on(release).needed)
    if fix.on(release).need is _series.Need.UPSTREAM:
        raise Refused(f"{fix.id} is upstream on v{release}: vLLM has had it since "
                      f"v{fix.upstream_since}{f' ({fix.pr})' if fix.pr else ''}; "
                      "nothing to send")
    if fix not in fixes:
        raise UserError(f"{fix.id} has no patch for v{release}: {fix.on(release)}")
    named = tuple(f"{f.id} {f.on(release)}" for f in wanted if f not in fixes)
    base = _git.head(repo)
    upstream_base = onto and not _releases.is_archive_import(repo)
    if upstream_base:
        base_text = f"commit {base[:12]}"
    else:
        version = _releases.declared_version(repo) or release
        upstream = _releases.upstream_commit(repo)
        base_text = f"vLLM v{version}" + (f" (upstream commit {upstream})" if upstream else "")
    template = _git.file_at(repo, base, TEMPLATE)
    release_patches = _release_patches(series, release)
    steps: list[Step] = []
    patches: list[tuple[str, str]] = []
    with _git.commits(repo, base, contributor.env(), isolated=False) as commits:
        suites = tuple(dict.fromkeys(suite for f in fixes for suite in f.upstream_tests
                                     if commits.base_has(suite.partition("::")[0])))
        blocked_by = None
        for number, each in enumerate(fixes, start=1):
            if blocked_by is not None:
                steps.append(Step(number, len(fixes), each, blocked_by=blocked_by))
                continue
            error = _add_fix(commits, each, release_patches[each.id], three_way)
            steps.append(Step(number, len(fixes), each, error))
            if error is not None:
                blocked_by = each.id
                continue
            commits.commit(commit_message(each))
        if blocked_by is None:
            patches = commits.patches("-s", *([f"--base={base}"] if upstream_base else []))
    return Export(fix, fixes, named, release, base_text, tuple(steps), tuple(patches),
                  template, suites, _amended_tests(fixes, release))


def _amended_tests(fixes: tuple[Fix, ...], release: Version) -> tuple[str, ...]:
    """The upstream tests the series' patches change on ``release`` (their fixes'
    ``test_overlays``), by name."""
    ids = [f.id for f in fixes]
    return tuple(definition.name for f in fixes for test in f.test_overlays
                 for definition in Overlay.parse(fix_test_file(test)).select(ids, release)
                 if definition.fix == f.id)


def _add_fix(commits: _git.Commits, fix: Fix, patch: Path, three_way: bool) -> str | None:
    """Stage ``fix``'s patch and its tests; None, or why it cannot."""
    error = commits.apply(patch, three_way)
    if error is not None:
        return error
    if not commits.changed():
        # A 3-way merge of a change the base already has succeeds and changes nothing.
        return "changes nothing: the base has it already"
    for test in fix.tests:
        if commits.base_has(test):
            return f"{test} exists on the base already"
        commits.write(test, fix_test_file(test).read_text())
    # A helper an earlier commit of the series wrote is written again unchanged.
    for helper in test_helpers(fix.tests):
        commits.write(helper, fix_test_file(helper).read_text())
    return None


def _unwrap(text: str) -> str:
    """Paragraphs on one line each: GitHub shows every newline of a PR description."""
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))


def _words(export: Export, fix: Fix) -> _series.PullRequestText:
    """What ``fix``'s pull request says on the series' release (``Fix.on`` decides)."""
    words = fix.on(export.release).words
    assert words is not None, f"{fix.id} is needed on v{export.release} and has words"
    return words


def upstream_ref(url: str) -> str:
    """An upstream issue or PR as GitHub links it inside upstream's repository (``#N``)."""
    prefix = "https://github.com/vllm-project/vllm/"
    return "#" + url.rsplit("/", 1)[1] if url.startswith(prefix) else url


def _minor(release: Version) -> str:
    return f"{release.major}.{release.minor}"


def _overview(export: Export) -> str:
    """What the series fixes in a line or two, the issue it fixes (``Fixes`` only of an
    issue: a PR is related to), and where it stands to the upstream PR it relates to,
    or to the release that has it (a backport)."""
    fix = export.fix
    text = _unwrap(_words(export, fix).purpose)
    if fix.bug and fix.bug != fix.pr and not _series.is_pull_request(fix.bug):
        text += f" Fixes {upstream_ref(fix.bug)}."
    if fix.pr_relation:
        text += f"\n\n{_unwrap(fix.pr_relation)}"
    if export.backport_of is not None:
        text += (f"\n\nBackport to v{export.release} of {fix.backport or 'the fix'}, in vLLM "
                 f"since v{export.backport_of}: for the v{_minor(export.release)} release "
                 "branch, not main.")
    return text


def _full_reasoning(export: Export) -> str:
    if len(export.fixes) == 1:
        return "The commit message gives the full reasoning."
    return "Each commit message gives the full reasoning."


def _commits(export: Export) -> str:
    if len(export.fixes) == 1:
        return _full_reasoning(export)
    commits = "\n".join(f"{n}. {f.title}" for n, f in enumerate(export.fixes, start=1))
    return (f"{len(export.fixes)} commits, each with its tests and built on the ones before "
            f"it:\n\n{commits}\n\n{_full_reasoning(export)}")


def _claims(export: Export) -> str:
    """One bullet per commit: its subject without the ``[Tag]`` prefixes."""
    return "\n".join("- " + f.title.rpartition("] ")[2] for f in export.fixes)


def _test_plan(export: Export) -> str:
    tests = [test for f in export.fixes for test in f.tests]
    command = "pytest -q " + " \\\n    ".join([*tests, *export.upstream_tests])
    return f"On CPU, on {export.base_text}:\n\n```bash\n{command}\n```"


def _test_result(export: Export) -> str:
    release, fixes = export.release, export.fixes
    reproducing = sum(len(f.stock_fails) for f in fixes)
    result = (f"Without this change the {reproducing} tests that reproduce the "
              f"{'bugs' if len(fixes) > 1 else 'bug'} fail on v{release}; with it every "
              "test passes")
    skipped = sum(len(f.deselected(release)) for f in fixes) if export.upstream_tests else 0
    if skipped:
        result += f" but {skipped} of the existing ones that need a GPU, model weights or nixl"
    amended = ", ".join(f"`{name}`" for name in export.amended_tests)
    return result + "." + (f" It updates {amended}, whose expectation it changes (the "
                           "test's comment says how)." if amended else "")


# A series of more commits than this describes only its last one in Details: the root
# causes of five commits do not fit a two-minute read, and the commits it builds on are
# named under Claims and explained in their own commit messages.
DETAILED_COMMITS = 2


def _root_causes(export: Export) -> str:
    """Root cause and design of each commit in a few sentences (of the last one only in a
    series longer than DETAILED_COMMITS): the commit messages hold the full reasoning,
    which a reviewer reads in the diff."""
    if len(export.fixes) == 1:
        return _unwrap(_words(export, export.fix).details)
    if len(export.fixes) > DETAILED_COMMITS:
        built_on = count(len(export.fixes) - 1, "commit")
        return (f"**{export.fix.title.rpartition('] ')[2]}.** "
                f"{_unwrap(_words(export, export.fix).details)}\n\nIt builds on the "
                f"{built_on} before it (under Claims), each explained in its commit message.")
    return "\n\n".join(f"**{f.title.rpartition('] ')[2]}.** {_unwrap(_words(export, f).details)}"
                       for f in export.fixes)


def _sections(export: Export) -> dict[str, str]:
    """The text of each section the releases' templates have: Purpose, Test Plan and Test
    Result up to v0.31; Overview, Claims, Validation and Details from v0.32. What the
    templates ask for is short (an overview in a line or two): the reasoning a reviewer
    needs in two minutes is here, the rest stays in the commit messages."""
    plan, result = _test_plan(export), _test_result(export)
    overview, causes = _overview(export), _root_causes(export)
    return {"Purpose": f"{overview}\n\n{causes}\n\n{_commits(export)}", "Test Plan": plan,
            "Test Result": result, "Overview": overview, "Claims": _claims(export),
            "Validation": f"{plan}\n\n{result}",
            "Details": f"{causes}\n\n{_full_reasoning(export)}"}


def _template(export: Export) -> str:
    return export.template or "".join(f"## {name}\n\n" for name in TEMPLATE_SECTIONS)


def unfilled_sections(export: Export) -> list[str]:
    """The template's sections export writes nothing into (the contributor's to fill)."""
    known = _sections(export)
    headings = (line[3:].strip() for line in _template(export).splitlines()
                if line.startswith("## "))
    return [heading for heading in headings if heading not in known]


def cover_text(export: Export) -> str:
    """The PR description: the base's pull request template (the covered releases'
    sections when it has none) filled in, in upstream's words. What the template says
    to write is dropped where export wrote it (the text before its first section, a
    filled section's comments); its checklist stays, the items the description does
    what they ask (``FULFILLED``) ticked, the others (optional ones, the contributor's
    own: AI assistance, design fit) left to the contributor."""
    sections = _sections(export)
    lines: list[str] = []
    part, section = "preamble", ""
    for line in _template(export).splitlines():
        if line.startswith("## "):
            part, section = "sections", line[3:].strip()
            lines += [line, "", sections[section]] if section in sections else [line]
            continue
        if part == "sections" and line.startswith("---"):
            part = "checklist"  # and the footer
        comment = line.startswith("<!--")
        if (part == "preamble" and line.strip() and not comment) or (
                part == "sections" and comment and section in sections):
            continue
        if part == "checklist" and line.startswith("- [ ] ") and line[6:].startswith(FULFILLED):
            line = "- [x] " + line[6:]
        if line.strip() or (lines and lines[-1].strip()):  # no run of blank lines
            lines.append(line)
    return "\n".join(lines) + "\n"


def _refuse_unready(checkout: Checkout, touched: list[str]) -> None:
    """Refuse what git am would trip over or take with it; the checkout stays as it is."""
    busy = checkout.operation_in_progress()
    if busy:
        raise Refused(busy)
    if checkout.has_staged():
        raise Refused(f"{checkout.path}: the index has staged changes; git am needs it clean")
    dirty = checkout.dirty(touched)
    if dirty:
        raise Refused(f"{checkout.path}: local changes or untracked files where the series "
                      f"writes: {', '.join(dirty)}")


def _write(export: Export, directory: Path) -> list[Path]:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise UserError(f"{directory}: exists and is not an empty directory; name a new one")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in export.patches:
        (directory / name).write_text(text)
        written.append(directory / name)
    (directory / TITLE_FILE).write_text(export.title + "\n")
    (directory / COVER_FILE).write_text(cover_text(export))
    return [*written, directory / TITLE_FILE, directory / COVER_FILE]


def _newest_release_with(series: Series, fix: Fix) -> Version:
    for release in reversed(series.covered):
        if fix.on(release).needed:
            return release
    raise UserError(f"{fix.id} has no patch for any covered release")


def command(series: Series, fix_id: str, release: Version | None, onto: str | None,
            output: str | None, three_way: bool, check: bool) -> int:
    """The `export` verb (see ``_cli``): prints what it did; raises on refusal."""
    fix = series.fix(fix_id)
    if onto is None:
        if three_way or check:
            raise UserError("--3way and --check go with --onto CHECKOUT")
        contributor = Contributor.of(Path.cwd())  # before any download: refuse early
        release = release or _newest_release_with(series, fix)
        series.require_covered(release)
        export = build(series, fix, release, _releases.fetch(release), contributor)
        return _report(export, output, to_stdout=output is None)

    # Refuses what is not a vLLM git checkout; locked like `apply` (_lock).
    with opened(Path(onto), "export --onto" + (" --check" if check else ""),
                writes=not check) as checkout:
        return _onto(series, fix, release, checkout, output, three_way, check)


def _onto(series: Series, fix: Fix, release: Version | None, checkout: Checkout,
          output: str | None, three_way: bool, check: bool) -> int:
    """`export --onto`, on a checkout whose lock the caller holds."""
    note = None
    if release is None:
        found = _releases.identify(checkout.path)
        release = found.release
        if release is None:
            # A main clone or a development build: the patches of the covered release
            # whose files it shares most (git merges where it moved on, with --3way).
            nearest, evidence, _exact = _plan.nearest_release(checkout, series, found.hint)
            release = nearest if fix.on(nearest).needed else _newest_release_with(
                series, fix)
            note = (f"{found.why}; using the v{release} patches ({evidence}; --release "
                    "to choose)")
    series.require_covered(release)
    contributor = Contributor.of(checkout.path)
    if note:
        print(f"{checkout.path}: {note}")
    export = build(series, fix, release, checkout.path, contributor, three_way=three_way,
                   onto=True)
    _refuse_unready(checkout, export.touched())
    _report(export, output, to_stdout=False)
    if check:
        print(f"check passed: the series applies onto {checkout.path}")
        return 0
    problem = checkout.unwritable(export.touched(), commits=True)
    if problem:
        raise Refused(problem)
    with tempfile.TemporaryDirectory() as scratch:
        written = _write(export, Path(scratch) / "series")
        checkout.am([path for path in written if path.suffix == ".patch"], contributor.env())
    branch = checkout.branch() or "HEAD"
    print(f"applied onto {checkout.path} ({branch}): {count(len(export.patches), 'commit')}, "
          f"signed off; the PR title: {export.title}")
    print("the PR description:\n")
    print(cover_text(export), end="")
    return 0


def _report(export: Export, output: str | None, to_stdout: bool) -> int:
    """Per-patch lines and what was written; the mbox itself on stdout when ``to_stdout``."""
    lines = [export.summary(), *(f"  {step.line()}" for step in export.steps)]
    if export.backport_of is not None:
        lines.append(f"upstream has had {export.fix.id} since v{export.backport_of}: this "
                     f"PR is a backport to v{export.release}, for upstream's "
                     f"v{_minor(export.release)} release branch, not main")
    if export.template is None:
        lines.append(f"the base has no {TEMPLATE}: the description has the sections "
                     f"{', '.join(TEMPLATE_SECTIONS)} and no checklist")
    lines += [f"the template's section '{heading}' is yours to fill in"
              for heading in unfilled_sections(export)]
    if not export.applies:
        print("\n".join(lines), file=sys.stderr if to_stdout else sys.stdout)
        failed = next(step for step in export.steps if step.error is not None)
        raise Refused(f"the series does not apply on {export.base_text}: {failed.line()}")
    if output is not None:
        written = _write(export, Path(output))
        lines.append("wrote " + ", ".join(str(path) for path in written))
        lines.append("apply it on your branch with: " + " ".join(
            [GIT_AM, *(str(path) for path in written if path.suffix == ".patch")]))
        lines.append(f"the PR title is {written[-2]}, the PR description {written[-1]}")
    elif to_stdout:
        lines.append(f"pipe it into: {GIT_AM} (-o DIR also writes the PR description)")
    print("\n".join(lines), file=sys.stderr if to_stdout else sys.stdout)
    if to_stdout:
        sys.stdout.write("".join(text for _, text in export.patches))
    return 0
