"""Write docs/upstream-sweep.md from vllm_patches/upstream_sweep.toml (checked against the
series first); tests/tool/test_upstream_sweep.py fails while the doc is stale.

Usage: python tools/upstream_sweep.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_patches._catalog import series as _series
from vllm_patches._catalog import sweep as _sweep

if __name__ == "__main__":
    series = _series.load()
    _sweep.DOC.write_text(_sweep.render(series, _sweep.load(series)))
    print(f"wrote {_sweep.DOC}")
