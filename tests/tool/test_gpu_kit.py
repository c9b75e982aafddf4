"""tools/gpu_kit.py without a GPU: split, reassemble (hashes, a corrupted or missing
part refused), install of a locally built wheel, the ready commands, and F4's plan,
dry and against a stub API server. Nothing is downloaded."""

import base64
import hashlib
import json
import socket
import sys
import zipfile

import pytest

from vllm_patches._catalog import series as _series

sys.path.insert(0, str(_series.REPO_DIR / "tools"))  # tools/ is not a package
import gpu_kit


def _files(folder, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        (folder / f"file{i}.whl").write_bytes(bytes((i + j) % 251 for j in range(size)))
    return folder


def _split(tmp_path, sizes=(2500, 700, 30, 1000), part_bytes=1000):
    wheels = _files(tmp_path / "wheels", sizes)
    folders = gpu_kit.split(wheels, tmp_path / "kit", part_bytes)
    parts = tmp_path / "parts"  # what the upload calls gather on the GPU machine
    parts.mkdir()
    for folder in folders:
        for path in folder.iterdir():
            (parts / path.name).write_bytes(path.read_bytes())
    return wheels, folders, parts


def test_split_batches_stay_within_the_part_size(tmp_path):
    _, folders, _ = _split(tmp_path)
    for folder in folders:
        data = sum(p.stat().st_size for p in folder.iterdir() if p.name != gpu_kit.MANIFEST)
        assert 0 < data <= 1000
    manifest = json.loads((folders[0] / gpu_kit.MANIFEST).read_text())
    assert [len(f["parts"]) for f in manifest["files"]] == [3, 1, 1, 1]
    assert all((f / gpu_kit.MANIFEST).read_text() == (folders[0] / gpu_kit.MANIFEST)
               .read_text() for f in folders)


def test_reassemble_rebuilds_every_file_byte_for_byte(tmp_path):
    wheels, _, parts = _split(tmp_path)
    written = gpu_kit.reassemble(parts, tmp_path / "out")
    assert sorted(p.name for p in written) == sorted(p.name for p in wheels.iterdir())
    for path in written:
        assert path.read_bytes() == (wheels / path.name).read_bytes()


def test_a_corrupted_part_is_refused_and_nothing_written(tmp_path, capsys):
    _, _, parts = _split(tmp_path)
    victim = parts / "file0.whl.part001"
    data = bytearray(victim.read_bytes())
    data[10] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert gpu_kit.main(["reassemble", str(parts), str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("gpu_kit: file0.whl.part001: sha256 mismatch (corrupted part; "
                    "upload its batch again)")]
    assert not out.exists()


def test_a_missing_part_or_manifest_is_refused(tmp_path):
    _, _, parts = _split(tmp_path)
    (parts / "file3.whl.part000").unlink()
    with pytest.raises(gpu_kit.KitError, match="file3.whl.part000: missing"):
        gpu_kit.reassemble(parts, tmp_path / "out")
    with pytest.raises(gpu_kit.KitError, match="no manifest.json"):
        gpu_kit.reassemble(tmp_path / "wheels", tmp_path / "out")


def _tiny_wheel(folder):
    """A real wheel, built here: one module and its dist-info."""
    files = {"tinykit/__init__.py": b"VALUE = 42\n",
             "tinykit-0.1.dist-info/METADATA": (b"Metadata-Version: 2.1\nName: tinykit\n"
                                                b"Version: 0.1\n"),
             "tinykit-0.1.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\n"
                                             b"Root-Is-Purelib: true\nTag: py3-none-any\n")}
    def digest(data):
        return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = [f"{name},sha256={digest(data)},{len(data)}" for name, data in files.items()]
    files["tinykit-0.1.dist-info/RECORD"] = ("\n".join(
        [*record, "tinykit-0.1.dist-info/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "tinykit-0.1-py3-none-any.whl", "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return folder


def test_install_puts_the_wheels_into_the_target(tmp_path):
    wheels = _tiny_wheel(tmp_path / "wheels")
    gpu_kit.install(wheels, tmp_path / "site")
    assert (tmp_path / "site" / "tinykit" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (tmp_path / "site" / "tinykit-0.1.dist-info" / "METADATA").is_file()
    with pytest.raises(gpu_kit.KitError, match="no wheels"):
        gpu_kit.install(tmp_path / "site", tmp_path / "other")


def test_ready_commands_fit_the_run_tool(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_kit, "REPO", tmp_path)
    _, folders, _ = _split(tmp_path)
    calls = gpu_kit.ready_commands(folders, ["fixed", "stock"], 32)
    assert len(calls) == len(folders) + 3
    assert all(len(c["command"]) <= 2000 and len(c["carry"]) <= 8 for c in calls)
    assert [c["carry"] for c in calls[: len(folders)]] == [
        [f"kit/{f.name}"] for f in folders]
    parts = sum(1 for f in folders for p in f.iterdir() if p.name != gpu_kit.MANIFEST)
    assert calls[len(folders) - 1]["command"].endswith(f"of {parts + 1} expected")
    assert "reassemble" in calls[-3]["command"] and "install" in calls[-3]["command"]
    assert "--modes fixed" in calls[-2]["command"] and "--modes stock" in calls[-1]["command"]


def test_only_releases_pinning_the_machines_torch():
    with pytest.raises(gpu_kit.KitError, match="does not pin torch 2.11"):
        gpu_kit.download("v0.25.0", _series.REPO_DIR / "build" / "never")
    names = [r.partition("==")[0] for r in gpu_kit.DEVICE_LACKS]
    assert all("==" in r for r in gpu_kit.DEVICE_LACKS) and len(set(names)) == len(names)
    assert not set(names) & set(gpu_kit.LEFT_OUT)


def test_dry_run_plan_stock_and_fixed(capsys):
    assert gpu_kit.main(["run", "--dry-run", "--tier-gib", "32"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p["mode"] for p in plans] == ["stock", "fixed"]
    assert plans[0]["env"]["VLLM_PATCHES_DISABLE"] == "1"
    assert plans[1]["env"].items() >= {"VLLM_PATCHES_DISABLE": "0",
                                      "VLLM_PATCHES_FIXES": "F4"}.items()
    for p in plans:
        command = p["command"]
        assert "--no-enforce-eager" in command and "--enforce-eager" not in command
        assert command[command.index("--load-format") + 1] == "dummy"
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        extra = config["kv_connector_extra_config"]
        assert config["kv_connector"] == "SimpleCPUOffloadConnector"
        assert extra == {"cpu_bytes_to_use": 32 << 30, "async_register_cache": True}
    assert gpu_kit.main(["run", "--dry-run", "--tier-gib", "8"]) == 1


STUB = '''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
fixed = os.environ.get("VLLM_PATCHES_DISABLE") == "0"
print("vllm-patches: stub", flush=True)
served = 0


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({})

    def do_POST(self):
        global served
        self.rfile.read(int(self.headers["Content-Length"]))
        served += 1
        if fixed and served == 3:
            print("INFO SimpleCPUOffloadWorker: pinned 16.0 of 34.4 GB of the CPU KV "
                  "cache (4.00 GB/s, about 5 s left)")
            print("INFO SimpleCPUOffloadWorker (rank 0): CPU KV cache (34.4 GB) pinned "
                  "in 16 chunks in 8.2 s; CPU offload starts once all workers are ready.")
            print("INFO SimpleCPUOffloadScheduler: all 1 workers registered their CPU KV "
                  "cache; CPU offload is enabled, 12.5 s after the scheduler started.",
                  flush=True)
        self._send({"usage": {"completion_tokens": 16}})


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.mark.parametrize("mode", ["stock", "fixed"])
def test_plan_runs_against_a_stub_server(tmp_path, monkeypatch, mode):
    package = tmp_path / "stub" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(STUB)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stub"))
    monkeypatch.setenv("HF_HOME", "unset")  # run_mode sets both; monkeypatch restores
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    record = gpu_kit.run_mode(mode, 32, tmp_path, port=port)
    assert record["activation_lines"] == ["vllm-patches: stub"]
    assert record["latency_after_pin_s"]["n"] == gpu_kit.AFTER_PIN_REQUESTS
    if mode == "stock":
        assert record["served_during_pin"] == 0 and record["pinned"] is None
        assert record["offload_started_s"] == record["ready_s"]
    else:
        assert record["served_during_pin"] == 3
        assert record["pinned"] == {"gb": 34.4, "chunks": 16, "seconds": 8.2}
        assert record["gate_line_s_after_scheduler_start"] == 12.5
        assert len(record["pin_progress_lines"]) == 1
        assert len(record["requests"]) == 3 + gpu_kit.AFTER_PIN_REQUESTS
