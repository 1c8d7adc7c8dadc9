"""``benchmarks/studies/sensitivity_study.py``'s own logic on synthetic inputs (no training run; the sweep
it drives is run end to end by ``tests/analysis/test_sweep.py``): each multiplier applied to its
key (beta2 through 1 - beta2, warmup and batch rounded half up), every point accepted by the
trainer's up-front checks with the value it asked for, the critical / robust verdict against the
seed spread, the summary of a run's metrics, the plot, and bad input."""

from __future__ import annotations

import json

import pytest

from benchmarks.studies import sensitivity_study as study

BASE = {"lr": 6e-4, "warmup": 5, "weight_decay": 0.1, "beta2": 0.95, "beta1": 0.9, "init_std": 0.02,
        "batch": 6, "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "capacity_factor": 1.25,
        "eval_windows": 64}


def test_multipliers_reach_their_keys():
    assert study.apply("lr", BASE, 0.25) == {"ds.optimizer.params.lr": 0.00015}      # 6g-cleaned
    assert study.apply("capacity_factor", BASE, 4) == {"model.moe.capacity_factor": 5.0}
    # beta2 scales 1 - beta2: 0.05 -> 0.0125, 0.2 (beta2 x2 would be 1.9)
    betas = "ds.optimizer.params.betas"
    assert study.apply("beta2", BASE, 0.25) == {betas: [0.9, 0.9875]}
    assert study.apply("beta2", BASE, 4) == {betas: [0.9, 0.8]}
    # warmup 5: x1/4 = 1.25 -> 1, x1/2 = 2.5 -> 3 (half up; Python's round gives 2), x4 = 20;
    # 0.2 -> 0 is raised to 1 step
    warm = "ds.scheduler.params.warmup_num_steps"
    assert [study.apply("warmup", BASE, m)[warm] for m in (0.25, 0.5, 4, 0.04)] == [1, 3, 20, 1]
    # batch 6: x1/4 = 1.5 -> 2 sequences, eval.batches 64 / 2 = 32; x4 = 24, ceil(64 / 24) = 3
    assert study.apply("batch", BASE, 0.25) == {"ds.train_micro_batch_size_per_gpu": 2, "eval.batches": 32}
    assert study.apply("batch", BASE, 4) == {"ds.train_micro_batch_size_per_gpu": 24, "eval.batches": 3}
    for name, base, m, message in (("beta2", BASE, 25, "outside"), ("depth", BASE, 2, "not a hyperparameter"),
                                   ("capacity_factor", {**BASE, "capacity_factor": None}, 2, "dropless"),
                                   ("lr", BASE, 0, "must be > 0")):
        with pytest.raises(ValueError, match=message):
            study.apply(name, base, m)


def test_every_point_passes_the_trainers_checks_with_its_value():
    """The study's default points against the real recipe and JSON, through the trainer's own
    resolution (``plan_for``): the key exists, the value is accepted and is what runs."""
    from training.run.preflight import plan_for
    base = study.baseline_values(120)
    assert (base["warmup"], base["batch"], base["beta2"], base["capacity_factor"]) == (6, 8, 0.95, 1.25)
    for name in study.KEYS:
        for m in study.MULTIPLIERS:
            sets = study.apply(name, base, m)
            plan = plan_for(study.CONFIG, study.RECIPE, sets=study._settings(sets), steps=120)
            ds, model = plan.ds, plan.recipe.model
            got = {"lr": ds["optimizer"]["params"]["lr"],
                   "warmup": ds["scheduler"]["params"]["warmup_num_steps"],
                   "weight_decay": ds["optimizer"]["params"]["weight_decay"],
                   "beta2": ds["optimizer"]["params"]["betas"][1], "init_std": model.init_std,
                   "batch": ds["train_batch_size"], "aux_loss_coef": model.moe.aux_loss_coef,
                   "z_loss_coef": model.moe.z_loss_coef, "capacity_factor": model.moe.capacity_factor}
            want = next(iter(sets.values()))
            assert got[name] == (want[1] if name == "beta2" else want), (name, m, got[name], sets)
            if name == "batch":
                assert plan.recipe.eval.batches * want == 64, sets     # the same eval windows


def test_critical_only_beyond_the_seed_spread():
    # seeds 5.00 / 5.02 / 5.04: mean 5.02, spread 0.04
    s = study.summarize([5.00, 5.04, 5.02], {
        "robust": {0.25: 5.05, 0.5: 5.00, 2: 4.99, 4: 5.059},         # |delta| <= 0.039
        "up": {0.25: 5.02, 4: 5.07},                                  # +0.05 = 1.25 x spread
        "down": {0.5: 4.95, 2: 5.03},                                 # -0.07: sign does not matter
        "failed": {0.25: 5.02, 4: None}})
    assert s["baseline_mean"] == pytest.approx(5.02) and s["baseline_spread"] == pytest.approx(0.04)
    h = s["hparams"]
    assert h["robust"]["verdict"] == "robust at this scale" and h["robust"]["worst_multiplier"] == 4
    assert h["robust"]["deltas"][4] == pytest.approx(0.039)
    assert h["up"]["verdict"] == "critical" and h["up"]["ratio_to_spread"] == pytest.approx(1.25)
    assert h["down"]["verdict"] == "critical" and h["down"]["worst_delta"] == pytest.approx(-0.07)
    assert h["failed"]["verdict"] == "critical" and h["failed"]["failed"] == [4]
    with pytest.raises(ValueError, match="2 or more seeds"):
        study.summarize([5.0], {})


def test_run_summary_and_plot(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": i, "loss": 10.0 - i / 10} for i in range(1, 31)] + [{"step": 30, "eval_loss": 7.5}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    got = study.run_summary({"status": "ok", "run_dir": str(run)})
    # the last 20 training losses are 10 - 1.1 ... 10 - 3.0: mean 10 - 2.05
    assert got == {"eval_loss": 7.5, "train_loss": pytest.approx(7.95), "status": "ok", "seconds": None}
    assert study.run_summary({"status": "failed (exit 1)"})["eval_loss"] is None
    s = study.summarize([5.0, 5.04], {"a": {0.5: 5.01, 2: 6.5}, "b": {0.5: 5.0, 2: None}})
    study.plot(s, [0.5, 2], "synthetic", tmp_path / "s.png", [5.0, 5.04])
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_bad_input_is_one_line(capsys, tmp_path):
    assert study.main(["--out", str(tmp_path), "--hparams", "depth"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --hparams depth: not a hyperparameter") and err.count("\n") == 1
    assert study.main(["--out", str(tmp_path), "--seeds", "1"]) == 2
    assert "2 or more distinct seeds" in capsys.readouterr().err
