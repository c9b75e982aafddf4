"""tools/venvs.py: uv told where packages come from exactly as pip is configured.

uv reads no pip configuration: every lane, engine and pre-commit venv is built by
``venvs.uv_pip_install`` (through ``lanes.cached_venv``) with the indexes, find-links, certificate and timeout that
``pip config list`` reports (config files and ``PIP_*`` variables), resolved as pip
resolves: the best version across all indexes.
"""

import sys
from importlib import metadata
from pathlib import Path

from vllm_patches._catalog import series as _series

sys.path.insert(0, str(_series.REPO_DIR / "tools"))  # tools/ is not a package
import lanes
import venvs

# `pip config list` on the machine these tools were written on (files, then PIP_* env).
LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
global.cert='/etc/pip-global.crt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/other-wheels'
"""


def test_environment_beats_install_section_beats_global():
    listing = LISTING + "install.find-links='/opt/install-wheels'\ninstall.no-index='false'\n"
    settings = venvs.pip_settings(listing)
    assert settings["find-links"] == "/opt/wheels"
    assert settings["cert"] == "/etc/ssl/certs/ca-certificates.crt"
    assert settings["extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"
    assert settings["no-index"] == "false"
    assert venvs.pip_settings("") == {}


def test_uv_gets_every_index_and_merges_them_as_pip_does():
    args, env = venvs.uv_settings(venvs.pip_settings(LISTING))
    assert args == ["--index-strategy", "unsafe-best-match",
                    "--find-links", "/opt/wheels",
                    "--extra-index-url", "file:///opt/pypi/simple",
                    "--extra-index-url", "file:///opt/pypi-more/simple"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
                   "UV_HTTP_TIMEOUT": "180"}


def test_index_url_flags_and_proxy():
    pip = {"index-url": "https://mirror.invalid/simple", "no-index": "yes", "pre": "0",
           "trusted-host": "mirror.invalid other.invalid", "proxy": "http://proxy.invalid:3128"}
    args, env = venvs.uv_settings(pip)
    assert args == ["--index-strategy", "unsafe-best-match",
                    "--index-url", "https://mirror.invalid/simple", "--no-index",
                    "--allow-insecure-host", "mirror.invalid",
                    "--allow-insecure-host", "other.invalid"]
    assert env == {"HTTP_PROXY": "http://proxy.invalid:3128",
                   "HTTPS_PROXY": "http://proxy.invalid:3128"}


def test_an_option_uv_is_not_told_is_said(capsys):
    args, env = venvs.uv_settings({"only-binary": ":all:", "cache-dir": "/tmp/pip"})
    assert (args, env) == (["--index-strategy", "unsafe-best-match"], {})
    out = capsys.readouterr().out
    assert "pip option only-binary=':all:' has no uv equivalent" in out
    assert "cache-dir" not in out


def test_cached_venv_builds_with_uv_once_per_stamp(tmp_path: Path):
    """A real venv from this machine's indexes (a small wheel uv's cache holds after the
    first run); the same stamp reuses it, a failed install says which."""
    venv = tmp_path / "venv"
    python = lanes.cached_venv(venv, "iniconfig", [["iniconfig"]], "test")
    assert (venv / ".requirements-sha256").is_file()
    assert (venv / "bin" / "pip").exists()  # seeded, as `python -m venv` made it
    marker = venv / "kept"
    marker.touch()
    assert lanes.cached_venv(venv, "iniconfig", [["iniconfig"]], "test") == python
    assert marker.exists()
    assert venvs.uv_pip_install(python, ["--no-deps", "iniconfig"]) is None
    problem = venvs.uv_pip_install(python, ["--no-index", "no-such-package-here"])
    assert problem.startswith("uv pip install --no-index no-such-package-here failed: ")


def test_test_sh_bootstraps_the_dev_extras_uv():
    """tools/test.sh's ``.venv`` gets the uv the ``dev`` extra pins (and so runs it)."""
    assert venvs.uv_pin() == f"uv=={metadata.version('uv')}"
