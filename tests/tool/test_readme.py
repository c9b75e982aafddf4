"""README and docs/: what a reader runs and reads is what the tool does.

README is the first screen: what the project is, the two commands that take a new user
from a clone to a result (apply the series; run every test, as CI does), and links into
docs/ for the rest. Its commands once sat at lines 85 and 97 of 863, after tables;
these tests keep them on the first screen, README short, and every relative link
of README and docs/ pointing at a file and heading that exist.

The examples of the runtime plugin's log line are lines the plugin can log
(README once showed ``active: F1; upstream: none; not applicable: none`` for v0.21.0,
where every fix of the series is needed, so no process could log it), and the CLI
reference names every option each verb takes.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_patches import _cli
from vllm_patches._catalog import series as _series
from vllm_patches._engine import runtime as _runtime

REPO = _series.REPO_DIR
README_PATH = REPO / "README.md"
README = README_PATH.read_text()
DOCS = [README_PATH, *sorted((REPO / "docs").rglob("*.md"))]
# Whatever links into them: a section that moves must not leave a link behind.
LINKING = [*DOCS, REPO / "CONTRIBUTING.md", REPO / "benchmarks" / "README.md"]
SERIES = _series.load()
LINE = re.compile(r"^[ \t]*(vllm-patches on vLLM v(\S+): .*)$", re.MULTILINE)  # a list indents it

FIRST_SCREEN = 40  # lines a terminal or a repository page shows before scrolling
MOST_LINES = 130  # room for a few more fixes; the details live in docs/
APPLY = "python3 -m venv .venv && . .venv/bin/activate && pip install . && vllm-patches apply"
TEST = "bash tools/test.sh"


def user_docs() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def possible_lines(release: Version) -> set[str]:
    """What a process on ``release`` logs: every fix, each single fix and each pair chosen
    with VLLM_PATCHES_FIXES that holds its requirements, each also as already in the
    source tree (a patched checkout)."""
    ids = [fix.id for fix in SERIES.fixes]
    choices = [ids, *([i] for i in ids), *([a, b] for a in ids for b in ids if a < b)]
    lines = set()
    for chosen in choices:
        environ = {_runtime.ENV_FIXES: ",".join(chosen)}
        ids = _runtime.selected_ids(SERIES, environ)
        try:
            _runtime.require_requirements(SERIES, release, ids, environ)
        except _runtime.ActivationError:
            continue  # refused: a fix without one it requires (test_runtime)
        states = _runtime.fix_states(SERIES, release, ids)
        lines.add(_runtime.Activation(release, states).line())
        for state in states:
            if state.state == _runtime.ACTIVE:
                state.state = _runtime.IN_SOURCE
        lines.add(_runtime.Activation(release, states).line())
    return lines


def test_docs_show_plugin_lines_that_can_occur():
    text = user_docs()
    assert LINE.findall(text), "the docs show no plugin line"
    for match in LINE.finditer(text):
        line = match.group(1)
        assert line in possible_lines(Version(match.group(2))), line


def test_docs_show_the_line_of_a_disabled_plugin():
    prose = " ".join(user_docs().split())  # the docs wrap the line in their prose
    assert _runtime.Activation(None, [], disabled=True).line() in prose


def fenced_blocks(text: str) -> list[tuple[int, list[str]]]:
    """Each fenced code block: the line number (1-based) of its opening fence, its lines."""
    blocks, current = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is None:
                current = (number, [])
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current[1].append(line)
    return blocks


def test_the_two_commands_are_on_the_first_screen():
    """Exactly two commands before the first screen ends: apply, then every test."""
    first = [block for block in fenced_blocks(README) if block[0] <= FIRST_SCREEN]
    assert [lines for _, lines in first] == [[APPLY], [TEST]]
    assert all(start + 2 <= FIRST_SCREEN for start, _ in first)


def test_ci_runs_the_readme_test_command():
    assert TEST in (REPO / ".ci" / "run").read_text().splitlines()


def test_readme_is_short():
    assert len(README.splitlines()) <= MOST_LINES


def test_readme_summarises_the_supported_releases():
    """README's summary says what the generated matrix (docs/) holds: range, count, lanes."""
    covered = SERIES.covered
    prose = " ".join(README.split())
    assert f"from v{covered[0]} to v{covered[-1]} ({len(covered)} releases)" in prose
    for lane in SERIES.lanes:
        assert f"v{lane}" in prose


def headings(text: str) -> set[str]:
    """The anchors GitHub gives ``text``'s headings: lowercase, punctuation dropped but
    ``-`` and ``_``, spaces to ``-``, a repeated one numbered."""
    anchors: set[str] = set()
    in_code = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        heading = re.match(r"^#{1,6}\s+(.+?)\s*$", line)
        if heading and not in_code:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            numbered, n = slug, 0
            while numbered in anchors:
                n += 1
                numbered = f"{slug}-{n}"
            anchors.add(numbered)
    return anchors


def relative_links(text: str) -> list[str]:
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    prose = re.sub(r"```.*?```", "", prose, flags=re.DOTALL)
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [t for t in targets if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("doc", LINKING, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    for link in relative_links(doc.read_text()):
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        assert target.exists(), f"{doc.name}: {link}: no {target}"
        if anchor:
            assert target.suffix == ".md", f"{doc.name}: {link}: an anchor into a non-Markdown file"
            assert anchor in headings(target.read_text()), f"{doc.name}: {link}: no such heading"


def verbs() -> dict[str, argparse.ArgumentParser]:
    parser = _cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_cli_reference_names_every_verb_and_option():
    """docs/cli.md's usage block has one line per verb holding each of its options, and a
    section per verb: a verb or option added to the CLI is added to the reference."""
    reference = (REPO / "docs" / "cli.md").read_text()
    usage = fenced_blocks(reference)[0][1]
    sections = headings(reference)
    for name, parser in verbs().items():
        (line,) = [u for u in usage if u.split()[:2] == ["vllm-patches", name]]
        words = set(re.findall(r"(?<![\w-])-{1,2}[\w-]+", line))
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in words, f"docs/cli.md: `{name}` lacks {option}"
        assert name in sections, f"docs/cli.md: no section for `{name}`"
