"""The sweep of upstream (vllm_patches/upstream_sweep.toml) holds against the series, and
its generated table (docs/upstream-sweep.md) is fresh."""

import dataclasses

import pytest
from packaging.version import Version

from vllm_patches._catalog import series as _series
from vllm_patches._catalog import sweep as _sweep

SERIES = _series.load()
SWEEP = _sweep.load(SERIES)


def test_the_doc_is_what_the_data_generates():
    assert _sweep.DOC.read_text() == _sweep.render(SERIES, SWEEP), \
        "stale: run `python tools/upstream_sweep.py`"


def test_every_fix_that_backports_a_change_of_the_sweep_is_a_row():
    """A fix of the series with ``upstream_since`` and older releases is a backport: the
    sweep has its upstream PR, with the same release."""
    rows = {(c.fix, c.upstream, c.since) for c in SWEEP.changes if c.kind == "backport"}
    for fix in SERIES.fixes:
        if fix.backport:
            assert (fix.id, fix.pr, fix.upstream_since) in rows, fix.id


def test_a_change_is_one_row_and_a_series_fix_backports_one():
    """An upstream PR may fix two bugs (two rows); no bug is written twice, and a fix of
    the series backports at most one row."""
    assert len({(c.upstream, c.bug) for c in SWEEP.changes}) == len(SWEEP.changes)
    fixes = [c.fix for c in SWEEP.changes if c.kind == "backport" and c.fix]
    assert len(set(fixes)) == len(fixes)


BAD = [
    ({"affected": "<0.18.0"}, "holds no covered release"),
    ({"affected": "from 0.22"}, "no PEP 440 specifier"),
    ({"affected": ">=0.30.0"}, "since must be a covered release after every affected one"),
    ({"since": Version("0.31.1")}, "since must be a covered release"),
    ({"fix": "F99"}, "is not in the series"),
    ({"fix": "", "note": ""}, "needs a series fix or a note"),
    ({"kind": "fixed"}, "kind is one of"),
    ({"kind": "unrelated"}, "names no fix"),
    ({"fix": "F2", "kind": "interacts", "note": ""}, "names the fix and says how"),
    ({"fix": "F1"}, "F1 backports"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_a_bad_change_is_refused(change, message, monkeypatch):
    good = _sweep.Change(upstream="https://github.com/vllm-project/vllm/pull/50789",
                         since=Version("0.31.0"), bug="b", affected=">=0.22.0,<0.31.0",
                         kind="backport", fix="F17", note="")
    _sweep._check(good, SERIES)
    with pytest.raises(ValueError, match=message):
        _sweep._check(dataclasses.replace(good, **change), SERIES)
