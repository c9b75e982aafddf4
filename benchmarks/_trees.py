"""Stock and patched trees of one release for a benchmark, built as a lane builds them
(tools/lanes.py), so that every comparing benchmark measures the trees the tests use."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class BenchTrees:
    """The lane venv's Python, the two trees by name ("stock", "patched"), the release,
    and the vLLM platform metadata its tests need (``lanes.platform_dist_info``)."""

    python: Path
    trees: dict[str, Path]
    release: str
    dist_root: Path

    def env(self, name: str) -> dict[str, str]:
        """The environment of a measurement in tree ``name``, as a lane runs its tests."""
        import lanes

        return lanes.vllm_test_env(self.trees[name], self.dist_root)

    def alternate(self, script: str, argument: str, rounds: int) -> dict[str, list[float]]:
        """``script --measure argument`` in each tree, stock and patched alternating for
        ``rounds`` rounds (drift hits both alike): each run's ``median_ns``, by tree."""
        results: dict[str, list[float]] = {name: [] for name in self.trees}
        for _ in range(rounds):
            for name, tree in self.trees.items():
                out = subprocess.run([str(self.python), script, "--measure", argument],
                                     env=self.env(name), cwd=tree, check=True,
                                     capture_output=True, text=True).stdout
                results[name].append(json.loads(out.splitlines()[-1])["median_ns"])
        return results


def stock_and_patched(release_name: str, fixes: str | None = None) -> BenchTrees:
    """Fresh stock and patched clones of ``release_name`` (fetched when missing); the
    patched one takes every fix the release needs, or only ``fixes`` (``ID[,ID...]``)."""
    sys.path[:0] = [str(REPO / "tools"), str(REPO)]
    import lanes

    from vllm_patches._catalog import releases as _releases

    release = _releases.parse_release(release_name)
    source = _releases.fetch(release)
    python = lanes.ensure_venv(release, source)
    bench_dir = lanes.BUILD / "bench" / f"v{release}"
    trees = {"stock": lanes.fresh_clone(source, bench_dir / "stock"),
             "patched": lanes.fresh_clone(source, bench_dir / "patched")}
    subprocess.run([sys.executable, "-m", "vllm_patches", "apply", str(trees["patched"]),
                    *(["--fix", fixes] if fixes else [])],
                   cwd=REPO, check=True, capture_output=True)
    return BenchTrees(python, trees, str(release),
                      lanes.platform_dist_info(release, bench_dir / "dist"))
