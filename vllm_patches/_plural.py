"""Counts in output: ``1 item``, ``2 items``, never ``(1 items)`` or ``item(s)``.

Only the standard library, so that the runtime plugin can use it (``_engine.runtime``).
"""

from __future__ import annotations


def word(number: int, noun: str, plural: str | None = None) -> str:
    """``noun`` in the number ``number`` asks for (``plural`` where it is not noun + s)."""
    return noun if number == 1 else plural or noun + "s"


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun`` in the right number: ``1 item``, ``0 items``."""
    return f"{number} {word(number, noun, plural)}"
