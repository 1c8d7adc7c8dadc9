"""Start-up on several ranks: no collective waits on single-rank work.

Rank 0 trains the tokenizer and tokenizes the corpus while the other ranks poll for a marker file
(``DistContext.rank0_first``). Here rank 0's tokenizer build takes 12 s while every process
group's timeout is 6 s (``parallel.timeout_minutes=0.1``): a collective barrier around that work
would fail with a gloo timeout; polling lets the run start and train.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import free_port
from tests.runs import SMALL, env

REPO = Path(__file__).resolve().parents[2]


def test_slow_rank0_startup_outlasts_the_process_group_timeout(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(REPO / "tests" / "training" / "_slow_rank0_run.py"),
           "--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run_dir), "--steps", "2",
           "--set", *SMALL, "parallel.timeout_minutes=0.1"]
    proc = subprocess.run(cmd, cwd=REPO, env={**env(), "SLOW_RANK0_S": "12"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert not list((REPO / ".cache" / "startup").glob("*")), "start-up markers left behind"
    assert os.environ.get("RANK") is None
