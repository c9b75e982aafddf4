"""Progress of slow work (downloads, regen, matrix) on one rewritten line of stderr.

On a terminal, steps nest (``matrix v0.19.0 (3/23) · fetching 12/45 MB``) on one line
that is cleared when a step ends, so results printed to stdout between steps stay clean.
Piped or captured stderr (CI logs, scripts) gets no rewritten line: only the steps
started with ``logged=True`` (a release being downloaded, minutes of silence otherwise),
each once, as a plain line with the steps it runs within. stdout has the results alone
either way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

_steps: list[str] = []


def _enabled() -> bool:
    return sys.stderr.isatty()


def _show() -> None:
    # \r and "erase line": rewrite the line in place.
    sys.stderr.write("\r\033[K" + " · ".join(_steps) if _steps else "\r\033[K")
    sys.stderr.flush()


@contextmanager
def step(text: str, logged: bool = False) -> Iterator[None]:
    """Show ``text`` (after the steps it runs within) while the block runs; ``logged``:
    also as a line of its own where stderr is no terminal."""
    _steps.append(text)
    try:
        if _enabled():
            _show()
        elif logged:
            print(" · ".join(_steps), file=sys.stderr, flush=True)
        yield
    finally:
        _steps.pop()
        if _enabled():
            _show()


def update(text: str) -> None:
    """Replace the innermost step's text (a download's byte count)."""
    if _steps:
        _steps[-1] = text
        if _enabled():
            _show()
