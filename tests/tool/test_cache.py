"""`vllm-patches cache` shows and reclaims the cache, and slow verbs show progress on a
terminal only (issue 11, item 9)."""

import io
import sys

import pytest

from vllm_patches import _releases, _series
from vllm_patches._cli import EXIT_OK, main

RELEASE = _series.Version("0.21.0")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def cache(tmp_path, monkeypatch, checkout):
    """A cache of its own: v0.21.0 (from a local checkout), an archive, a leftover."""
    monkeypatch.setenv("VLLM_PATCHES_CACHE", str(tmp_path / "cache"))
    _releases.fetch_from_checkout(RELEASE, checkout)
    old = _releases.checkouts_dir() / "v0.17.0"  # a release the series does not cover
    old.mkdir()
    (old / "README.md").write_text("an old release\n")
    sdist = _releases.sdists_dir()
    sdist.mkdir(parents=True)
    (sdist / "vllm-0.21.0.tar.gz").write_bytes(b"x" * 100_000)
    (_releases.checkouts_dir() / ".fetch-abc123").mkdir()
    return tmp_path / "cache"


def test_cache_shows_sizes_and_what_prune_frees(cache, capsys):
    assert main(["cache"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith(f"cache: {cache} ($VLLM_PATCHES_CACHE)")
    assert "v0.21.0    checkout" in out and "v0.21.0    archive" in out
    assert "v0.17.0    checkout" in out and "(not covered by the series)" in out
    assert "interrupted fetch" in out
    assert "`vllm-patches cache --prune` frees" in out


def test_prune_keeps_the_covered_checkouts(cache, capsys):
    assert main(["cache", "--prune"]) == EXIT_OK
    assert "removed " in capsys.readouterr().out
    assert _releases.cached_releases() == [RELEASE]
    assert not any(_releases.sdists_dir().iterdir())
    assert not (_releases.checkouts_dir() / ".fetch-abc123").exists()
    assert main(["cache", "--remove", "v0.21.0"]) == EXIT_OK
    assert _releases.cached_releases() == []
    (cache / "unrelated.txt").write_text("not the tool's")
    assert main(["cache", "--clear"]) == EXIT_OK
    assert (cache / "unrelated.txt").exists()


def test_progress_only_on_a_terminal(cache, monkeypatch, capsys):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["regen", "--check", "--release", "v0.21.0"]) == EXIT_OK
    shown = terminal.getvalue()
    assert "regen v0.21.0 (1/1)" in shown and shown.endswith("\r\033[K")
    assert "up to date" in capsys.readouterr().out
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    assert main(["regen", "--check", "--release", "v0.21.0"]) == EXIT_OK
    assert piped.getvalue() == ""
