"""`vllm-patches cache` shows and reclaims the cache, and slow verbs show progress on a
terminal only."""

import io
import sys

import pytest

from vllm_patches._catalog import releases as _releases
from vllm_patches._catalog import series as _series
from vllm_patches._cli import main
from vllm_patches._errors import EXIT_OK

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
    assert "(1 item) from" in capsys.readouterr().out  # the checkout; prune took the archive
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


def test_piped_a_logged_step_is_one_line_with_its_context(monkeypatch):
    """A release being downloaded is minutes of silence in a CI log otherwise;
    the other steps stay off piped stderr."""
    from vllm_patches import _progress

    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    with _progress.step("matrix v0.19.0 (3/23)"):
        with _progress.step("fetching vLLM v0.19.0", logged=True):
            _progress.update("downloading vllm-0.19.0.tar.gz: 12/45 MB")
        with _progress.step("unlogged"):
            pass
    assert piped.getvalue() == "matrix v0.19.0 (3/23) · fetching vLLM v0.19.0\n"


@pytest.mark.parametrize(("number", "shown"), [(0, "0 items"), (1, "1 item"), (2, "2 items")])
def test_a_count_names_its_noun_in_the_right_number(number, shown):
    from vllm_patches._plural import count, word

    assert count(number, "item") == shown
    assert count(number, "patch", "patches") == shown.replace("item", "patch").replace(
        "patchs", "patches")
    assert word(number, "fix", "fixes") == ("fix" if number == 1 else "fixes")


def test_removing_a_release_that_is_not_cached_says_so(cache, capsys):
    """It said "removed 0 B (0 items)"; nothing to do is exit 0."""
    assert main(["cache", "--remove", "v9.9.9"]) == EXIT_OK
    assert capsys.readouterr().out == f"v9.9.9: nothing of this release is cached in {cache}\n"
    assert main(["cache", "--remove", "v9.9.9", "v0.21.0"]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"v9.9.9: nothing of this release is cached in {cache}"
    assert out[1].startswith("removed ") and out[1].endswith(f"(2 items) from {cache}")
    assert _releases.cached_releases() == []
