"""The MTP study short (``benchmarks/studies/mtp_study.py``: mtp_depth 0 and 1, one seed, 8 steps, one
sweep): it writes its JSON and figure, the MTP arm's rows carry one depth's ``mtp_loss`` and the
control's none, and the pairing holds: both arms see the same tokens, and their first step's
main-head loss (before any update, from the same main-model weights and batch) is bit for bit
equal. Nothing about which arm ends lower (within noise at 8 steps) or slower (a loaded
machine) is asserted; the study's own numbers are in docs/modern-moe.md.
"""

from __future__ import annotations

import json

from tests.runs import python


def test_the_mtp_study_runs_short(tmp_path):
    out = tmp_path / "mtp"
    done = python("-m", "benchmarks.studies.mtp_study", "--out", str(out), "--results", str(out), "--figures",
                  str(out), "--steps", "8", "--seeds", "1",
                  "--depths", "0", "1", "--eval-every", "4", "--eval-batches", "2", timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "mtp.png").stat().st_size > 10_000
    written = json.loads((out / "mtp.json").read_text())
    assert written["depths"] == [0, 1] and written["seeds"] == ["1"] and written["steps"] == 8
    assert {"arms", "paired", "runs", "machine", "wall_s", "command"} <= set(written)
    control, mtp = written["runs"]["depth0-seed1"], written["runs"]["depth1-seed1"]
    assert control["final_mtp_loss"] == [] and control["smoothed_mtp_loss"] == []
    assert len(mtp["final_mtp_loss"]) == 1 and len(mtp["smoothed_mtp_loss"]) == 1
    for run in (control, mtp):
        assert run["eval_steps"] == [4, 8] and len(run["eval_loss"]) == 2, run
        assert run["tokens"] == 8 * 8 * 128 and run["step_time_s"] > 0
    assert mtp["first_loss"] == control["first_loss"]              # same weights, same batch
    arms = written["arms"]
    assert arms["1"]["total_params"] > arms["0"]["total_params"]
    assert arms["1"]["active_params"] == arms["0"]["active_params"]  # MTP counts in the total only
    paired = written["paired"]["1 - 0"]
    assert paired["first_loss_equal"] and paired["flops_ratio"] > 1
    assert paired["final_eval_loss"]["per_seed"] == [mtp["final_eval_loss"] - control["final_eval_loss"]]
    assert paired["final_eval_loss"]["verdict"] == "within noise"  # one seed measures no effect
    assert len(paired["step_time_ratio"]["per_seed"]) == 1
