"""The Muon study short (``benchmarks/studies/muon_study.py``: the tiny dense model, one lr, one
seed, 6 steps, and its two QK-clip runs): it writes its JSON and figure; both optimizers see the
same tokens and their first step's loss (before any update, same weights and batch) is bit for
bit equal; the QK-clip run's tau is half the largest logit of the run without it, which logged
logits and no clip. Which optimizer ends lower after 8 steps is not asserted (the study's own
numbers are in docs/muon.md)."""

from __future__ import annotations

import json

from tests.runs import python


def test_the_muon_study_runs_short(tmp_path):
    out = tmp_path / "muon"
    done = python("-m", "benchmarks.studies.muon_study", "--out", str(out), "--results", str(out), "--figures",
                  str(out), "--steps", "6", "--seeds", "1", "--lrs", "1e-3", "--models", "dense",
                  "--eval-batches", "2", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "muon.png").stat().st_size > 10_000
    written = json.loads((out / "muon.json").read_text())
    assert {"models", "machine", "command", "wall_s", "qk_clip"} <= set(written)
    dense = written["models"]["dense"]
    assert dense["best_lr"] == {"adamw": 1e-3, "muon": 1e-3}
    runs = dense["runs"]
    for seed in ("1",):
        adamw, muon = runs[f"adamw-s{seed}"], runs[f"muon-s{seed}"]
        assert adamw["tokens"] == muon["tokens"] and adamw["tokens"][-1] == 6 * 8 * 128
        assert adamw["smoothed_loss"][0] == muon["smoothed_loss"][0]           # same weights, same batch
        assert adamw["max_logit"] == [] and muon["step_time_s"] > 0
    assert dense["paired"]["final_eval_loss"]["verdict"] == "within noise"     # one seed measures nothing
    assert len(dense["paired"]["tokens_to_adamw_final_loss"]["fraction_of_adamw_tokens"]) == 1
    qk = written["qk_clip"]
    assert len(qk["log_only"]["max_logit"]) == len(qk["clipped"]["max_logit"]) == 6
    assert qk["tau"] == round(max(qk["log_only"]["max_logit"]) / 2, 2)
    assert qk["clipped"]["max_logit"][0] == qk["log_only"]["max_logit"][0]    # measured before the first clip
    assert max(qk["clipped"]["max_logit"][1:]) < max(qk["log_only"]["max_logit"][1:])
