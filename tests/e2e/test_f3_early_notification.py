"""F3 with real NIXL agents: a pull notification that reaches the producer before the
producer registered the request (vllm PR 43509).

A CPU engine cannot race (the CPU platform forces synchronous scheduling, so
``start_load_kv`` always registers a request before ``get_finished`` reads its
notification), so ``scenarios.f3_early_notification`` drives a real NIXL producer worker
directly: a second real NIXL agent, as the decoder, READs the producer's registered host
memory with the pull-complete notification, the producer steps and reads it, and only
then registers the request. Stock drops the notification ("Potentially invalid KV
blocks") and holds the request until it expires; with F3 the notification is staged and
settled at registration: the request is released in the next step.
"""

from __future__ import annotations

import pytest
from harness import bug_expected, probe_events, run_scenario

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("mode", ["stock", "fixed"])
def test_notification_before_registration_releases_the_request(mode: str) -> None:
    record = run_scenario("f3_early_notification", mode)
    requests = record["requests"]
    if mode == "fixed":
        assert "F3" in record["activation"].partition("active: ")[2].split(";")[0], \
            f"F3 is not active: {record['activation']}"
    # The scenario: the producer's own NIXL agent delivered each pull's notification to
    # its worker before the worker registered the request.
    notified = [(e["t"], m.rsplit(":", 1)[0]) for e in probe_events(record["run_dir"])
                if e["event"] == "notifs" for m in e["msgs"]]
    assert sorted(req for _, req in notified) == sorted(requests), \
        f"the producer read notifications {notified}, expected one per request {requests}"
    assert all(t < record["t_registered"] for t, _ in notified), \
        "a notification was read after registration: the race was not reproduced"
    assert record["released_before_registration"] == []

    if bug_expected("F3", mode):
        assert record["held"] == requests and record["released_after_registration"] == [], \
            "stock released a request whose notification came early: bug not reproduced"
        assert len(record["invalid_lines"]) == len(requests)
    else:
        assert record["released_after_registration"] == requests, \
            f"held after registration: {record['held']}"
        assert record["held"] == []
        assert record["invalid_lines"] == []
