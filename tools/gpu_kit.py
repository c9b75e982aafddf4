"""Bring a CUDA vLLM onto the lent GPU machine and run F4's integration plan there.

A lent GPU machine has Python 3.12 with torch 2.11.0+cu130 and no network; it takes
at most 64 MiB of working tree per call, including what ``carry`` names, and keeps /tmp
while it stays warm. The CUDA vLLM wheel alone is 237 MiB, so it travels in parts:

  here:    python tools/gpu_kit.py split [--release v0.21.0] [--part-mib 40]
           downloads the vLLM wheel, the wheels of DEVICE_LACKS and builds this
           package's wheel into build/gpukit/wheels (ignored), cuts them into parts,
           packs the parts into build/gpukit/batch-NN folders of at most --part-mib,
           writes manifest.json (sha256 of every part and every whole file) into each
           folder, and prints the ready commands for the run tool (also in
           build/gpukit/COMMANDS.md): one upload call per batch (carry that folder),
           then one call each to reassemble + install and to run each mode.
  there:   python3 tools/gpu_kit.py reassemble /tmp/gpukit/parts /tmp/gpukit/wheels
           python3 tools/gpu_kit.py install /tmp/gpukit/wheels /tmp/site
           PYTHONPATH=/tmp/site python3 tools/gpu_kit.py run --modes fixed --out DIR
  anywhere: python tools/gpu_kit.py run --dry-run   # the plan as JSON, no GPU

``run`` is F4's integration plan (the upstream feature request's test plan, read
from /work/shared/seeds): an OpenAI API server with SimpleCPUOffloadConnector, a CPU
tier of --tier-gib (16-64) with ``async_register_cache``, CUDA graphs on
(--no-enforce-eager), facebook/opt-125m with dummy weights from tools/hf_home
(offline), once stock (the plugin off) and once fixed (F4 only). Per mode it records
the time to ready (/health), every request it sent after ready with its latency,
which of them completed while the tier was still pinning, when CPU offload started
(the scheduler's gate line, fixed) and F4's pin progress lines. Stock pins inside
startup, so its ready time includes the whole pin and no request meets the pin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))  # benchmarks/ and tests/e2e are no packages
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from _pin_window import GIB, percentiles

KIT = REPO / "build" / "gpukit"
MANIFEST = "manifest.json"
# The releases whose CUDA wheel pins torch==2.11.0, the GPU machine's torch (read
# from each wheel's METADATA; v0.25 moved on). Covered releases only.
TORCH_2_11 = ("v0.21.0", "v0.22.0", "v0.22.1", "v0.23.0", "v0.24.0")
# Each upload call's batch: well under the 64 MiB a call takes, leaving room for the
# working tree (about 4 MiB) and the manifest.
PART_MIB = 40
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
# Wheels the GPU machine lacks for vLLM v0.21.0's API server, pinned. How this list
# was made (2026-11-25): the wheel's Requires-Dist (no extras) minus the big GPU
# kernel packages in LEFT_OUT, resolved for Python 3.12 / manylinux_2_28 x86_64 with
# `uv pip compile` (metadata only; the newest versions the index had), then every
# name the GPU machine already holds removed (its package list,
# /work/.library/device/KINDS.md, "Python packages already there", read 2026-11-17).
# Installed with --no-deps, so versions of what the machine holds stay its own.
DEVICE_LACKS = [
    "agent-detector==2.0.0", "annotated-types==0.8.0", "anthropic==2.14.0",
    "apache-tvm-ffi==0.1.15.post2", "astor==0.8.1", "blake3==1.0.11", "cachetools==8.0.2",
    "cbor2==6.3.0", "cffi==2.1.1", "compressed-tensors==0.15.0.1", "cryptography==50.0.2",
    "depyf==0.20.0", "detect-installer==0.2.1", "dill==0.4.1", "diskcache==5.6.3",
    "dnspython==2.9.2", "docstring-parser==0.18.0", "email-validator==2.4.0",
    "fastapi==0.165.0", "fastapi-cli==0.0.34", "fastapi-cloud-cli==0.28.0",
    "fastar==0.12.0", "gguf==0.19.0", "googleapis-common-protos==1.76.0",
    "httpcore2==2.16.2", "httptools==0.9.0", "httpx2==2.16.2", "ijson==3.6.0",
    "interegular==0.3.3", "jiter==0.19.0", "jmespath==1.1.0", "jsonschema==4.26.0",
    "jsonschema-specifications==2025.9.1", "lark==1.2.2", "llguidance==1.3.0",
    "lm-format-enforcer==0.11.3", "loguru==0.7.3", "mcp==2.3.0", "mcp-types==2.3.0",
    "mistral-common==1.13.1", "model-hosting-container-standards==0.1.16",
    "msgspec==0.22.0", "nvidia-cuda-cccl==13.3.5.0.6", "openai==3.57.0",
    "openai-harmony==0.0.8", "opentelemetry-api==1.45.2",
    "opentelemetry-exporter-http-transport==0.66b2", "opentelemetry-exporter-otlp==1.45.2",
    "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2", "opentelemetry-proto==1.45.2",
    "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-semantic-conventions-ai==0.5.1", "outlines-core==0.2.14",
    "partial-json-parser==0.2.1.1.post7", "prometheus-fastapi-instrumentator==8.1.0",
    "pybase64==1.5.1", "pycountry==26.2.16", "pycparser==3.12", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "pydantic-extra-types==2.11.1", "pydantic-settings==2.16.3",
    "pyjwt==2.15.1", "python-dotenv==1.2.4", "python-json-logger==4.2.0",
    "python-multipart==0.0.34", "pyzmq==27.3.0", "referencing==0.37.0",
    "rich-toolkit==0.20.6", "rignore==0.8.1", "rpds-py==2026.9.1", "sentry-sdk==2.75.0",
    "setproctitle==1.3.8", "sniffio==1.3.1", "sse-starlette==3.7.0", "starlette==1.10.0",
    "supervisor==4.3.0", "truststore==0.10.5", "typing-inspection==0.4.5",
    "uvicorn==0.54.0", "watchfiles==1.3.0", "websockets==17.4", "xgrammar==0.2.8",
]
# vLLM v0.21.0 requirements the GPU machine lacks and the plan leaves out: kernels
# imported only on paths it does not take (OPT on an H100 runs FlashAttention, which
# the vLLM wheel bundles; dummy weights load no safetensors), and hundreds of MB.
LEFT_OUT = {
    "flashinfer-python": "FlashInfer backends/samplers: not chosen for OPT",
    "flashinfer-cubin": "FlashInfer's prebuilt kernels (hundreds of MB)",
    "tilelang": "kernels of other models",
    "nvidia-cutlass-dsl": "CuTe DSL kernels of other models (hundreds of MB)",
    "quack-kernels": "CuTe DSL kernels of other models",
    "tokenspeed-mla": "MLA attention (DeepSeek-style models)",
    "nvidia-cudnn-frontend": "cuDNN attention backend, not chosen",
    "fastsafetensors": "fast weight loading; dummy weights load none",
}

# F4's log lines (vllm_patches/v1/simple_kv_offload/worker.py and manager.py).
PIN_PROGRESS = "SimpleCPUOffloadWorker: pinned "
PINNED = re.compile(r"CPU KV cache \(([\d.]+) GB\) pinned in (\d+) chunks in ([\d.]+) s")
GATE_OPEN = re.compile(r"CPU offload is enabled, ([\d.]+) s after the scheduler started")
PIN_FAILED = "registering the CPU KV cache in the background failed"
MODES = {"stock": "none", "fixed": "F4"}  # scenarios.fixes_env's argument per mode


class KitError(Exception):
    """A refusal: one line, exit 1."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------------ split


def download(release: str, wheels: Path) -> None:
    """The vLLM wheel, DEVICE_LACKS and this package's wheel into ``wheels``."""
    if release not in TORCH_2_11:
        raise KitError(f"{release}: its CUDA wheel does not pin torch 2.11 (the GPU "
                       f"machine's); choose from {', '.join(TORCH_2_11)}")
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for names in ([f"vllm=={release.lstrip('v')}"], DEVICE_LACKS):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *platforms, "-d", str(wheels), *names],
                       check=True)
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([str(uv), "build", "-q", "--wheel", "--out-dir", str(wheels), str(REPO)],
                   check=True)


def split(wheels: Path, kit: Path, part_bytes: int) -> list[Path]:
    """Cut every wheel of ``wheels`` into parts of at most ``part_bytes``, pack the parts
    into ``kit``/batch-NN folders of at most ``part_bytes`` each (first fit, in
    order), and put the manifest into every folder. Returns the folders."""
    # Wheels only: uv build leaves a .gitignore there, which `cp dir/*` skips.
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise KitError(f"{wheels}: no wheels to split")
    for old in kit.glob("batch-*"):
        for path in old.iterdir():
            path.unlink()
        old.rmdir()
    manifest: dict[str, Any] = {"part_bytes": part_bytes, "files": []}
    batches: list[list[tuple[str, bytes]]] = [[]]
    filled = 0
    for path in files:
        entry = {"name": path.name, "size": path.stat().st_size, "sha256": sha256(path),
                 "parts": []}
        with open(path, "rb") as file:
            index = 0
            while data := file.read(part_bytes):
                name = f"{path.name}.part{index:03d}"
                entry["parts"].append({"name": name, "size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()})
                if filled + len(data) > part_bytes and batches[-1]:
                    batches.append([])
                    filled = 0
                batches[-1].append((name, data))
                filled += len(data)
                index += 1
        manifest["files"].append(entry)
    folders = []
    for number, batch in enumerate(batches, 1):
        folder = kit / f"batch-{number:02d}"
        folder.mkdir(parents=True)
        for name, data in batch:
            (folder / name).write_bytes(data)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
        folders.append(folder)
    return folders


def ready_commands(folders: list[Path], modes: list[str], tier_gib: int) -> list[dict]:
    """The run tool's calls, in order: {"command": ..., "carry": [...]}. Each upload
    prints how many files /tmp/gpukit/parts holds and how many it should: /tmp lasts
    only while the machine stays warm (30 s after a call), so a lower count means a
    fresh machine, and the uploads start again from the first batch."""
    calls = []
    uploaded = 1  # the manifest
    for folder in folders:
        relative = folder.relative_to(REPO).as_posix()
        uploaded += sum(1 for p in folder.iterdir() if p.name != MANIFEST)
        calls.append({"command": f"mkdir -p /tmp/gpukit/parts && cp {relative}/* "
                                 f"/tmp/gpukit/parts/ && echo $(ls /tmp/gpukit/parts | "
                                 f"wc -l) of {uploaded} expected",
                      "carry": [relative]})
    calls.append({"command": "python3 tools/gpu_kit.py reassemble /tmp/gpukit/parts "
                             "/tmp/gpukit/wheels && python3 tools/gpu_kit.py install "
                             "/tmp/gpukit/wheels /tmp/site && PYTHONPATH=/tmp/site python3 "
                             "-c 'import vllm, vllm_patches; print(vllm.__version__)'",
                  "carry": []})
    for mode in modes:
        calls.append({"command": f"PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 "
                                 f"tools/gpu_kit.py run --modes {mode} --tier-gib "
                                 f"{tier_gib} --out $OUT", "carry": []})
    return calls


# ------------------------------------------------------------------- there


def reassemble(parts: Path, out: Path) -> list[Path]:
    """Every file of ``parts``/manifest.json, rebuilt into ``out``. Every part and every
    whole file is checked against its sha256 before anything is written: on a missing
    or corrupted part nothing is written and KitError names it."""
    manifest_path = parts / MANIFEST
    if not manifest_path.is_file():
        raise KitError(f"{parts}: no {MANIFEST} (upload every batch first)")
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        whole = hashlib.sha256()
        for part in entry["parts"]:
            path = parts / part["name"]
            if not path.is_file():
                raise KitError(f"{part['name']}: missing (upload every batch first)")
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise KitError(f"{part['name']}: sha256 mismatch (corrupted part; "
                               "upload its batch again)")
            whole.update(data)
        if whole.hexdigest() != entry["sha256"]:
            raise KitError(f"{entry['name']}: sha256 of the reassembled file mismatches")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in manifest["files"]:
        target = out / entry["name"]
        with tempfile.NamedTemporaryFile(dir=out, delete=False) as tmp:
            for part in entry["parts"]:
                tmp.write((parts / part["name"]).read_bytes())
        os.replace(tmp.name, target)
        written.append(target)
    return written


def install(wheels: Path, target: Path) -> None:
    """pip install every wheel of ``wheels`` into ``target``: no index, no deps."""
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        raise KitError(f"{wheels}: no wheels to install")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                           "--target", str(target), *found],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise KitError(f"pip install into {target} failed: {tail}")


# --------------------------------------------------------------- F4's plan


# A prompt is 32 token ids, each request its own (no prefix hit between them), and
# 16 tokens out: short enough that a step stalled by a pin call shows in its latency.
PROMPT_TOKENS, MAX_TOKENS = 32, 16
# After offload started, this many more requests, for latencies without a pin.
AFTER_PIN_REQUESTS = 20
# Guards against hangs only: the most requests one mode sends.
REQUEST_LIMIT = 5000


def engine_args(tier_gib: int) -> dict[str, Any]:
    """The server's arguments beyond the e2e lane's (scenarios.ENGINE_ARGS): CUDA
    graphs on, the GPU's own dtype, the CPU tier pinned in the background."""
    return {
        "enforce_eager": False,
        "dtype": "auto",
        "gpu_memory_utilization": 0.5,
        "kv_transfer_config": {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": tier_gib * GIB,
                                          "async_register_cache": True},
        },
    }


def plan(modes: list[str], tier_gib: int) -> list[dict[str, Any]]:
    from scenarios import OPT, fixes_env, server_args

    return [{"mode": mode, "env": fixes_env(MODES[mode]) | {"HF_HUB_OFFLINE": "1"},
             "command": ["python3", "-m", "vllm.entrypoints.openai.api_server",
                         *server_args(OPT, **engine_args(tier_gib))],
             "waits_for": [GATE_OPEN.pattern, PINNED.pattern, PIN_PROGRESS],
             "after_pin_requests": AFTER_PIN_REQUESTS} for mode in modes]


def drive(server: Any, started: float, offload_at: float | None) -> dict[str, Any]:
    """Requests back to back from ready until AFTER_PIN_REQUESTS were sent after CPU
    offload started: at ``offload_at`` (stock: ready, its pin was part of startup),
    or when the gate line (or F4's failure line) appears in the server's log."""
    from scenarios import completion

    requests: list[dict[str, float]] = []
    for number in range(REQUEST_LIMIT):
        text = server.log_path.read_text(errors="replace")
        if offload_at is None and (GATE_OPEN.search(text) or PIN_FAILED in text):
            offload_at = time.monotonic() - started
        if offload_at is not None and sum(r["sent_s"] >= offload_at
                                          for r in requests) >= AFTER_PIN_REQUESTS:
            break
        prompt = [1000 + (number * PROMPT_TOKENS + i) % 40000 for i in range(PROMPT_TOKENS)]
        sent = time.monotonic()
        completion(server, prompt, max_tokens=MAX_TOKENS)
        requests.append({"sent_s": sent - started, "latency_s": time.monotonic() - sent})
    return {"requests": requests, "offload_seen_s": offload_at}


def run_mode(mode: str, tier_gib: int, out: Path, port: int = 8000) -> dict[str, Any]:
    import lanes
    from scenarios import OPT, Server, fixes_env

    os.environ.update(HF_HOME=str(lanes.offline_hf_home()), HF_HUB_OFFLINE="1")
    started = time.monotonic()
    server = Server(f"f4-{mode}", out, port, OPT, env=fixes_env(MODES[mode]),
                    **engine_args(tier_gib))
    try:
        ready_s = server.wait_ready()
        # Stock pins inside startup: offload runs from ready. Fixed: from the gate line.
        record = drive(server, started, ready_s if mode == "stock" else None)
    finally:
        server.stop()
    text = server.log_path.read_text(errors="replace")
    gate, pinned = GATE_OPEN.search(text), PINNED.search(text)
    offload_s = record["offload_seen_s"]
    during = [r["latency_s"] for r in record["requests"]
              if offload_s is None or r["sent_s"] + r["latency_s"] <= offload_s]
    after = [r["latency_s"] for r in record["requests"]
             if offload_s is not None and r["sent_s"] >= offload_s]
    return {
        "mode": mode, "tier_gib": tier_gib, "ready_s": ready_s,
        "offload_started_s": offload_s,
        "gate_line_s_after_scheduler_start": float(gate.group(1)) if gate else None,
        "pinned": ({"gb": float(pinned.group(1)), "chunks": int(pinned.group(2)),
                    "seconds": float(pinned.group(3))} if pinned else None),
        "pin_failed": PIN_FAILED in text,
        "pin_progress_lines": [ln for ln in text.splitlines() if PIN_PROGRESS in ln],
        "activation_lines": [ln for ln in text.splitlines() if "vllm-patches" in ln][:3],
        "served_during_pin": len(during), "latency_during_pin_s": percentiles(during),
        "latency_after_pin_s": percentiles(after), "requests": record["requests"],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# ------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("split", help="download and cut into batches (here)")
    p.add_argument("--release", default="v0.21.0")
    p.add_argument("--part-mib", type=int, default=PART_MIB)
    p.add_argument("--wheels", type=Path,
                   help="split these files instead of downloading (default: "
                        "build/gpukit/wheels, filled by the download)")
    p.add_argument("--kit", type=Path, default=KIT)
    p.add_argument("--tier-gib", type=int, default=32)
    p = verbs.add_parser("reassemble", help="rebuild and verify the files (there)")
    p.add_argument("parts", type=Path)
    p.add_argument("out", type=Path)
    p = verbs.add_parser("install", help="pip install --no-index --no-deps --target")
    p.add_argument("wheels", type=Path)
    p.add_argument("target", type=Path)
    p = verbs.add_parser("run", help="F4's integration plan, stock and fixed (GPU)")
    p.add_argument("--modes", default="stock,fixed")
    p.add_argument("--tier-gib", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--dry-run", action="store_true", help="print the plan; no GPU")
    args = parser.parse_args(argv)
    try:
        if args.verb == "split":
            wheels = args.wheels
            if wheels is None:
                wheels = args.kit / "wheels"
                download(args.release, wheels)
            folders = split(wheels, args.kit, args.part_mib << 20)
            calls = ready_commands(folders, list(MODES), args.tier_gib)
            lines = [f"{i}. run(command={c['command']!r}, carry={c['carry']})"
                     for i, c in enumerate(calls, 1)]
            (args.kit / "COMMANDS.md").write_text("\n".join(lines) + "\n")
            print(json.dumps(calls, indent=1))
        elif args.verb == "reassemble":
            for path in reassemble(args.parts, args.out):
                print(f"ok {path.name}")
        elif args.verb == "install":
            install(args.wheels, args.target)
            print(f"installed into {args.target}")
        else:
            modes = [m for m in args.modes.split(",") if m]
            if unknown := set(modes) - set(MODES):
                raise KitError(f"unknown mode(s) {sorted(unknown)}; choose from {list(MODES)}")
            if not 16 <= args.tier_gib <= 64:
                raise KitError(f"--tier-gib {args.tier_gib}: the plan's tier is 16-64 GiB")
            if args.dry_run:
                print(json.dumps(plan(modes, args.tier_gib), indent=1))
                return 0
            args.out.mkdir(parents=True, exist_ok=True)
            for mode in modes:
                record = run_mode(mode, args.tier_gib, args.out)
                (args.out / f"f4_{mode}.json").write_text(json.dumps(record, indent=1))
                print(json.dumps({k: v for k, v in record.items() if k != "requests"}),
                      flush=True)
    except KitError as exc:
        print(f"gpu_kit: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
