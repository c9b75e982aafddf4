"""``vllm-patches doctor``: what this Python runs, which fixes are active in it, and the
known-bad combinations it is in.

Versions come from the installed distributions' metadata (``importlib.metadata``), so
the report describes the environment vLLM would start in, not a checkout. Where vLLM is
importable, doctor loads vLLM's general plugins the way vLLM's processes do, so the
fixes it lists as active went through the real entry point. An environment that leaves
the fixes out whatever vLLM runs (``VLLM_PLUGINS`` without this plugin, an unknown id in
``VLLM_PATCHES_FIXES``) is BAD, exit 1, with or without vLLM here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from vllm_patches._catalog import series as _series
from vllm_patches._engine import runtime as _runtime
from vllm_patches._errors import EXIT_OK, EXIT_REFUSED, UserError

OK, WARN, BAD = "ok", "warning", "BAD"
# Without vLLM in this Python there is nothing the fixes could break or mend: a warning
# (exit 0), as when the plugin does not run; the words say that no fix is active here.
NO_VLLM = "vLLM is not installed in this Python; run doctor with the Python that runs vLLM"


@dataclass(frozen=True)
class KnownBad:
    """A package release range that breaks vLLM under some condition."""

    package: str
    fixed_in: Version  # first good release
    min_tensor_parallel: int  # the breakage needs tensor parallelism >= this
    what: str
    reference: str


KNOWN_BAD = (
    KnownBad(
        package="kvcached",
        fixed_in=Version("0.1.6"),
        min_tensor_parallel=2,
        what="vLLM never becomes ready at startup (the API server never listens): the "
             "coordinator sets kvcached up with world_size=1, and the background prealloc "
             "thread races the first null-block allocation",
        reference="ovg-project/kvcached#339, PRs #340 and #341",
    ),
)


@dataclass(frozen=True)
class Finding:
    level: str  # OK, WARN or BAD
    text: str

    def line(self) -> str:
        return f"  {self.level}: {self.text}"


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def plugin_registered() -> bool:
    return any(entry.name == _runtime.ENTRY_POINT_NAME and
               entry.value == "vllm_patches._engine.runtime:register"
               for entry in importlib.metadata.entry_points(group=_runtime.ENTRY_POINT_GROUP))


def known_bad(tensor_parallel_size: int | None) -> list[Finding]:
    findings = []
    for bad in KNOWN_BAD:
        text = installed_version(bad.package)
        if text is None:
            continue
        try:
            version = Version(text)
        except InvalidVersion:
            findings.append(Finding(WARN, f"{bad.package} {text}: cannot read its version"))
            continue
        if version >= bad.fixed_in:
            findings.append(Finding(OK, f"{bad.package} {text} (>= {bad.fixed_in})"))
            continue
        advice = (f"fixed in {bad.package} {bad.fixed_in}: pip install "
                  f"'{bad.package}>={bad.fixed_in}' ({bad.reference})")
        if tensor_parallel_size is None:
            findings.append(Finding(WARN, f"{bad.package} {text} with tensor parallelism >= "
                                          f"{bad.min_tensor_parallel}: {bad.what}; {advice}. "
                                          "Pass --tensor-parallel-size to check your setup"))
        elif tensor_parallel_size >= bad.min_tensor_parallel:
            findings.append(Finding(BAD, f"{bad.package} {text} with tensor parallelism "
                                         f"{tensor_parallel_size}: {bad.what}; {advice}"))
        else:
            findings.append(Finding(OK, f"{bad.package} {text} at tensor parallelism "
                                        f"{tensor_parallel_size}; tensor parallelism >= "
                                        f"{bad.min_tensor_parallel} would hang ({advice})"))
    return findings


def _activation(environ: Mapping[str, str], load: bool, registered: bool,
                version: str) -> tuple[_runtime.Activation | None, list[Finding], str]:
    """(the activation, findings, how it was obtained) for this Python."""
    activation = _runtime.current()
    if activation is not None:
        return activation, policy(activation, registered), "active in this Python"
    if load and importlib.util.find_spec("vllm") is not None:
        try:
            from vllm.plugins import load_general_plugins

            load_general_plugins()
        except UserError as exc:
            return None, [Finding(BAD, f"vLLM would not start ({_runtime.ENV_STRICT}=1 or a "
                                       f"half-installed fix): {exc}")], ""
        except Exception as exc:  # noqa: BLE001 - another plugin, or vLLM itself
            return None, [Finding(BAD, f"loading vLLM's general plugins failed: {exc!r}")], ""
        activation = _runtime.current()
        if activation is not None:
            return activation, policy(activation, registered), \
                "active in this Python, through vLLM's plugin loader"
        why = ("its entry point is not installed" if not registered
               else "its module failed to import (see the log above)")
        findings = [Finding(WARN, f"the vllm_patches plugin did not run: {why}; no fix is "
                                  "active in vLLM processes")]
    else:
        findings = [] if not load else [Finding(WARN, "vLLM is installed but not importable "
                                                      "in this Python; showing the plan")]
    series = _series.load()
    ids, strict = series.ids, None
    try:
        strict = _runtime.env_flag(environ, _runtime.ENV_STRICT)
        if _runtime.env_flag(environ, _runtime.ENV_DISABLE):
            return _runtime.Activation(None, [], disabled=True), findings, "plan"
        ids = _runtime.selected_ids(series, environ)
        basis = _runtime.release_basis(
            version, series, ids, _runtime.env_flag(environ, _runtime.ENV_ALLOW_UNSUPPORTED))
        _runtime.require_requirements(series, basis.release, ids, environ)
    except UserError as exc:
        reason = str(exc).removeprefix("vllm-patches: ")
        if strict is not False:  # set, or unreadable: the plugin raises
            return None, [*findings, Finding(BAD if registered else WARN, (
                f"vLLM would not start ({_runtime.ENV_STRICT}): {reason}"))], ""
        refused = _runtime.Activation(
            None, [], failure=reason, installed=version,
            not_active=_runtime.needed_fixes(series, ids, _runtime.base_release(version)))
        return None, [*findings, *policy(refused, registered)], ""
    activation = _runtime.Activation(basis.release, _runtime.fix_states(series, basis.release, ids),
                                     basis=basis)
    return activation, [*findings, *policy(activation, registered)], \
        "would be activated by the plugin (not loaded here)"


def plugin_left_out(environ: Mapping[str, str]) -> Finding | None:
    """BAD where ``VLLM_PLUGINS`` (vLLM loads only the general plugins it names, when set)
    leaves this package's plugin out: no vLLM process activates a fix, whatever else is
    set. Not where ``VLLM_PATCHES_DISABLE`` says the operator wants none."""
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is None or _runtime.ENTRY_POINT_NAME in allowed.split(","):
        return None
    return Finding(BAD, f"VLLM_PLUGINS={allowed!r} leaves out {_runtime.ENTRY_POINT_NAME}: vLLM "
                        "does not load the plugin, so no fix is active in vLLM processes (add "
                        f"{_runtime.ENTRY_POINT_NAME} to it, or unset it)")


def unknown_fixes(environ: Mapping[str, str], series: _series.Series) -> Finding | None:
    """BAD where ``VLLM_PATCHES_FIXES`` names a fix the series lacks (the plugin would
    activate none): said even without vLLM here, where no activation is computed (nor
    what a fix requires, which depends on the release)."""
    try:
        _runtime.selected_ids(series, environ)
    except _runtime.ActivationError as exc:
        return Finding(BAD, f"{exc.reason}: the plugin activates no fix")
    return None


def policy(activation: _runtime.Activation, registered: bool) -> list[Finding]:
    """What the release policy did: fixes NOT active (BAD where the plugin runs: exit 1),
    activated on a release that is not covered (verified, or at the operator's risk)."""
    basis = activation.basis
    if activation.failure is not None:
        return [Finding(BAD if registered else WARN, activation.line().removeprefix(
            "vllm-patches: "))]
    if basis is not None and basis.how == _runtime.VERIFIED:
        what = _runtime.kind(Version(basis.installed))
        return [Finding(OK, f"vLLM v{basis.installed} is {what}; verified identical to "
                            f"v{basis.release} at every target ({basis.why}): the fixes run as "
                            f"on v{basis.release}")]
    if basis is not None and basis.how == _runtime.AT_OWN_RISK:
        return [Finding(WARN, f"vLLM v{basis.installed}: {basis.why}; the fixes are activated "
                              f"anyway by {_runtime.ENV_ALLOW_UNSUPPORTED}=1, at your own risk")]
    return []


def _disabled(environ: Mapping[str, str]) -> bool:
    """``VLLM_PATCHES_DISABLE`` is set (an unreadable value counts: the plugin refuses it)."""
    try:
        return _runtime.env_flag(environ, _runtime.ENV_DISABLE)
    except UserError:
        return False


def report(tensor_parallel_size: int | None = None, environ: Mapping[str, str] | None = None,
           load: bool = True) -> tuple[list[str], bool]:
    """(the report's lines, whether it found a known-bad combination or a refusal)."""
    environ = os.environ if environ is None else environ
    series = _series.load()
    lines = [f"Python {sys.version.split()[0]} ({sys.executable})"]
    vllm = _runtime.installed_vllm()
    registered = plugin_registered()
    if vllm is None:
        lines.append("vLLM: not installed")
    else:
        name, version = vllm
        lines.append(f"vLLM: {version}" + (f" (distribution {name})" if name != "vllm" else ""))
    for bad in KNOWN_BAD:
        lines.append(f"{bad.package}: {installed_version(bad.package) or 'not installed'}")
    lines.append(f"tensor parallelism: "
                 f"{tensor_parallel_size if tensor_parallel_size else 'not given'}")
    lines.append(f"covered vLLM releases: {series.describe_covered()} (and later releases of "
                 "their minor series, and development builds, whose code at every target "
                 "equals one's)")
    lines.append("vllm_patches plugin: " + ("registered" if registered else "not registered "
                 "(install this package with pip to activate the fixes in vLLM processes)"))
    variables = [f"{name}={environ[name]}" for name in (
        _runtime.ENV_DISABLE, _runtime.ENV_FIXES, _runtime.ENV_STRICT,
        _runtime.ENV_ALLOW_UNSUPPORTED, "VLLM_PLUGINS")
        if name in environ]
    lines.append("environment: " + (", ".join(variables) or "no VLLM_PATCHES_* or VLLM_PLUGINS"))
    findings: list[Finding] = []
    disabled = _disabled(environ)
    left_out = None if disabled else plugin_left_out(environ)
    if vllm is None:
        findings.append(Finding(WARN, NO_VLLM))
        findings += filter(None, [left_out, None if disabled else unknown_fixes(environ, series)])
    elif left_out is not None:
        findings.append(left_out)
    else:
        activation, found, how = _activation(environ, load, registered, vllm[1])
        findings += found
        if activation is not None and activation.disabled:
            findings.append(Finding(WARN, f"{_runtime.ENV_DISABLE} is set: no fix is active"))
        elif activation is not None and activation.failure is None:
            shown = activation.basis.describe() if activation.basis else f"v{activation.release}"
            lines.append(f"fixes on vLLM {shown}, {how}:")
            for state in activation.states:
                shown = state.state if state.state != _runtime.ACTIVE or "not loaded" not in how \
                    else "would be active"
                detail = f" ({state.detail})" if state.detail else ""
                lines.append(f"  {state.fix.id} {state.fix.slug}: {shown}{detail}")
    findings += known_bad(tensor_parallel_size)
    lines.append("checks:")
    lines += [finding.line() for finding in findings] or ["  ok: nothing to check"]
    bad = any(finding.level == BAD for finding in findings)
    lines.append("result: " + ("known-bad combination, or fixes NOT active, found" if bad
                               else "no fix is or would be active here: vLLM is not installed"
                               if vllm is None
                               else "no known problem"))
    return lines, bad


def run(args: argparse.Namespace) -> int:
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size must be 1 or more, not {args.tensor_parallel_size}")
    lines, bad = report(args.tensor_parallel_size, load=not args.no_load)
    print("\n".join(lines))
    return EXIT_REFUSED if bad else EXIT_OK
