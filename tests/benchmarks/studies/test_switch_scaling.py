"""The Switch scaling study's computations (``benchmarks/studies/switch_scaling.py``,
``analysis/switch_scaling.py``), without training:

* expert placement on a count vector worked out by hand: two hot experts side by side
  (``[10, 10, 1, 1, 1, 1, 1, 1]``) land on one rank under ``contiguous`` and on two under
  ``round_robin``; at ep = E every placement is the same; ep must divide E;
* the script's bad input (one line naming the flag, exit 2) and its summary of a finished sweep:
  synthetic run directories whose eval losses, step times and routed counts are known, read
  back through the same code that reads real runs.

Everything is integer or short decimal arithmetic, so values are compared to 1e-12 (relative).
Whether more experts lower the loss is not asserted: at a few dozen steps the tiny models do
not separate by more than their seed spread (E=16 was 0.015 above dense at 60 steps, one seed),
and the study itself runs for half an hour (docs/switch.md).
"""

from __future__ import annotations

import json

import pytest

from analysis import switch_scaling as ss
from benchmarks.studies import switch_scaling as bench

HOT_PAIR = [10, 10, 1, 1, 1, 1, 1, 1]      # experts 0 and 1 take 20 of 26 assignments
REL = 1e-12


def test_placement_of_a_known_count_vector():
    contiguous, round_robin = (ss.placement(8, 2, k) for k in ("contiguous", "round_robin"))
    assert contiguous == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert round_robin == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # contiguous: rank 0 holds both hot experts, 22 of 26 -> 22 / 13; round-robin: 13 and 13
    assert ss.rank_loads(HOT_PAIR, contiguous) == [22, 4]
    assert ss.max_over_mean(ss.rank_loads(HOT_PAIR, contiguous)) == pytest.approx(22 / 13, rel=REL)
    assert ss.max_over_mean(ss.rank_loads(HOT_PAIR, round_robin)) == pytest.approx(1.0, rel=REL)
    # ep = E: one expert per rank whatever the placement; the busiest is 10 / (26 / 8)
    assert ss.placement(8, 8, "contiguous") == ss.placement(8, 8, "round_robin") == [[e] for e in range(8)]
    # the load-aware placement at ep 4 (2 per rank): each hot expert with a cold one, 11 / 6.5
    aware = ss.balanced_placement(HOT_PAIR, 4)
    assert sorted(len(r) for r in aware) == [2, 2, 2, 2]
    assert ss.max_over_mean(ss.rank_loads(HOT_PAIR, aware)) == pytest.approx(11 / 6.5, rel=REL)

    study = ss.placement_study([HOT_PAIR], [HOT_PAIR], 2, draws=200)
    assert study["contiguous"] == pytest.approx(22 / 13, rel=REL)
    assert study["round_robin"] == pytest.approx(1.0, rel=REL)
    assert study["load_aware"] == pytest.approx(1.0, rel=REL)
    # a random split of 8 into 4 + 4 puts both hot experts together with probability 3/7
    assert 1.0 <= study["random"]["p05"] <= study["random"]["mean"] <= study["random"]["p95"] <= 22 / 13
    eight = ss.placement_study([HOT_PAIR], [HOT_PAIR], 8, draws=50)
    assert eight["contiguous"] == eight["round_robin"] == pytest.approx(10 / 3.25, rel=REL)

    with pytest.raises(ValueError, match=r"num_experts \(12\) is not divisible by .*expert_parallel_size \(8\)"):
        ss.placement(12, 8, "contiguous")
    # switch_base_128: 8 x 512 tokens per micro-batch over the ep group, capacity 1.25, 128 experts
    assert ss.rows_per_expert(8 * 512, 1, 1.25, 128) == pytest.approx(40.0, rel=REL)


@pytest.mark.parametrize("flags, named", [
    (["--experts", "1,2,x"], "--experts"),
    (["--steps", "0"], "--steps"),
    (["--steps", "20", "--eval-every", "50"], "--eval-every"),
    (["--placement-ep", "3"], "--placement-ep"),
    (["--placement-experts", "32", "--experts", "1,8"], "--placement-experts"),
    (["--skip-runs"], "--skip-runs"),
])
def test_bad_input_is_one_line(tmp_path, capsys, flags, named):
    assert bench.main(["--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and named in err and "\n" not in err, err


def _run(run_dir, E: int, seed: int, final_eval: float, layer_counts) -> None:
    """A finished 20-step run: step_time_s = 1 + step/100 (+ E/1000), eval at 10 and 20, routed
    counts every 10 steps (``layer_counts`` at step 20, uniform at 10)."""
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(1, 21):
        row = {"step": step, "loss": 6.0, "tokens": 1024 * step, "tokens_per_s": 1000.0,
               "step_time_s": 1 + step / 100 + E / 1000, "expert_load_max_over_mean": 1.0,
               "dropped_frac": 0.0}
        if step % 10 == 0:
            counts = layer_counts if step == 20 else [[1024 // E] * E] * 2
            row["moe_layers"] = {"blocks": [1, 3], "tokens_per_expert": counts}
        rows.append(row)
        if step % 10 == 0:
            rows.append({"step": step, "eval_loss": final_eval + (0.5 if step == 10 else 0.0)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_of_a_finished_sweep(tmp_path):
    out = tmp_path / "study"
    sweep = out / "sweep"
    evals = {(1, 1234): 5.0, (1, 1235): 5.2, (8, 1234): 4.9, (8, 1235): 4.95}
    results = []
    for i, ((E, seed), loss) in enumerate(evals.items()):
        counts = [[1024]] * 2 if E == 1 else [HOT_PAIR, HOT_PAIR[::-1]]
        _run(sweep / f"run{i:03d}", E, seed, loss, counts)
        results.append({"name": f"run{i:03d}", "status": "ok", "run_dir": str(sweep / f"run{i:03d}"),
                        "point": {"model.moe.num_experts": E, "train.seed": seed}, "seconds": 30.0})
    (sweep / "results.json").write_text(json.dumps(results))
    report, png = tmp_path / "r.json", tmp_path / "img" / "s.png"
    assert bench.main(["--out", str(out), "--skip-runs", "--experts", "1,8", "--steps", "20",
                       "--eval-every", "10", "--placement-experts", "8", "--placement-ep", "2,8",
                       "--json", str(report), "--png", str(png)]) == 0
    got = json.loads(report.read_text())
    dense, sparse = got["scaling"]
    assert (dense["num_experts"], sparse["num_experts"]) == (1, 8)
    assert dense["eval_loss"]["mean"] == pytest.approx(5.1, rel=REL)
    assert dense["eval_loss"]["spread"] == pytest.approx(0.2, rel=1e-9)
    assert sparse["eval_loss"]["mean"] == pytest.approx(4.925, rel=REL)
    assert sparse["eval_loss_curve"] == pytest.approx([5.425, 4.925], rel=REL)
    # steps 11..20 after the warm-up: fastest decile is step 11's, the median halfway 15 / 16
    assert sparse["fast_step_s"]["mean"] == pytest.approx(1.11 + 0.008, rel=REL)
    assert sparse["median_step_s"]["mean"] == pytest.approx(1.155 + 0.008, rel=REL)
    assert sparse["eval_wall_s_fast"] == pytest.approx([10 * 1.118, 20 * 1.118], rel=REL)
    assert sparse["active_params"] == pytest.approx(dense["active_params"], rel=0.01)   # + router
    # 7 more experts of 3 x 128 x 256 and 7 more router rows of 128, in each of the 2 MoE blocks
    assert sparse["params_per_expert"] == 3 * 128 * 256
    assert sparse["total_params"] - dense["total_params"] == 2 * 7 * (3 * 128 * 256 + 128)
    # scored on step 20 only (the run's second half): the hot pair sits on one rank of two under
    # contiguous in both layers (reversed: experts 6 and 7), on two under round-robin
    p = got["placement"]["by_experts"]["8"]
    assert p["2"]["contiguous"] == pytest.approx(22 / 13, rel=REL)
    assert p["2"]["round_robin"] == pytest.approx(1.0, rel=REL)
    assert p["8"]["contiguous"] == p["8"]["round_robin"] == pytest.approx(10 / 3.25, rel=REL)
    assert [r["rows_per_expert"] for r in got["expert_memory"]["rows"]][:2] == pytest.approx([640, 320], rel=REL)
    assert png.stat().st_size > 10_000 and (png.parent / "s_placement.png").stat().st_size > 10_000
