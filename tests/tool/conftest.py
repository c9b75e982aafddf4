"""Fixtures for the tool's own tests: real vLLM release checkouts, cloned per test."""

import hashlib
import subprocess
from pathlib import Path

import pytest

from vllm_patches import _releases


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def snapshot(repo: Path) -> tuple[str, str, str]:
    """HEAD, the status (untracked files included) and a hash of every local change."""
    diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD", "--binary"],
                          capture_output=True).stdout
    return (git(repo, "rev-parse", "HEAD"), git(repo, "status", "--porcelain", "-uall"),
            hashlib.sha256(diff).hexdigest())


@pytest.fixture(scope="session")
def pristine_v0_21_0() -> Path:
    return _releases.fetch(_releases.parse_release("0.21.0"))


@pytest.fixture
def checkout(tmp_path: Path, pristine_v0_21_0: Path) -> Path:
    """A user's vLLM v0.21.0 checkout with a configured identity."""
    target = tmp_path / "vllm"
    subprocess.run(["git", "clone", "--quiet", str(pristine_v0_21_0), str(target)], check=True)
    git(target, "config", "user.name", "Test User")
    git(target, "config", "user.email", "test@example.invalid")
    return target
