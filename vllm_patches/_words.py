"""Counts in output: ``1 item``, ``2 items``, never ``(1 items)`` or ``item(s)``.

Only the standard library, so that the runtime plugin can use it (``_runtime``).
"""

from __future__ import annotations


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` with ``noun`` in the right number (``plural`` where it is not noun + s)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
