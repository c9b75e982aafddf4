"""vLLM releases: fetch a release's source archive into a git checkout, and tell
which release a checkout is.

A fetched release is the index's sdist, checked against its sha256 and committed as one
commit tagged ``vX.Y.Z``, in the tool's own cache; a cached checkout that changed is
refused. Network and archive modules are imported where used (start-up time).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_patches import _git, _progress
from vllm_patches._errors import Refused, UserError

INDEX_URL = "https://pypi.org/simple/vllm/"
# PEP 691: the JSON form of the simple API lists every file with its sha256.
INDEX_ACCEPT = "application/vnd.pypi.simple.v1+json"
# Author and date of the synthetic release commit: fixed, so that every fetch of a
# release yields the same commit id and generated patches carry the same base.
RELEASE_ARCHIVE_AUTHOR = _git.Identity("vLLM release archive", "release@vllm.invalid",
                                       "2000-01-01T00:00:00Z")
# Build metadata that the sdist carries but an upstream checkout does not.
SDIST_BUILD_METADATA = ("PKG-INFO", "vllm.egg-info")


def cache_root() -> Path:
    """Where fetched archives and checkouts live (never inside the repo's tracked files)."""
    env = os.environ.get("VLLM_PATCHES_CACHE")
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(xdg) / "vllm-patches"


def parse_release(text: str) -> Version:
    """``v0.21.0`` or ``0.21.0`` -> Version; a clear error otherwise. A release has three
    numbers: ``0.21`` would equal ``0.21.0`` as a PEP 440 version, but no tag, archive
    or ``patches/`` directory is named so."""
    try:
        version = Version(text.strip().removeprefix("v"))
    except InvalidVersion:
        version = None
    if version is None or len(version.release) != 3:
        raise UserError(f"not a vLLM release: {text!r} (a release is vX.Y.Z, e.g. v0.21.0)")
    return version


def release_tag(version: Version) -> str:
    return f"v{version}"


def checkouts_dir() -> Path:
    return cache_root() / "src"


def sdists_dir() -> Path:
    return cache_root() / "sdist"


def checkout_path(version: Version) -> Path:
    return checkouts_dir() / release_tag(version)


def _index_files() -> list[dict]:
    """Every file of vLLM on the package index (name, url, hashes, ...)."""
    import json
    import urllib.request

    request = urllib.request.Request(INDEX_URL, headers={"Accept": INDEX_ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)["files"]
    except OSError as exc:
        raise UserError(f"cannot read the package index at {INDEX_URL}: {exc}") from None


def _sdist_filename(version: Version) -> str:
    return f"vllm-{version}.tar.gz"


def _index_entry(version: Version) -> dict:
    filename = _sdist_filename(version)
    for entry in _index_files():
        if entry["filename"] == filename:
            return entry
    raise UserError(f"vLLM {release_tag(version)} has no source archive on the index ({filename})")


def sdist_releases() -> list[Version]:
    """The final releases that have a source archive on the index, oldest first."""
    releases = set()
    for entry in _index_files():
        name = entry["filename"]
        if name.startswith("vllm-") and name.endswith(".tar.gz") and not entry.get("yanked"):
            try:
                version = Version(name.removeprefix("vllm-").removesuffix(".tar.gz"))
            except InvalidVersion:
                continue
            if name == _sdist_filename(version) and not (version.is_prerelease
                                                         or version.is_devrelease):
                releases.add(version)
    return sorted(releases)


def download_size(versions: list[Version]) -> int:
    """Bytes ``fetch`` downloads to make ``versions`` (releases not checked out in the
    cache): the index's size (PEP 700) of each source archive not downloaded yet."""
    missing = {_sdist_filename(v) for v in versions
               if not (sdists_dir() / _sdist_filename(v)).is_file()}
    return sum(entry.get("size", 0) for entry in _index_files() if entry["filename"] in missing)


def cached_releases() -> list[Version]:
    """The releases that ``fetch`` has already made into cached checkouts, oldest first."""
    root = cache_root() / "src"
    found = []
    for path in root.glob("v*") if root.is_dir() else ():
        try:
            version = parse_release(path.name)
        except UserError:
            continue
        if release_tag(version) == path.name and (path / ".git").is_dir() \
                and _git.has_ref(path, f"refs/tags/{path.name}"):
            found.append(version)
    return sorted(found)


def _download_sdist(version: Version) -> Path:
    """Download (or reuse) the verified sdist of ``version``; returns its path."""
    import urllib.request

    entry = _index_entry(version)
    expected = entry["hashes"]["sha256"]
    target = sdists_dir() / entry["filename"]
    if target.exists() and _sha256(target) == expected:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    with urllib.request.urlopen(entry["url"], timeout=600) as response, open(partial, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0)
        done = 0
        while chunk := response.read(1 << 20):
            out.write(chunk)
            done += len(chunk)
            _progress.update(f"downloading {entry['filename']}: {done >> 20}"
                             + (f"/{total >> 20} MB" if total else " MB"))
    actual = _sha256(partial)
    if actual != expected:
        partial.unlink()
        raise UserError(
            f"{entry['filename']}: sha256 {actual} does not match the index's {expected}"
        )
    partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_from_checkout(version: Version, repo: Path) -> Path:
    """Cache release ``version`` from an existing vLLM git checkout that has its tag.

    For machines that have a clone of upstream vLLM but cannot reach the index.
    Replaces a cached checkout of that release, however it was made.
    """
    import shutil

    tag = release_tag(version)
    if not _git.is_repo(repo):
        raise UserError(f"{repo}: not a git repository")
    if not _git.has_ref(repo, f"refs/tags/{tag}"):
        raise UserError(f"{repo}: has no tag {tag}")
    dest = checkout_path(version)
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _git.run(repo, "clone", "--quiet", "--no-checkout", str(repo.resolve()), str(dest))
    _git.run(dest, "checkout", "--quiet", "-B", "main", f"refs/tags/{tag}")
    if not (dest / "vllm" / "v1").is_dir():
        shutil.rmtree(dest)
        raise UserError(f"{repo}: {tag} is not a vLLM source tree")
    return dest


def fetch(version: Version) -> Path:
    """Return a git checkout of release ``version``, creating it from the sdist if needed.

    The checkout has exactly one commit, tagged ``v<version>``, holding every file of
    the sdist except its build metadata. Files that vLLM's own ``.gitignore`` matches
    (e.g. ``*_hip*`` modules the release ships) are committed too. A cached checkout
    that is no longer the release (someone committed or edited in it) is refused.
    """
    dest = checkout_path(version)
    tag = release_tag(version)
    if (dest / ".git").is_dir() and _git.has_ref(dest, f"refs/tags/{tag}"):
        _require_pristine(dest, tag)
        return dest
    import shutil
    import tempfile

    with _progress.step(f"fetching vLLM {tag}", logged=True):
        sdist = _download_sdist(version)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as scratch:
            _progress.update(f"unpacking {sdist.name}")
            unpack_sdist(sdist, Path(scratch))
            (top,) = Path(scratch).iterdir()
            for name in SDIST_BUILD_METADATA:
                path = top / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            _progress.update(f"committing vLLM {tag} into a git checkout")
            _git.init_release_repo(top, tag, RELEASE_ARCHIVE_AUTHOR)
            if dest.exists():
                shutil.rmtree(dest)
            top.rename(dest)
    return dest


def unpack_sdist(sdist: Path, target: Path) -> None:
    """Unpack a release archive into ``target``: regular files and folders, inside it. Before Python
    3.11.4 (no tarfile filters) every member is checked first, and an archive with anything else is
    refused, unpacked not at all."""
    import tarfile

    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(target, filter="data")
            return
        members = archive.getmembers()
        for member in members:
            parts = Path(member.name).parts
            if not (member.isfile() or member.isdir()) or member.name.startswith("/") \
                    or ".." in parts:
                raise UserError(f"{sdist.name}: refusing to unpack {member.name!r} (not a "
                                "plain file or folder inside the archive)")
            # As the data filter does: the files are ours (as root, tarfile would give
            # them the archive's owner, and git then refuses the "dubious ownership"),
            # with no set-id or group/other write bits.
            member.uid, member.gid = os.getuid(), os.getgid()
            member.mode &= 0o755
        archive.extractall(target, members, numeric_owner=True)


def _require_pristine(dest: Path, tag: str) -> None:
    """The cached checkout must still be the release: HEAD at its tag, no local change."""
    head = _git.run(dest, "rev-parse", "HEAD", f"refs/tags/{tag}^{{commit}}").stdout.split()
    changes = _git.run(dest, "status", "--porcelain", "--untracked-files=no",
                       env=_git.READ_ONLY_ENV).stdout
    if head[0] != head[1] or changes:
        what = "HEAD is not the release's commit" if head[0] != head[1] else \
            "files differ from the release"
        raise Refused(f"the cached vLLM {tag} at {dest} was changed ({what}); the tool never "
                      f"changes it after `fetch`: remove it (`vllm-patches cache --remove "
                      f"{tag}`) and fetch it again")


def _version_file_value(checkout: Path, name: str) -> str | None:
    """The string assigned to ``name`` in the checkout's generated ``vllm/_version.py``."""
    version_file = checkout / "vllm" / "_version.py"
    if not version_file.is_file():
        return None
    for node in ast.parse(version_file.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if name in names and isinstance(node.value, ast.Constant):
                return str(node.value.value)
    return None


def upstream_commit(checkout: Path) -> str | None:
    """The upstream commit a release was built from (``g9da56fd18`` -> ``9da56fd18``)."""
    commit = _version_file_value(checkout, "__commit_id__")
    return commit.removeprefix("g") if commit else None


def is_archive_import(checkout: Path) -> bool:
    """Whether HEAD is (or is built on) a release's source archive committed as it is,
    as ``fetch`` makes it: such a commit tracks the build-generated ``vllm/_version.py``,
    which upstream's history never does (its .gitignore lists it), so upstream does not
    know the commit; ``upstream_commit`` names the one the release was built from."""
    return _git.run(checkout, "cat-file", "-e", "HEAD:vllm/_version.py",
                    check=False).returncode == 0


@dataclass(frozen=True)
class Identified:
    """What a checkout says about its release."""

    release: Version | None  # the release it is, when it says so
    hint: Version | None  # else the version it is nearest to (a development build's, the
    #                       last release tag before HEAD), when it names one
    why: str  # why the release cannot be told ("" when it can)
    source: str = ""  # what says the release ("vllm/_version.py", "its tag v0.21.0")


def declared_version(checkout: Path) -> Version | None:
    """The version the build-generated ``vllm/_version.py`` declares, if there is one."""
    declared = _version_file_value(checkout, "__version__")
    if not declared:
        return None
    try:
        return Version(declared)
    except InvalidVersion:
        raise UserError(f"{checkout}: vllm/_version.py declares {declared!r}") from None


def identify(checkout: Path) -> Identified:
    """The release ``vllm/_version.py`` declares (a local label such as ``+cu128`` is
    ignored), else the release tag at HEAD; a development build and a checkout with
    neither give the reason and the nearest version they name."""
    declared = declared_version(checkout)
    if declared is not None:
        if declared.is_devrelease or declared.is_prerelease:
            return Identified(None, declared, f"vLLM {declared} is a development build, "
                                            "not a release")
        return Identified(Version(declared.base_version), None, "", "vllm/_version.py")
    for tag in _git.tags_at_head(checkout):
        try:
            return Identified(parse_release(tag), None, "", f"its tag {tag}")
        except UserError:
            continue
    described = _git.run(checkout, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*",
                         check=False).stdout.strip()
    try:
        hint = parse_release(described) if described else None
    except UserError:
        hint = None
    last = f"; the last release tag before it is {described}" if hint else ""
    return Identified(None, hint, "cannot tell which vLLM release this is (no vllm/_version.py "
                                f"and no release tag at HEAD{last})")


def detect_release(checkout: Path) -> Version:
    """The release a checkout is; a one-line error when it cannot be told."""
    identified = identify(checkout)
    if identified.release is None:
        raise UserError(f"{checkout}: {identified.why}; pass --release")
    return identified.release
