"""Start-up on several ranks: no collective waits on single-rank work.

Rank 0 trains the tokenizer and tokenizes the corpus while the other ranks poll for a marker file
(``DistContext.rank0_first``). Here rank 0's tokenizer build takes 12 s while every process
group's timeout is 6 s (``parallel.timeout_minutes=0.1``): a collective barrier around that work
would fail with a gloo timeout; polling lets the run start and train. The other ranks take rank
0's results from the marker (the tokenizer's folder, the prepared prefixes): sampling the corpus
or planning the preparation on them raises.

A preemption signal in start-up (here SIGUSR1, which the launch scripts send, though the recipe
lists only SIGTERM) is recorded, not fatal: the run saves its first step and exits 75, and the
same command resumes it to the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.runs import SMALL, rows

REPO = Path(__file__).resolve().parents[3]


def test_slow_rank0_startup_outlasts_the_process_group_timeout(warm_launcher, tmp_path):
    run_dir = tmp_path / "run"
    warm_launcher.script("tests/training/run/_slow_rank0_run.py",
                         ["--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run_dir), "--steps", "2",
                          "--set", *SMALL, "parallel.timeout_minutes=0.1"],
                         tmp_path / "run.log", extra_env={"SLOW_RANK0_S": "12",
                                                          "LAUNCH_ID_OUT": str(tmp_path / "launch_id")})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    # This launch's markers only: another test's run may be in its start-up beside this one.
    launch_id = (tmp_path / "launch_id").read_text()
    assert not list((REPO / ".cache" / "startup").glob(f"{launch_id}-*")), "start-up markers left behind"
    assert os.environ.get("RANK") is None


def test_a_preemption_signal_in_start_up_saves_the_first_step_and_exits_75(warm_launcher, tmp_path):
    args = ["--config", "ds_configs/zero1_fp32.json", "--steps", "4", "--set", *SMALL, "eval.every=0",
            "train.preemption_signals=[SIGTERM]"]
    run_dir = tmp_path / "signalled"
    rc = warm_launcher.run(["tests/training/run/_signal_at_startup_run.py", "--run-dir", str(run_dir), *args],
                           tmp_path / "signalled.log", nproc=2)
    log = (tmp_path / "signalled.log").read_text()
    assert rc == 75, (rc, log[-3000:])
    assert "received SIGUSR1" in log and "preempted at step 1" in log, log[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step00000001"
    assert warm_launcher.run(["launch/train.py", "--run-dir", str(run_dir), *args],
                             tmp_path / "resumed.log", nproc=2) == 0
    assert "resumed from" in (tmp_path / "resumed.log").read_text()
    assert warm_launcher.run(["launch/train.py", "--run-dir", str(tmp_path / "whole"), *args],
                             tmp_path / "whole.log", nproc=2) == 0
    resumed, whole = rows(run_dir), rows(tmp_path / "whole")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(whole, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]     # as every resume test
