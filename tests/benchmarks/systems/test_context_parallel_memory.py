"""``benchmarks/systems/context_parallel_memory.py`` run short, in both scopes."""

from __future__ import annotations

import json

import pytest


def test_the_cp_memory_benchmarks_run_short(tmp_path):
    """``benchmarks/systems/context_parallel_memory.py`` (one attention layer) and its
    ``--scope model`` (the whole model beside the estimator) at 256 tokens, CP1 and CP2: the rows
    they print and write, not their figures at 16K (docs/performance/context-parallel.md)."""
    from benchmarks.systems import context_parallel_memory
    assert context_parallel_memory.main(["--seq", "256", "--cps", "1,2", "--json", str(tmp_path / "a.json")]) == 0
    rows = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert [(r["cp"], r["mode"]) for r in rows] == [(1, "-"), (2, "a2a"), (2, "allgather"), (2, "p2p")]
    assert rows[1]["saved_without_masks"] == rows[0]["saved"] / 2          # Ulysses: half, exactly
    assert context_parallel_memory.main(["--scope", "model", "--seq", "256", "--cps", "1,2",
                                         "--json", str(tmp_path / "m.json")]) == 0
    rows = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["estimate"] == pytest.approx(r["saved"], rel=5e-3) for r in rows)
    assert all(0.5 < r["saved"] / rows[0]["saved"] < 0.6 for r in rows[1:])
