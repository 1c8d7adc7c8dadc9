"""``benchmarks/peers/end_to_end.py`` on the tiny recipe: the side-by-side table (both
implementations, every phase column, the ratio line) from a 3-step run, and ``--op-profile``'s
per-op tables for both models. A smoke test of the script's plumbing: its timings are not
asserted (speed claims live in docs/performance/end-to-end.md, from the script's own output)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.runs import REPO, env


def _run(*args: str) -> str:
    cmd = [sys.executable, "-m", "benchmarks.peers.end_to_end", "--sizes", "tiny", "--threads", "1", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_side_by_side_table_and_the_ratio():
    out = _run("--steps", "3", "--warmup", "1")
    rows = [ln for ln in out.splitlines() if ln.startswith("| tiny |")]
    assert [r.split("|")[3].strip() for r in rows] == ["ours (trainer)", "transformers Mixtral"], out
    for row in rows:                       # tokens/s, step, forward, backward, optimizer, other
        cells = [c.strip().replace(",", "") for c in row.split("|")[4:10]]
        assert all(float(c) >= 0 for c in cells) and float(cells[0]) > 0, row
    assert re.search(r"^tiny: ours / transformers tokens/s = \d+\.\d\d ", out, re.M), out


def test_op_profile_lists_both_models_top_ops():
    out = _run("--op-profile")
    assert "\nours:\n" in out and "\ntransformers Mixtral:\n" in out, out
    assert out.count("aten::mm") >= 2, out                   # the GEMMs, in both tables
    assert "| tiny |" not in out                             # the profile replaces the timing run


def test_bad_sizes_and_steps_are_one_line_each():
    for args, line in ((["--sizes", "tiny,huge"], "--sizes: huge is not one of tiny,mid"),
                       (["--steps", "2", "--warmup", "2"],
                        "--warmup (2) must be >= 0 and below --steps (2): the later steps are timed")):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.peers.end_to_end", *args], cwd=REPO, env=env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", proc
        assert proc.stderr.strip().splitlines() == [f"end_to_end.py: error: {line}"], proc.stderr
