"""README's examples of the runtime plugin's log line are lines the plugin can log.

Issue 19, item 3: README showed ``active: F1; upstream: none; not applicable: none`` for
v0.21.0, where every fix of the series is needed, so no process could log it.
"""

from __future__ import annotations

import re

from packaging.version import Version

from vllm_patches import _runtime, _series

README = (_series.REPO_DIR / "README.md").read_text()
SERIES = _series.load()
LINE = re.compile(r"^vllm-patches on vLLM v(\S+): .*$", re.MULTILINE)


def possible_lines(release: Version) -> set[str]:
    """What a process on ``release`` logs: every fix, each single fix and each pair chosen
    with VLLM_PATCHES_FIXES, each also as already in the source tree (a patched checkout)."""
    ids = [fix.id for fix in SERIES.fixes]
    choices = [ids, *([i] for i in ids), *([a, b] for a in ids for b in ids if a < b)]
    lines = set()
    for chosen in choices:
        states = _runtime.plan(SERIES, release, _runtime.selected_ids(
            SERIES, {_runtime.ENV_FIXES: ",".join(chosen)}))
        lines.add(_runtime.Activation(release, states).line())
        for state in states:
            if state.state == _runtime.ACTIVE:
                state.state = _runtime.IN_SOURCE
        lines.add(_runtime.Activation(release, states).line())
    return lines


def test_readme_shows_plugin_lines_that_can_occur():
    shown = LINE.findall(README)
    assert shown, "README shows no plugin line"
    for match in LINE.finditer(README):
        line = match.group(0)
        assert line in possible_lines(Version(match.group(1))), line


def test_readme_shows_the_line_of_a_disabled_plugin():
    prose = " ".join(README.split())  # README wraps the line in its prose
    assert _runtime.Activation(None, [], disabled=True).line() in prose
