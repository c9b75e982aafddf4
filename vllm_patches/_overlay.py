"""How an overlay names its upstream target.

An overlay module mirrors one upstream module (``vllm_patches/v1/core/x.py`` changes
``vllm/v1/core/x.py``). Each top-level definition in it carries one marker:

``@amend(fix, releases)`` on a class
    A partial class: each member replaces the upstream class's member of the same
    name, or is added to that class when upstream has none. The upstream class
    must exist.
``@amend(fix, releases)`` on a function
    Replaces the upstream module-level function of the same name, which must exist.
``@add(fix, releases)`` on a class or function
    A new module-level definition; upstream must not have one of that name.

``releases`` is a PEP 440 specifier set (``">=0.18.0,<0.24.0"``). Where one upstream
file needs different code in different releases, the variants sit side by side in
the overlay, each with its range; ranges of one fix's variants of a name must not
overlap.

Inside an amended class, the class's own docstring describes the overlay and is
not spliced; an assignment ``__doc__ = "..."`` (a string literal) replaces the upstream class
docstring. ``@call_at_end_of("__init__")`` on a new method appends
``self.<method>()`` as the last statement of that upstream method, so new state is
set up without replacing a long upstream ``__init__``.

Module-level imports of the overlay are the imports its definitions need; the
splice adds to the upstream module those it lacks and the spliced code uses.

The markers only record facts (they return their argument unchanged), so an overlay
module imports cleanly, and its functions can be installed onto the live upstream
classes. Overlay code must therefore not use zero-argument ``super()``, and every
global name it uses must resolve in the upstream module once the imports are added.
"""

from __future__ import annotations

from typing import Callable, TypeVar

Definition = TypeVar("Definition")

AMEND = "amend"
ADD = "add"


def _marker(kind: str, fix: str, releases: str) -> Callable[[Definition], Definition]:
    def mark(definition: Definition) -> Definition:
        definition.__vllm_patches__ = (kind, fix, releases)  # type: ignore[attr-defined]
        return definition

    return mark


def amend(fix: str, releases: str) -> Callable[[Definition], Definition]:
    """Replace or extend the upstream definition of the same name."""
    return _marker(AMEND, fix, releases)


def add(fix: str, releases: str) -> Callable[[Definition], Definition]:
    """A new module-level definition that upstream does not have."""
    return _marker(ADD, fix, releases)


def call_at_end_of(method: str) -> Callable[[Definition], Definition]:
    """Run the decorated (new, argument-less) method at the end of upstream ``method``."""

    def mark(definition: Definition) -> Definition:
        definition.__vllm_patches_call_at_end_of__ = method  # type: ignore[attr-defined]
        return definition

    return mark
