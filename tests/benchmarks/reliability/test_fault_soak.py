"""``benchmarks/reliability/fault_soak.py``, its short version: random faults on DP2, the same
command rerun after each, every step's loss against the uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.runs import REPO


def test_the_short_soak_survives_every_fault_and_loses_no_step(tmp_path):
    """``benchmarks/reliability/fault_soak.py``, its short version: 3 random faults (seed 0) on DP2."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.reliability.fault_soak", "--layouts", "dp2",
                           "--faults", "3", "--seed", "0", "--work", str(tmp_path / "work"),
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result] = json.loads(out.read_text())
    assert (result["tried"], result["survived"], result["complete"]) == (3, 3, True), result
    assert result["max_rel_diff"] <= 1e-6 and all(f["ok"] for f in result["faults"]), result
    assert "| dp2 (" in proc.stdout and "| 3 | 3 |" in proc.stdout, proc.stdout
