"""``benchmarks/peers/optimizer_step.py`` on the tiny recipe, 3 steps: a row per AdamW implementation
(the script itself asserts that DeepSpeed built the optimizer each row asks for: torch's AdamW
with ``foreach`` / ``fused``, ``DeepSpeedCPUAdam`` under offload), and the losses of the four
runs agree. A smoke test of the plumbing: timings are not asserted (the
figures live in docs/performance/optimizer-step.md, from the script's own output).

Tolerance: the implementations differ only in the rounding of the update, so after 2 updates
the losses agree to float32 rounding (1.1e-7 relative measured on 4 steps); 1e-5 leaves room
for the rounding and still fails if a variant trained other weights or batches."""

from __future__ import annotations

import subprocess
import sys

from tests.runs import REPO, env


def test_a_row_per_implementation_with_matching_losses():
    cmd = [sys.executable, "-m", "benchmarks.peers.optimizer_step", "--size", "tiny", "--steps", "3",
           "--warmup", "1", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| implementation")]
    assert [r[0].strip() for r in rows] == ["stock JSON", '"foreach": true', '"fused": true',
                                           "offload, DeepSpeedCPUAdam"], proc.stdout
    for cells in rows:
        step, optimizer, tokens = (float(c.strip().replace(",", "")) for c in cells[1:4])
        assert 0 < optimizer < step and tokens > 0, cells
        assert float(cells[5]) <= 1e-5, cells
    assert rows[0][4].strip() == "1.00x"
