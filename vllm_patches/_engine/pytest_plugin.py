"""pytest plugin for runtime mode: load vLLM's general plugins when pytest starts.

``python -m pytest -p vllm_patches._engine.pytest_plugin ...`` in an environment where this
package is installed (so its ``vllm.general_plugins`` entry point is registered) runs
vLLM's own ``load_general_plugins()``, the call vLLM's engine core and workers make,
before any test is collected. The fixes then reach the tests the way they reach a
served model: through the entry point, honouring ``VLLM_PLUGINS`` and the
``VLLM_PATCHES_*`` variables. ``tools/lanes.py`` runs the fix tests on stock trees so.
"""

from __future__ import annotations

import pytest

from vllm_patches._engine import runtime as _runtime


def pytest_configure(config: pytest.Config) -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    if _runtime.current() is None:
        raise pytest.UsageError(
            "vllm-patches: vLLM loaded its general plugins, but the vllm_patches plugin did "
            "not run: the package is not installed in this environment (no entry point), "
            "VLLM_PLUGINS leaves it out, or its module failed to import (see vLLM's log)")


def pytest_report_header(config: pytest.Config) -> str | None:
    activation = _runtime.current()
    return activation.line() if activation else None


def pytest_terminal_summary(terminalreporter) -> None:
    activation = _runtime.current()
    if activation is not None:
        terminalreporter.write_line(activation.line())
