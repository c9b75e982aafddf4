"""Install packages into a venv with uv, from the package indexes pip is configured with.

The one installer of every venv the tests build: the lanes', the real-engine lane's and
the pre-commit runner's (``lanes.cached_venv``), and ``tools/test.sh``'s ``.venv``. uv
reads no pip configuration: ``uv_index`` hands it pip's (``pip config list``: config files
and ``PIP_*`` variables). Standard library only, so that it runs before the ``.venv`` holds
anything.

Usage (tools/test.sh): VENV/bin/python tools/venvs.py UV-PIP-INSTALL-ARGUMENTS...
installs into VENV, after installing uv itself there (``pip install``, at the ``dev``
extra's pin) when it is missing or another version. Exit 0 installed, 1 not (uv's output
shows why).
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

# pip options (``pip config list`` keys) that say where packages come from, and how uv
# is told the same: a uv option per value (lists split on whitespace, as pip does), or an
# environment variable of uv's. uv reads no pip configuration of its own.
UV_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
              "find-links": "--find-links", "trusted-host": "--allow-insecure-host"}
UV_FLAGS = {"no-index": "--no-index", "pre": "--prerelease=allow"}
UV_ENV = {"cert": ("SSL_CERT_FILE",), "client-cert": ("SSL_CLIENT_CERT",),
          "timeout": ("UV_HTTP_TIMEOUT",), "default-timeout": ("UV_HTTP_TIMEOUT",),
          "proxy": ("HTTP_PROXY", "HTTPS_PROXY")}
# pip options that do not change which packages an install gets.
PIP_ONLY = {"disable-pip-version-check", "no-input", "progress-bar", "quiet", "verbose",
            "no-color", "cache-dir", "no-cache-dir", "root-user-action", "require-virtualenv",
            "break-system-packages", "no-warn-script-location", "retries", "user"}
# pip's precedence for one option: the environment, then the command's section, then global.
PIP_SECTIONS = {"global": 0, "install": 1, ":env:": 2}
# How uv installs, beyond where from. --compile-bytecode: pip writes every module's .pyc
# at install, uv does not; where PYTHONDONTWRITEBYTECODE is set (this machine) nothing
# writes them later either, and every engine process (API server, engine core, worker)
# then compiles torch, transformers and vLLM from source at each start: the clean-clone
# CI run of 2026-11-24 took 17.7 minutes for the v0.21.0 engine tests that took 11.2
# with pip-built venvs (F1's engines 84-132 s against 35-50 s).
UV_INSTALL_FLAGS = ["--compile-bytecode"]


def pip_settings(listing: str) -> dict[str, str]:
    """pip's effective value of each option that ``pip install`` reads, from the output of
    ``pip config list`` (config files and ``PIP_*`` variables)."""
    ranked: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        rank = PIP_SECTIONS.get(section)
        if rank is not None and rank >= ranked.get(name, (-1, ""))[0]:
            ranked[name] = (rank, ast.literal_eval(value))
    return {name: value for name, (_, value) in ranked.items()}


def uv_settings(pip: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's arguments and environment that resolve as pip with settings ``pip`` does: the
    same indexes and find-links, each package's best version across all of them (pip
    merges every index: uv's ``unsafe-best-match``; uv's default takes the first index
    that has the package at all)."""
    args, env = ["--index-strategy", "unsafe-best-match"], {}
    for name, value in pip.items():
        if name in UV_OPTIONS:
            args += [arg for item in value.split() for arg in (UV_OPTIONS[name], item)]
        elif name in UV_FLAGS:
            args += [UV_FLAGS[name]] if value.lower() in ("1", "yes", "true", "on") else []
        elif name in UV_ENV:
            env.update(dict.fromkeys(UV_ENV[name], value))
        elif name not in PIP_ONLY:
            print(f"venvs: warning: pip option {name}={value!r} has no uv equivalent in "
                  "tools/venvs.py (UV_OPTIONS); venvs are built without it", flush=True)
    return args, env


@functools.cache
def uv_index() -> tuple[list[str], dict[str, str]]:
    """uv's index arguments and environment, from this machine's pip configuration."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=True).stdout
    return uv_settings(pip_settings(listing))


def uv_pip_install(python: Path, args: list[str]) -> str | None:
    """``uv pip install ARGS`` into the venv of ``python``, from pip's indexes. None, or
    why not (with the end of uv's output). uv installs every wheel from its cache
    (``UV_CACHE_DIR``, default ``~/.cache/uv``), by hard links where the venv is on the
    cache's file system (copies elsewhere), so a second venv with the same torch costs
    seconds. A venv is still only as relocatable as ``python -m venv`` made it (scripts'
    shebangs name its path; the tools run ``python -m``), and a copy by ``cp -al`` shares
    its files as before, now with uv's cache too: files in a venv are replaced, never
    edited in place (as pip and uv do), or the cache would change with them."""
    index_args, index_env = uv_index()
    proc = subprocess.run(
        [sys.executable, "-m", "uv", "pip", "install", "--quiet", "--python", str(python),
         *UV_INSTALL_FLAGS, *index_args, *args],
        check=False, capture_output=True, text=True, env={**os.environ, **index_env})
    if proc.returncode != 0:
        return (f"uv pip install {' '.join(args)} failed: "
                f"{(proc.stderr or proc.stdout)[-4000:]}")
    return None


def uv_pin() -> str:
    """The ``dev`` extra's ``uv==X`` (pyproject.toml): the uv tools/test.sh bootstraps."""
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                              .read_text())
    dev = pyproject["project"]["optional-dependencies"]["dev"]
    return next(pin for pin in dev if pin.startswith("uv=="))


def main() -> int:
    pin = uv_pin()
    try:
        installed = f"uv=={metadata.version('uv')}"
    except metadata.PackageNotFoundError:
        installed = None
    if installed != pin:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                        "--disable-pip-version-check", pin], check=True)
    problem = uv_pip_install(Path(sys.executable), sys.argv[1:])
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
