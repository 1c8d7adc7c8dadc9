"""Start-up on several ranks: no collective waits on single-rank work.

Rank 0 trains the tokenizer and tokenizes the corpus while the other ranks poll for a marker file
(``DistContext.rank0_first``). Here rank 0's tokenizer build takes 12 s while every process
group's timeout is 6 s (``parallel.timeout_minutes=0.1``): a collective barrier around that work
would fail with a gloo timeout; polling lets the run start and train. The other ranks take rank
0's results from the marker (the tokenizer's folder, the prepared prefixes): sampling the corpus
or planning the preparation on them raises.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.runs import SMALL

REPO = Path(__file__).resolve().parents[3]


def test_slow_rank0_startup_outlasts_the_process_group_timeout(warm_launcher, tmp_path):
    run_dir = tmp_path / "run"
    warm_launcher.script("tests/training/run/_slow_rank0_run.py",
                         ["--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run_dir), "--steps", "2",
                          "--set", *SMALL, "parallel.timeout_minutes=0.1"],
                         tmp_path / "run.log", extra_env={"SLOW_RANK0_S": "12"})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert not list((REPO / ".cache" / "startup").glob("*")), "start-up markers left behind"
    assert os.environ.get("RANK") is None
