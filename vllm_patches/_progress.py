"""Progress of slow work (downloads, regen, matrix) on one rewritten line of stderr.

Shown only when stderr is a terminal: piped or captured output (CI logs, scripts) gets
the results alone. Steps nest (``matrix v0.19.0 (3/23) · fetching 12/45 MB``); a step's
line is cleared when it ends, so results printed to stdout between steps stay clean.
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
def step(text: str) -> Iterator[None]:
    """Show ``text`` (after the steps it runs within) while the block runs."""
    _steps.append(text)
    try:
        if _enabled():
            _show()
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
