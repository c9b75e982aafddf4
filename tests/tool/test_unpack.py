"""Unpacking a release archive, with and without tarfile's extraction filters.

README's first command, followed on Debian 12 (whose python3 is 3.11.2,
from before Python 3.11.4's tarfile filters), crashed in `fetch` with
``TypeError: TarFile.extractall() got an unexpected keyword argument 'filter'``.
"""

import io
import os
import tarfile

import pytest

from vllm_patches._catalog import releases as _releases
from vllm_patches._errors import UserError


def archive(path, members):
    """A .tar.gz at ``path`` holding ``members``: (name, TarInfo type, link target)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link
            data = b"" if kind != tarfile.REGTYPE else b"content\n"
            info.size = len(data)
            info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o4666  # set-id, all write
            info.uid = info.gid = 4242  # the packager's, not ours
            tar.addfile(info, io.BytesIO(data) if data else None)
    return path


@pytest.fixture(params=["filters", "no filters"])
def tar_filters(request, monkeypatch):
    if request.param == "no filters":  # Python before 3.11.4
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    return request.param


def test_a_release_archive_unpacks(tmp_path, tar_filters):
    sdist = archive(tmp_path / "vllm-0.21.0.tar.gz", [
        ("vllm-0.21.0", tarfile.DIRTYPE, ""), ("vllm-0.21.0/setup.py", tarfile.REGTYPE, "")])
    (tmp_path / "out").mkdir()
    _releases.unpack_sdist(sdist, tmp_path / "out")
    unpacked = tmp_path / "out/vllm-0.21.0/setup.py"
    assert unpacked.read_text() == "content\n"
    assert unpacked.stat().st_uid == os.getuid() and unpacked.stat().st_mode & 0o7777 == 0o644


@pytest.mark.parametrize("member", [("../evil", tarfile.REGTYPE, ""),
                                    ("vllm-0.21.0/link", tarfile.SYMTYPE, "/etc/passwd")])
def test_a_member_outside_the_archive_is_refused_before_anything_is_unpacked(
        tmp_path, tar_filters, member):
    sdist = archive(tmp_path / "vllm-0.21.0.tar.gz", [
        ("vllm-0.21.0/setup.py", tarfile.REGTYPE, ""), member])
    (tmp_path / "out").mkdir()
    with pytest.raises((UserError, tarfile.FilterError)):
        _releases.unpack_sdist(sdist, tmp_path / "out")
    if tar_filters == "no filters":
        assert not any((tmp_path / "out").iterdir())
    assert not (tmp_path / "evil").exists()
